"""GRPO on arithmetic word problems from SmolLM2-135M-Instruct, a real pretrained chat model.

Get the model and the data first (93 MB download, 645 MB on disk, under a minute):

  python tools/get_smollm2.py
  python -m jaxrl_llm.main --config=configs/smollm2_arith.py --workdir=/tmp/smollm2

The problems (`jaxrl_llm/data/arith.py`) are two- and three-operand + − × word problems with
numbers up to three digits, in several phrasings, held out by operands; the prompt asks for a
final `Answer: N` line, which `answer_line_correct` checks and `answer_line_format` rewards a
little on its own. No trivial answer (a constant, an operand echoed back, the first two combined)
scores 2% on the held-out split (`trivial.json` beside the data).

Settings (`--config=configs/smollm2_arith.py:SETTING`):
  lora  (default) rank-16 adapters on every projection, 16 rows × 64 new tokens an update:
        5-13 minutes on a 2-core CPU (30 updates, evaluations at 0, 15 and 30 on 64 problems);
  full  every parameter trained, bfloat16 compute, 256 rows an update, 200 updates, the layers
        scanned (one layer compiled, not 30), the learner's slices sized by the device's
        memory (rl.microbatch_tokens=auto): a GPU run.
  tool  lora with the in-graph `arithmetic` tool: the model may write `<tool_call>12 * 35</tool_call>`,
        the result comes back in a ChatML `tool` turn inside the same program, and it goes on
        (up to 2 calls, 48 tokens a segment; the tool's tokens are never learned);
  full_tool  full with that tool: a GPU run.
  calc  lora with the in-graph `arithmetic_inline` tool: where the model writes a calculation
        and ` =` in its own working ("so 12 * 35 ="), the program writes the value (" 420") and
        the model goes on (up to 3 calls, 96 new tokens; the values are never learned); 60
        updates, evaluations at 0, 30 and 60 on 64 problems (without the format reward,
        `--config.task.reward_weights.answer_line_format=0`: experiments/tool_use/real_calc_format.md);
  full_calc  full with that tool: a GPU run.
The model and data paths follow `$JAXRL_LLM_CACHE` (default ~/.cache/jaxrl_llm), as the script.
"""

import os

import ml_collections

from jaxrl_llm.config import recipes
from jaxrl_llm.models import pretrained

SETTINGS = ("lora", "full", "tool", "full_tool", "calc", "full_calc")
SYSTEM = (
  "You are a math assistant. Solve the problem, then write the result on a final line as: "
  "Answer: <number>"
)
CALC_SYSTEM = (
  "You are a math assistant with a calculator: write a calculation such as 14 * 23 = and its "
  "result is filled in. Solve the problem, then write the result on a final line as: "
  "Answer: <number>"
)
TOOL_SYSTEM = (
  "You are a math assistant with a calculator: write <tool_call>14 * 23</tool_call> and "
  "the result comes back. End with a final line: Answer: <number>"
)


def get_config(setting: str = "lora"):
  """GRPO + SmolLM2-135M-Instruct + arithmetic word problems at `setting` (one of SETTINGS)."""
  if setting not in SETTINGS:
    raise ValueError(f"configs/smollm2_arith.py:{setting}: the settings are {' | '.join(SETTINGS)}")
  data = pretrained.data_dir()  # written by tools/get_smollm2.py
  c = recipes.get_config("grpo")
  c.model.checkpoint = pretrained.model_dir()  # written by tools/get_smollm2.py
  c.data.train_files = os.path.join(data, "train.jsonl")
  c.data.eval_files = os.path.join(data, "eval.jsonl")
  c.data.template = "chat"  # the model's ChatML template around the problem
  c.data.prompt_len = 96  # the longest problem with the system message below: 92 tokens
  c.data.system_prompt = SYSTEM
  c.data.correct_term = "answer_line_correct"
  c.task.reward_weights = ml_collections.ConfigDict(
    {"answer_line_correct": 1.0, "answer_line_format": 0.2}
  )
  c.sampling.temperature = 0.7
  c.sampling.group_size = 8
  c.sampling.max_new_tokens = 64
  c.sft.steps = 0
  c.kl.beta = 0.0
  c.rl.num_minibatches = 1  # one update per rollout: on-policy, no separate old-policy pass
  c.optim.warmup_steps = 0
  c.optim.decay_to = 1.0
  c.optim.weight_decay = 0.0
  c.train.log_every = 1
  c.train.pass_k = 1
  if setting in ("tool", "full_tool"):
    c.data.system_prompt = TOOL_SYSTEM
    c.data.prompt_len = 112  # the longest problem with the system message above: 110 tokens
    c.sampling.tool = "arithmetic"  # in-graph, the usual precedence (jaxrl_llm/envs.py)
    c.sampling.max_turns = 3
    c.sampling.turn_tokens = 48
    c.sampling.max_new_tokens = 144  # three segments of 48 (the tool's answers count too)
  if setting in ("calc", "full_calc"):
    c.data.system_prompt = CALC_SYSTEM
    c.data.prompt_len = 120  # the longest problem with the system message above: 115 tokens
    c.sampling.tool = "arithmetic_inline"  # in-graph, after ` =` in the model's own text
    c.sampling.max_turns = 4
    c.sampling.max_new_tokens = 96  # the working and its values (the untrained model's is longer)
  if setting in ("lora", "tool", "calc"):
    c.model.lora_rank = 16
    c.model.lora_alpha = 32.0
    c.optim.learning_rate = 2e-4
    c.rl.num_prompts = 2
    c.rl.remat = "none"  # 16 rows fit without recomputing the forward pass (auto: full from 1e8)
    c.task.eval_size = 64
    c.train.num_steps, c.train.eval_every, c.train.checkpoint_every = 30, 15, 15
    if setting == "calc":  # 10-15 minutes on a 2-core CPU (experiments/tool_use/real_calc.md)
      c.train.num_steps, c.train.eval_every, c.train.checkpoint_every = 60, 30, 30
  else:
    c.model.dtype = "bfloat16"  # compute dtype; log-probs and log-ratios stay float32
    c.model.scan_layers = True  # compiles in a fraction of the unrolled time: a 9-minute GPU call
    c.optim.learning_rate = 2e-6
    c.rl.num_prompts = 32
    # Learner slices from the device's plans: on an H200 the default 4096 tokens a slice made
    # 16 slices with full recomputation (docs/gpu_runs/2026-12-04_h200_smollm2/ours.log); the
    # whole minibatch in one slice, no recomputation, plans 49 GiB on the CPU backend.
    c.rl.microbatch_tokens = "auto"
    c.task.eval_size = 500
    c.train.num_steps, c.train.eval_every, c.train.checkpoint_every = 200, 20, 100
  return c
