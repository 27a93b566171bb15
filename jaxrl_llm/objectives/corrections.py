"""Behaviour-policy (off-policy) corrections with decoupled ratios (objectives.md §3).

δ^μ = ℓ^old − ℓ^μ (clamped to ±20 per token), ρ = exp(δ^μ), C = `cap`. A correction name is a
base weight, optionally joined with "+geo_mask":

  none        1
  tis_token   min(ρ, C)
  tis_seq     min(exp(Σ_t m δ^μ), C)
  mis_token   ρ · 1[ρ ≤ C]
  mis_seq     exp(Σ_t m δ^μ) · 1[exp(Σ_t m δ^μ) ≤ C]
  geo_mask    1[C_low ≤ exp(mean_t δ^μ) ≤ C_high], C_low = geo_low (0: upper-only),
              C_high = geo_high (None: C); "geo_mask" alone means "none+geo_mask"

e.g. name="tis_token+geo_mask". Thresholds are compared in log space, so long sequences never
overflow. The weight is stop-gradient, [B, T], 0 on padding; sequence weights are broadcast over
the sequence's tokens.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import (
  LOG_CLAMP,
  check_float,
  check_mask,
  masked_log_ratio,
  masked_max,
  masked_mean,
  safe_div,
)

CORRECTION_BASES = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq")
GEO_MASK = "geo_mask"


def parse_correction(name: str) -> tuple[str, bool]:
  """Splits a correction name into (base, use_geo_mask) (objectives.md §3); ValueError if bad."""
  parts = [p.strip() for p in name.split("+")]
  geo = GEO_MASK in parts
  rest = [p for p in parts if p != GEO_MASK]
  if len(rest) > 1 or (rest and rest[0] not in CORRECTION_BASES) or parts.count(GEO_MASK) > 1:
    valid = ", ".join((*CORRECTION_BASES, GEO_MASK))
    raise ValueError(
      f"unknown behaviour correction {name!r}; valid names: {valid}, "
      f"or '<base>+{GEO_MASK}' to compose the geometric mask with a base"
    )
  return (rest[0] if rest else "none"), geo


def behaviour_weight(
  old_logp: jax.Array,
  behaviour_logp: jax.Array,
  mask: jax.Array,
  *,
  name: str,
  cap: float = 2.0,
  geo_low: float = 0.0,
  geo_high: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Stop-gradient behaviour weight w [B, T] and its §3 metrics (objectives.md §3).

  Metrics (scalars, over masked tokens unless named per sequence): behaviour/rho_mean,
  rho_max, frac_truncated (tokens whose weight was capped), frac_masked_tokens (tokens given
  w = 0 by mis/geo rejection), frac_masked_seqs (non-empty sequences rejected on every token),
  ess (Kish effective sample size (Σw)²/(NΣw²) ∈ [0, 1]), mismatch_mean, mismatch_max
  (|exp(ℓ^old) − exp(ℓ^μ)|), kl_k3 (k3 estimate of KL(μ‖π_old): ρ − δ^μ − 1).
  Tokens the correction rejects should also leave the KL and entropy terms: use
  `mask * (w > 0)` as their mask.
  """
  base, geo = parse_correction(name)
  if cap <= 0:
    raise ValueError(f"cap must be > 0, got {cap}")
  chex.assert_rank([old_logp, behaviour_logp], 2)
  check_float(old_logp, behaviour_logp)
  m = check_mask(mask, 2)
  chex.assert_equal_shape([old_logp, behaviour_logp, m])
  old = jax.lax.stop_gradient(old_logp).astype(jnp.float32)
  beh = jax.lax.stop_gradient(behaviour_logp).astype(jnp.float32)

  delta = masked_log_ratio(old, beh, m)  # [B, T]
  rho = jnp.exp(delta)
  seq_sum = jnp.where(m > 0, delta, 0.0).sum(-1, keepdims=True)  # [B, 1]
  w, truncated, rejected = _base_weight(base, delta, rho, seq_sum, m, cap)
  if geo:
    w, rejected = _geo_mask(w, rejected, seq_sum, m, cap, geo_low, geo_high)

  valid = m > 0
  w = jax.lax.stop_gradient(jnp.where(valid, w, 0.0))
  rejected = rejected & valid
  return w, _metrics(old, beh, m, valid, delta, rho, w, truncated, rejected)


