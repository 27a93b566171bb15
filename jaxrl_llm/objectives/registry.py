"""Names → functions for every configurable piece of the objective (objectives.md §1-§5, §10).

Config fields hold these names; `lookup` turns one into its function and rejects an unknown
name with a ValueError that lists the valid ones, so a config can be validated at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_llm.objectives import advantages, policy
from jaxrl_llm.objectives.aggregation import AGGREGATION_MODES
from jaxrl_llm.objectives.corrections import CORRECTION_BASES, GEO_MASK, parse_correction
from jaxrl_llm.objectives.kl import KL_ESTIMATORS

# §1. All but `gae` share the signature (rewards [B], group_size, *, eps, valid) -> [B];
# `gae` is token-level: (rewards_tok, values, mask, gamma, lam) -> (advantages, returns).
ADVANTAGES: Mapping[str, Callable[..., Any]] = {
  "grpo": advantages.grpo,
  "mean_only": advantages.mean_only,
  "rloo": advantages.rloo,
  "batch_std": advantages.batch_std,
  "reinforce_baseline": advantages.reinforce_baseline,
  "gae": advantages.gae,
}

# §2. (logp, old_logp, adv, mask, **kwargs) -> (J, diagnostics). `ppo_critic` is §2.1 for the
# policy (its value loss is `policy.value_loss`); `rspo` (§2.8) needs an MoE policy's router
# log-probs (`router_gamma`, from `policy.router_shift_gamma`).
OBJECTIVES: Mapping[str, Callable[..., Any]] = {
  "ppo_clip": policy.ppo_clip,
  "pg": policy.pg,
  "gspo": policy.gspo,
  "gspo_token": policy.gspo_token,
  "gmpo": policy.gmpo,
  "cispo": policy.cispo,
  "sapo": policy.sapo,
  "ppo_critic": policy.ppo_clip,
  "rspo": policy.rspo,
}

# Objectives whose J is one term per sequence ([B]); aggregated as a sequence mean.
SEQUENCE_OBJECTIVES = frozenset({"gspo", "gmpo", "rspo"})

CORRECTIONS = (*CORRECTION_BASES, GEO_MASK)  # §3, bases compose with "+geo_mask"
AGGREGATIONS = AGGREGATION_MODES  # §5
KL = KL_ESTIMATORS  # §4


def lookup(table: Mapping[str, Any], name: str, kind: str) -> Any:
  """table[name], or a ValueError naming the kind and listing the valid names (§10 configs)."""
  if name not in table:
    raise ValueError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}")
  return table[name]


def get_advantage(name: str) -> Callable[..., Any]:
  """The §1 advantage estimator called `name`."""
  return lookup(ADVANTAGES, name, "advantage")


def get_objective(name: str) -> Callable[..., Any]:
  """The §2 policy objective called `name`."""
  return lookup(OBJECTIVES, name, "objective")


def validate(kind: str, name: str) -> None:
  """Raises ValueError if `name` is not a valid name of `kind` (config check, §10).

  kind ∈ {"advantage", "objective", "aggregation", "kl", "correction"}.
  """
  tables = {
    "advantage": ADVANTAGES,
    "objective": OBJECTIVES,
    "aggregation": dict.fromkeys(AGGREGATIONS),
    "kl": dict.fromkeys(KL),
  }
  if kind == "correction":
    parse_correction(name)
  elif kind in tables:
    lookup(tables[kind], name, kind)
  else:
    raise ValueError(f"unknown kind {kind!r}; valid kinds: {', '.join([*tables, 'correction'])}")
