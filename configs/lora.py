"""`lora`: the embedded default trained through low-rank adapters on a frozen base.

Rank-32 adapters on every projection (attention q/k/v/o, MLP gate/up/down) of the default's
randomly initialised 2-layer policy; the embeddings, norms and projections stay as initialised,
and the KL reference (when `kl.beta` > 0) is that base. Adapters learn with higher rates than
full training (the warm start's 1e-2, RL's 1e-3) and a longer warm start (100 steps).
"""

from jaxrl_llm.config import default_config


def get_config():
  """The default config with rank-32 adapters and the rates they learn with."""
  c = default_config()
  c.model.lora_rank = 32  # the widest the default's k/v projections allow (2 heads x 16)
  c.optim.learning_rate = 1e-3
  c.sft.learning_rate = 1e-2
  c.sft.steps = 100
  return c
