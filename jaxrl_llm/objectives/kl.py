"""Per-token KL estimators to a reference policy (objectives.md §4).

With x = ℓ^ref − ℓ (ℓ^ref and ℓ^old are stop-gradient):
  k1     −x
  k2     ½ x²
  k3     e^x − x − 1 (≥ 0)
  k3_is  (π_θ/π_old)·(e^x − x − 1) with the ratio not stopped, so that under samples from
         π_old its expected gradient is the gradient of KL(π_θ‖π_ref)
Only the arguments of exp are clamped (to ±20, §3); k1 and k2 are never clamped, so they keep
their gradient on the tokens furthest from the reference. `k3_clamp` > 0 optionally bounds the
k3 value to [−c, c] (verl's `low_var_kl` uses 10; the spec has no clamp, the default).
Used as a loss these are aggregated like the policy loss (§5) and scaled by β. Only k3_is has
an unbiased gradient of KL(π_θ‖π_ref) under sampled tokens (the tests enumerate it exactly).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import LOG_CLAMP, check_float, check_mask, masked_diff

KL_ESTIMATORS = ("k1", "k2", "k3", "k3_is")


def kl_penalty(
  logp: jax.Array,
  ref_logp: jax.Array,
  old_logp: jax.Array | None = None,
  *,
  estimator: str,
  mask: jax.Array | None = None,
  k3_clamp: float = 0.0,
) -> jax.Array:
  """Per-token KL(π_θ‖π_ref) estimate [B, T] float32 (objectives.md §4).

  `mask` (optional, [B, T]) zeroes padded positions so garbage there reaches neither value nor
  gradient; without it every position is treated as real (the clamp inside exp still prevents
  overflow). `k3_clamp` > 0 clips the k3 value (k3, and k3's factor of k3_is) to [−c, c].
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
  x = masked_diff(jax.lax.stop_gradient(ref_logp), logp, m)
  if estimator == "k1":
    k = -x
  elif estimator == "k2":
    k = 0.5 * x**2
  else:
    k = jnp.exp(jnp.clip(x, -LOG_CLAMP, LOG_CLAMP)) - x - 1.0
    if k3_clamp > 0:
      k = jnp.clip(k, -k3_clamp, k3_clamp)
    if estimator == "k3_is":
      chex.assert_equal_shape([logp, old_logp])
      check_float(old_logp)
      log_r = masked_diff(logp, jax.lax.stop_gradient(old_logp), m)
      k = jnp.exp(jnp.clip(log_r, -LOG_CLAMP, LOG_CLAMP)) * k
  return jnp.where(m > 0, k, 0.0)
