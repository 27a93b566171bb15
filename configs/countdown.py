"""The testbed of the studies (experiments/): countdown with a warm start on partly wrong traces.

The policy starts far from perfect (greedy accuracy 0.07 on four digits after its 1000-step warm
start, 30% of the traces it imitated wrong; the best trivial answer scores 0.027,
docs/tasks.md) on a task where many answers of different lengths are correct, so entropy,
length and strategy can move under RL. `configs/countdown.py` is the CPU setting (a study's
16-run pack in minutes on 2 cores); `configs/countdown.py:gpu` the larger setting for a GPU:
a 4-layer d_model 256 policy (3.2M parameters), more prompts and steps;
`configs/countdown.py:moe` the CPU setting's mixture-of-experts twin (`recipes.MOE_MODEL`: 4
routed experts of width 64, top-2, in every layer, R3 replay), for the MoE studies.
"""

from jaxrl_llm.config import default_config, recipes

SETTINGS = ("cpu", "gpu", "moe")


def get_config(setting: str = "cpu"):
  """The default config on countdown at `setting` (cpu | gpu)."""
  if setting not in SETTINGS:
    raise ValueError(f"configs/countdown.py:{setting}: the settings are {' | '.join(SETTINGS)}")
  c = default_config()
  c.task.name, c.task.wrong_traces = "countdown", 0.3
  c.sft.steps = 1000
  c.train.num_steps, c.train.eval_every, c.train.log_every = 400, 50, 10
  c.train.pass_k = 16  # pass@1..16 from 16 samples per held-out prompt: the studies' pass@k curves
  if setting == "gpu":
    c.model.d_model, c.model.mlp_dim, c.model.num_layers = 256, 1024, 4
    c.model.num_heads, c.model.num_kv_heads, c.model.head_dim = 8, 4, 32
    c.rl.num_prompts, c.sft.steps, c.train.num_steps = 64, 1000, 1000
  if setting == "moe":
    recipes.apply(c, recipes.MOE_MODEL)
  return c
