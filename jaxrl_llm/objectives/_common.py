"""Shared helpers for the objectives package: checks, masking and safe exponentials (spec §0)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

# Log-ratios are clamped to ±LOG_CLAMP before exp (spec §3, STYLE numerics).
LOG_CLAMP = 20.0


def check_mask(mask: jax.Array, rank: int) -> jax.Array:
  """Asserts a {0,1} mask of the given rank (bool or float) and returns it as float32."""
  chex.assert_rank(mask, rank)
  if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.floating)):
    raise TypeError(f"mask must be bool or floating, got {mask.dtype}")
  return mask.astype(jnp.float32)


def check_float(*arrays: jax.Array) -> None:
  """Asserts every array has a floating dtype."""
  for a in arrays:
    chex.assert_type(a, float)


def masked_diff(num: jax.Array, den: jax.Array, mask: jax.Array) -> jax.Array:
  """num − den in float32, 0 where mask is 0 (not clamped).

  The `where` comes first so that garbage on padded positions (±inf, 1e9) reaches neither the
  value nor the gradient.
  """
  diff = num.astype(jnp.float32) - den.astype(jnp.float32)
  return jnp.where(mask > 0, diff, 0.0)


def masked_log_ratio(num: jax.Array, den: jax.Array, mask: jax.Array) -> jax.Array:
  """`masked_diff` clamped to ±LOG_CLAMP: a log-ratio that is safe to exponentiate."""
  return jnp.clip(masked_diff(num, den, mask), -LOG_CLAMP, LOG_CLAMP)


def _checked_adv(adv: jax.Array, mask: jax.Array) -> jax.Array:
  """Asserts floating advantages [B] or [B, T] that fit the mask [B, T]; returns them float32."""
  chex.assert_rank(adv, {1, 2})
  check_float(adv)
  adv = adv.astype(jnp.float32)
  if adv.ndim == 1:
    chex.assert_shape(adv, (mask.shape[0],))
  else:
    chex.assert_equal_shape([adv, mask])
  return adv


def broadcast_adv(adv: jax.Array, mask: jax.Array) -> jax.Array:
  """Advantages [B] or [B, T] → [B, T] float32 (A_{i,t} = A_i, spec §1)."""
  adv = _checked_adv(adv, mask)
  if adv.ndim == 1:
    return jnp.broadcast_to(adv[:, None], mask.shape)
  return adv


def seq_adv(adv: jax.Array, mask: jax.Array) -> jax.Array:
  """Advantages [B] or [B, T] → one A_i per sequence [B] (masked token mean for [B, T])."""
  adv = _checked_adv(adv, mask)
  if adv.ndim == 1:
    return adv
  lengths = mask.sum(-1)
  return jnp.where(mask > 0, adv, 0.0).sum(-1) / jnp.maximum(lengths, 1.0)


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
  """num / den, and 0 where den == 0 (no NaN in value or gradient)."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of x over mask > 0 (0 when the mask is empty)."""
  x = jnp.where(mask > 0, x.astype(jnp.float32), 0.0)
  return safe_div(x.sum(), mask.astype(jnp.float32).sum())


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Max of x over mask > 0 (0 when the mask is empty)."""
  m = jnp.max(jnp.where(mask > 0, x.astype(jnp.float32), -jnp.inf))
  return jnp.where(jnp.any(mask > 0), m, 0.0)


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Min of x over mask > 0 (0 when the mask is empty)."""
  m = jnp.min(jnp.where(mask > 0, x.astype(jnp.float32), jnp.inf))
  return jnp.where(jnp.any(mask > 0), m, 0.0)
