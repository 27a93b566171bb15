"""Per-token KL estimators to a reference policy (objectives.md §4).

With x = ℓ^ref − ℓ (clamped to ±20 before exp; ℓ^ref and ℓ^old are stop-gradient):
  k1     −x
  k2     ½ x²
  k3     e^x − x − 1 (≥ 0)
  k3_is  (π_θ/π_old)·(e^x − x − 1) with the ratio not stopped, so that under samples from
         π_old its expected gradient is the gradient of KL(π_θ‖π_ref)
Used as a loss these are aggregated like the policy loss (§5) and scaled by β. Only k3_is has
an unbiased gradient of KL(π_θ‖π_ref) under sampled tokens (the tests enumerate it exactly).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import check_float, check_mask, masked_log_ratio

KL_ESTIMATORS = ("k1", "k2", "k3", "k3_is")


def kl_penalty(
  logp: jax.Array,
  ref_logp: jax.Array,
  old_logp: jax.Array | None = None,
  *,
  estimator: str,
  mask: jax.Array | None = None,
) -> jax.Array:
  """Per-token KL(π_θ‖π_ref) estimate [B, T] float32 (objectives.md §4).

  `mask` (optional, [B, T]) zeroes padded positions so garbage there reaches neither value nor
  gradient; without it every position is treated as real (the clamp still prevents overflow).
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {estimator!r}; valid names: {', '.join(KL_ESTIMATORS)}")
  if estimator == "k3_is" and old_logp is None:
    raise ValueError("KL estimator 'k3_is' needs old_logp (ℓ^old) for the π_θ/π_old ratio")
  chex.assert_rank([logp, ref_logp], 2)
  check_float(logp, ref_logp)
  chex.assert_equal_shape([logp, ref_logp])
  m = jnp.ones(logp.shape, jnp.float32) if mask is None else check_mask(mask, 2)
  chex.assert_equal_shape([logp, m])
  x = masked_log_ratio(jax.lax.stop_gradient(ref_logp), logp, m)
  if estimator == "k1":
    k = -x
  elif estimator == "k2":
    k = 0.5 * x**2
  else:
    k = jnp.exp(x) - x - 1.0
    if estimator == "k3_is":
      chex.assert_equal_shape([logp, old_logp])
      check_float(old_logp)
      k = jnp.exp(masked_log_ratio(logp, jax.lax.stop_gradient(old_logp), m)) * k
  return jnp.where(m > 0, k, 0.0)
