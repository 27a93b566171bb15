"""Objectives library: advantages, policy surrogates, corrections, KL, aggregation, shaping.

Pure functions over arrays, one per entry of the spec (objectives.md §1-§8); `registry` maps the
config names to them and `policy_loss` composes surrogate, behaviour weight and aggregation.
"""

from jaxrl_llm.objectives._common import masked_mean
from jaxrl_llm.objectives.advantages import (
  batch_std,
  gae,
  grpo,
  mean_only,
  reinforce_baseline,
  reinforce_pp_baseline,
  rloo,
  whiten,
)
from jaxrl_llm.objectives.aggregation import (
  AGGREGATION_MODES,
  aggregate,
  aggregate_seq,
  normalizer,
)
from jaxrl_llm.objectives.corrections import behaviour_weight, parse_correction
from jaxrl_llm.objectives.kl import KL_ESTIMATORS, kl_penalty
from jaxrl_llm.objectives.loss import policy_loss
from jaxrl_llm.objectives.policy import (
  cispo,
  gmpo,
  gspo,
  gspo_token,
  pg,
  ppo_clip,
  router_shift_gamma,
  rspo,
  sapo,
  value_loss,
)
from jaxrl_llm.objectives.registry import (
  ADVANTAGES,
  AGGREGATIONS,
  CORRECTIONS,
  KL,
  OBJECTIVE_INPUTS,
  OBJECTIVES,
  ObjectiveSpec,
  get_advantage,
  get_objective,
  hyperparameter_doc,
  hyperparameter_kinds,
  lookup,
  register_objective,
  traced_hyperparameters,
  validate,
)
from jaxrl_llm.objectives.regularizers import entropy_from_logits
from jaxrl_llm.objectives.shaping import (
  dynamic_sampling,
  expand_groups,
  overlong_filter,
  reinforce_rej,
  soft_overlong,
)

__all__ = [
  "ADVANTAGES",
  "AGGREGATIONS",
  "AGGREGATION_MODES",
  "CORRECTIONS",
  "KL",
  "KL_ESTIMATORS",
  "OBJECTIVES",
  "OBJECTIVE_INPUTS",
  "ObjectiveSpec",
  "aggregate",
  "aggregate_seq",
  "batch_std",
  "behaviour_weight",
  "cispo",
  "dynamic_sampling",
  "entropy_from_logits",
  "expand_groups",
  "gae",
  "get_advantage",
  "get_objective",
  "gmpo",
  "grpo",
  "gspo",
  "gspo_token",
  "hyperparameter_doc",
  "hyperparameter_kinds",
  "kl_penalty",
  "lookup",
  "masked_mean",
  "mean_only",
  "normalizer",
  "overlong_filter",
  "parse_correction",
  "pg",
  "policy_loss",
  "ppo_clip",
  "register_objective",
  "reinforce_baseline",
  "reinforce_pp_baseline",
  "reinforce_rej",
  "rloo",
  "router_shift_gamma",
  "rspo",
  "sapo",
  "soft_overlong",
  "traced_hyperparameters",
  "validate",
  "value_loss",
  "whiten",
]
