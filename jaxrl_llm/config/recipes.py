"""The named recipes of spec §10 as overrides of the default config.

`get_config(name)` returns the embedded default (tiny model, built-in task) with the recipe's
advantage, objective, aggregation, KL, correction, shaping and filtering settings; the files
`configs/<name>.py` are one-line wrappers so that each recipe is a runnable experiment.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from jaxrl_llm.config import default_config

# name -> {"section.field": value}; unlisted fields keep the default config's values.
RECIPES: dict[str, dict[str, Any]] = {
  "grpo": {
    "advantage.name": "grpo",
    "objective.name": "ppo_clip",
    "objective.clip_low": 0.2,
    "objective.clip_high": 0.2,
    "aggregation.name": "seq_mean_token_mean",
    "kl.name": "k3",
    "kl.placement": "loss",
    "kl.beta": 0.04,
  },
  "dr_grpo": {
    "advantage.name": "mean_only",
    "objective.name": "ppo_clip",
    "aggregation.name": "seq_mean_token_sum_norm",
    "kl.beta": 0.0,
  },
  "dapo": {
    "advantage.name": "grpo",
    "objective.name": "ppo_clip",
    "objective.clip_low": 0.2,
    "objective.clip_high": 0.28,
    "aggregation.name": "token_mean",
    "kl.beta": 0.0,
    "filtering.name": "dynamic_sampling",
    "shaping.name": "soft_overlong",
  },
  "gspo": {
    "advantage.name": "grpo",
    "objective.name": "gspo",
    "objective.clip_low": 3e-4,
    "objective.clip_high": 4e-4,
    "aggregation.name": "seq_mean",
  },
  "gmpo": {
    "advantage.name": "grpo",
    "objective.name": "gmpo",
    "objective.clip_log": 0.4,
    "aggregation.name": "seq_mean",
  },
  "cispo": {
    "advantage.name": "grpo",
    "objective.name": "cispo",
    "objective.is_clip_low": 1.0,
    "objective.is_clip_high": 0.28,
    "aggregation.name": "token_mean",
  },
  "sapo": {
    "advantage.name": "grpo",
    "objective.name": "sapo",
    "objective.tau_pos": 1.0,
    "objective.tau_neg": 1.05,
    "aggregation.name": "seq_mean_token_mean",
  },
  "olmo3": {
    "advantage.name": "mean_only",
    "objective.name": "ppo_clip",
    "objective.clip_low": 0.2,
    "objective.clip_high": 0.28,
    "aggregation.name": "token_mean",
    "filtering.name": "dynamic_sampling",
    "correction.name": "tis_token",
  },
  "deepseek_v32": {
    "advantage.name": "mean_only",
    "objective.name": "ppo_clip",
    "aggregation.name": "seq_mean_token_mean",
    "kl.name": "k3_is",
    "kl.beta": 0.01,
    "correction.name": "geo_mask",
    "correction.geo_low": 0.0,
    "correction.geo_high": 2.0,
  },
  "rloo": {
    "advantage.name": "rloo",
    "objective.name": "pg",
    "aggregation.name": "seq_mean_token_mean",
  },
  "lite_ppo": {
    "advantage.name": "batch_std",
    "objective.name": "ppo_clip",
    "aggregation.name": "token_mean",
  },
  "rspo": {
    "advantage.name": "grpo",
    "objective.name": "rspo",
    "objective.clip_low": 0.2,
    "objective.clip_high": 0.2,
    "objective.gamma_min": 0.1,
    "aggregation.name": "seq_mean",
    # RSPO is for mixture-of-experts policies (§10): the small MoE of MOE_MODEL, no replay.
    "model.moe_num_experts": 4,
    "model.moe_top_k": 2,
    "model.moe_expert_mlp_dim": 64,
    "replay.name": "none",
  },
  "ppo": {
    "advantage.name": "gae",
    "objective.name": "ppo_critic",
    "model.value_head": True,
    "aggregation.name": "token_mean",
    "kl.name": "k1",
    "kl.placement": "reward",
    "kl.beta": 0.01,
  },
}


# A small mixture-of-experts policy for the built-in tasks: 4 routed experts, top-2, in every
# layer, with the sampler's routing replayed by the learner (R3, spec §9).
MOE_MODEL: dict[str, Any] = {
  "model.moe_num_experts": 4,
  "model.moe_top_k": 2,
  "model.moe_expert_mlp_dim": 64,
  "model.moe_every": 1,
  "replay.name": "r3",
}

# MoE experiment configs: recipe (or "default") + MOE_MODEL + their own overrides.
MOE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
  "moe_default": ("default", {}),
  "moe_grpo": ("grpo", {}),
  "moe_gspo": ("gspo", {}),
  "moe_rspo": ("rspo", {"replay.name": "none"}),
}


def apply(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> None:
  """Sets dotted `section.field` overrides on `config`, naming any unknown field."""
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    if leaf not in node:
      raise KeyError(f"recipe sets unknown config field {key!r}")
    node[leaf] = value


def get_config(name: str) -> ml_collections.ConfigDict:
  """The default config with recipe `name` of spec §10 (or an MoE config) applied."""
  if name in MOE_CONFIGS:
    base, extra = MOE_CONFIGS[name]
    config = default_config() if base == "default" else get_config(base)
    apply(config, {**MOE_MODEL, **extra})
    return config
  if name not in RECIPES:
    valid = sorted([*RECIPES, *MOE_CONFIGS])
    raise ValueError(f"unknown recipe {name!r}; valid names: {', '.join(valid)}")
  config = default_config()
  apply(config, RECIPES[name])
  return config
