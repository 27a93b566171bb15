"""The policy loss L = −w·J aggregated over the minibatch, with §11 metrics (§2, §3, §5, §11)."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import check_mask, masked_max, masked_mean, masked_min
from jaxrl_llm.objectives.aggregation import AGGREGATION_MODES, aggregate, aggregate_seq
from jaxrl_llm.objectives.registry import get_objective, lookup

_SPECIAL = ("ratio", "log_ratio", "is_clipped_low", "is_clipped_high")


def _reduce_diagnostics(diag: dict[str, jax.Array], m: jax.Array) -> dict[str, jax.Array]:
  seq_valid = m.sum(-1) > 0
  out = {
    "policy/clip_frac": masked_mean(
      jnp.maximum(diag["is_clipped_low"], diag["is_clipped_high"]), m
    ),
    "policy/clip_frac_low": masked_mean(diag["is_clipped_low"], m),
    "policy/clip_frac_high": masked_mean(diag["is_clipped_high"], m),
    "policy/ratio_mean": masked_mean(diag["ratio"], m),
    "policy/ratio_min": masked_min(diag["ratio"], m),
    "policy/ratio_max": masked_max(diag["ratio"], m),
    "policy/approx_kl": masked_mean(-diag["log_ratio"], m),
  }
  for key, value in diag.items():
    if key not in _SPECIAL:
      out[f"policy/{key}_mean"] = masked_mean(value, m if value.ndim == 2 else seq_valid)
  return out


def policy_loss(
  logp: jax.Array,
  old_logp: jax.Array,
  adv: jax.Array,
  mask: jax.Array,
  *,
  objective: str,
  aggregation: str,
  behaviour_weight: jax.Array | None = None,
  max_len: int | None = None,
  normalizer: jax.Array | None = None,
  **objective_kwargs: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Policy loss aggregate(−sg[w]·J) and its metrics (objectives.md §2, §3, §5, §11).

  objective: a name of `registry.OBJECTIVES`, called with **objective_kwargs (its extra inputs
  and hyperparameters, e.g. clip widths).
  aggregation: a §5 mode. A sequence objective's J_i (gspo, gmpo) is aggregated with
  `aggregate_seq` for "seq_mean"; with a token mode it is broadcast over the sequence's tokens
  first (so "seq_mean_token_mean" is also the sequence mean).
  behaviour_weight: w [B, T] from `corrections.behaviour_weight` (default 1); for sequence
  objectives its masked per-sequence mean multiplies J_i.
  normalizer: the minibatch-level normaliser for gradient accumulation, from
  `aggregation.normalizer(minibatch_mask, aggregation, max_len)`.

  Metrics (stop-gradient scalars over masked tokens): policy/loss, policy/clip_frac
  (either bound), policy/clip_frac_low, policy/clip_frac_high, policy/ratio_mean, policy/ratio_min, policy/ratio_max,
  policy/approx_kl (mean −Δ), and policy/<key>_mean for objective-specific diagnostics.
  """
  lookup(dict.fromkeys(AGGREGATION_MODES), aggregation, "aggregation")
  m = check_mask(mask, 2)
  j, diag = get_objective(objective).fn(logp, old_logp, adv, m, **objective_kwargs)
  if behaviour_weight is None:
    w = jnp.ones(m.shape, jnp.float32)
  else:
    chex.assert_equal_shape([behaviour_weight, m])
    w = jax.lax.stop_gradient(behaviour_weight).astype(jnp.float32)
    w = jnp.where(m > 0, w, 0.0)  # padding never reaches the gradient, even as NaN

  if j.ndim == 1:  # one term per sequence
    seq_valid = m.sum(-1) > 0
    if aggregation == "seq_mean":
      w_seq = jnp.where(m > 0, w, 0.0).sum(-1) / jnp.maximum(m.sum(-1), 1.0)
      loss = aggregate_seq(-w_seq * j, seq_valid, normalizer)
    else:
      per_token = -w * jnp.broadcast_to(j[:, None], m.shape)
      loss = aggregate(per_token, m, aggregation, max_len=max_len, normalizer=normalizer)
  else:
    loss = aggregate(-w * j, m, aggregation, max_len=max_len, normalizer=normalizer)

  metrics = _reduce_diagnostics(diag, m)
  metrics["policy/loss"] = loss
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