def _base_weight(
  base: str, delta: jax.Array, rho: jax.Array, seq_sum: jax.Array, m: jax.Array, cap: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The base correction's weight [B, T] and which tokens it truncated / rejected ([B, T] bool)
  (objectives.md §3). seq_sum [B, 1]: Σ_t m δ^μ per sequence."""
  log_cap = math.log(cap)
  seq_exp = jnp.exp(jnp.clip(seq_sum, -LOG_CLAMP, LOG_CLAMP))
  no = jnp.zeros(m.shape, bool)
  if base == "none":
    return jnp.ones_like(rho), no, no
  if base == "tis_token":
    return jnp.minimum(rho, cap), delta > log_cap, no
  if base == "tis_seq":
    w = jnp.broadcast_to(jnp.minimum(seq_exp, cap), m.shape)
    return w, jnp.broadcast_to(seq_sum > log_cap, m.shape), no
  if base == "mis_token":
    rejected = delta > log_cap
    return jnp.where(rejected, 0.0, rho), no, rejected
  rejected = jnp.broadcast_to(seq_sum > log_cap, m.shape)  # mis_seq
  return jnp.where(rejected, 0.0, jnp.broadcast_to(seq_exp, m.shape)), no, rejected


def _geo_mask(
  w: jax.Array,
  rejected: jax.Array,
  seq_sum: jax.Array,
  m: jax.Array,
  cap: float,
  geo_low: float,
  geo_high: float | None,
) -> tuple[jax.Array, jax.Array]:
  """(w, rejected) with the geometric mask applied: sequences whose exp(mean_t δ^μ) lies outside
  [geo_low, geo_high or cap] are rejected on every token, w = 0 there (objectives.md §3)."""
  lengths = m.sum(-1, keepdims=True)
  seq_mean = seq_sum / jnp.maximum(lengths, 1.0)
  high = cap if geo_high is None else geo_high
  out = seq_mean > math.log(high)
  if geo_low > 0:
    out = out | (seq_mean < math.log(geo_low))
  rejected = rejected | jnp.broadcast_to(out, m.shape)
  return jnp.where(rejected, 0.0, w), rejected


def _metrics(
  old: jax.Array,
  beh: jax.Array,
  m: jax.Array,
  valid: jax.Array,
  delta: jax.Array,
  rho: jax.Array,
  w: jax.Array,
  truncated: jax.Array,
  rejected: jax.Array,
) -> dict[str, jax.Array]:
  """The behaviour/* metrics of `behaviour_weight` (objectives.md §3) from the final weight w and
  the valid tokens' (valid = m > 0) truncated / rejected flags; all NaN when m keeps no token
  (docs/tensorboard.md: a step that trained no token has no token means, not 0)."""
  seq_nonempty = m.sum(-1) > 0
  seq_rejected = seq_nonempty & (rejected.sum(-1) == m.sum(-1))
  n_tok = m.sum()
  p_old = jnp.exp(jnp.minimum(jnp.where(valid, old, 0.0), LOG_CLAMP))
  p_beh = jnp.exp(jnp.minimum(jnp.where(valid, beh, 0.0), LOG_CLAMP))
  mismatch = jnp.abs(p_old - p_beh)
  metrics = {
    "behaviour/rho_mean": masked_mean(rho, m),
    "behaviour/rho_max": masked_max(rho, m),
    "behaviour/frac_truncated": masked_mean(truncated.astype(jnp.float32), m),
    "behaviour/frac_masked_tokens": masked_mean(rejected.astype(jnp.float32), m),
    "behaviour/frac_masked_seqs": safe_div(
      seq_rejected.astype(jnp.float32).sum(), seq_nonempty.astype(jnp.float32).sum()
    ),
    "behaviour/ess": safe_div(w.sum() ** 2, n_tok * (w**2).sum()),
    "behaviour/mismatch_mean": masked_mean(mismatch, m),
    "behaviour/mismatch_max": masked_max(mismatch, m),
    # e^δ − 1 − δ >= 0 exactly; expm1 and the floor keep rounding from showing a negative KL.
    "behaviour/kl_k3": masked_mean(jnp.maximum(jnp.expm1(delta) - delta, 0.0), m),
  }
  return {k: jnp.where(n_tok > 0, v, jnp.nan) for k, v in metrics.items()}
