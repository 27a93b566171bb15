"""Advantage estimators (objectives.md §1).

Sequence-level estimators take rewards [B] float with B = P * G, grouped contiguously: rows
i*G .. (i+1)*G - 1 are the G completions of prompt i. `valid` is an optional [B] bool/float
mask of the rows that count: rows of groups dropped by filtering (§7), or truncated completions
removed from the statistics (§6, `shaping.overlong_in_group_stats=False`). Invalid rows are
excluded from group and batch statistics and get advantage 0; a group with n valid rows uses n
in its mean, its Bessel std (n − 1) and RLOO's n/(n − 1), and a group with fewer than two valid
rows gets A = 0. Group statistics are centred on the group's first valid reward, so a group of
identical rewards gives exactly A = 0 (never NaN) for the group estimators.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import check_float, check_mask, safe_div


def _prepare(rewards: jax.Array, group_size: int, valid: jax.Array | None):
  """Checks shapes; returns rewards [P, G] float32 and valid [P, G] float32."""
  chex.assert_rank(rewards, 1)
  check_float(rewards)
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(f"group_size={group_size} must divide the batch size {rewards.shape[0]}")
  if valid is None:
    valid = jnp.ones(rewards.shape, jnp.float32)
  valid = check_mask(valid, 1)
  chex.assert_equal_shape([rewards, valid])
  r = rewards.astype(jnp.float32).reshape(-1, group_size)
  return r, valid.reshape(-1, group_size)


def _group_centered(r: jax.Array, v: jax.Array) -> jax.Array:
  """R_i − mean_g R per group [P, G] over the valid rows v (0 elsewhere); exactly 0 for a group
  of identical rewards."""
  first = jnp.argmax(v > 0, axis=1)[:, None]  # the first valid row of each group
  d = jnp.where(v > 0, r - jnp.take_along_axis(r, first, axis=1), 0.0)
  n = v.sum(axis=1, keepdims=True)
  return jnp.where(v > 0, d - d.sum(axis=1, keepdims=True) / jnp.maximum(n, 1.0), 0.0)


def _group_std(centered: jax.Array, v: jax.Array) -> jax.Array:
  """Bessel-corrected (n−1) group standard deviation [P, 1] over the valid rows."""
  n = v.sum(axis=1, keepdims=True)
  return jnp.sqrt((centered**2).sum(axis=1, keepdims=True) / jnp.maximum(n - 1.0, 1.0))


def _batch_mean_std(r: jax.Array, valid: jax.Array):
  """Mean and Bessel-corrected std of the valid rewards (shifted so equal rewards give 0)."""
  n = valid.sum()
  shift = jnp.min(jnp.where(valid > 0, r, jnp.inf))
  shift = jnp.where(n > 0, shift, 0.0)
  d = jnp.where(valid > 0, r - shift, 0.0)
  mean_d = safe_div(d.sum(), n)
  var = safe_div((jnp.where(valid > 0, d - mean_d, 0.0) ** 2).sum(), jnp.maximum(n - 1.0, 1.0))
  return shift + mean_d, jnp.sqrt(var)


def _finish(adv: jax.Array, valid: jax.Array) -> jax.Array:
  return jnp.where(valid > 0, adv, 0.0).reshape(-1)


def grpo(
  rewards: jax.Array, group_size: int, *, eps: float = 1e-6, valid: jax.Array | None = None
) -> jax.Array:
  """GRPO advantage (R − mean_g R) / (std_g R + ε), Bessel std (objectives.md §1). [B]."""
  r, v = _prepare(rewards, group_size, valid)
  c = _group_centered(r, v)
  return _finish(c / (_group_std(c, v) + eps), v)


def mean_only(
  rewards: jax.Array, group_size: int, *, eps: float = 1e-6, valid: jax.Array | None = None
) -> jax.Array:
  """Dr. GRPO advantage R − mean_g R, no std division (objectives.md §1). [B]."""
  del eps
  r, v = _prepare(rewards, group_size, valid)
  return _finish(_group_centered(r, v), v)


def rloo(
  rewards: jax.Array, group_size: int, *, eps: float = 1e-6, valid: jax.Array | None = None
) -> jax.Array:
  """Leave-one-out advantage R_i − mean_{j≠i} R_j = G/(G−1)(R_i − mean_g R) (objectives.md §1)."""
  del eps
  if group_size < 2:
    raise ValueError(f"rloo needs group_size >= 2, got {group_size}")
  r, v = _prepare(rewards, group_size, valid)
  n = v.sum(axis=1, keepdims=True)
  return _finish(_group_centered(r, v) * (n / jnp.maximum(n - 1.0, 1.0)), v)


def batch_std(
  rewards: jax.Array, group_size: int, *, eps: float = 1e-6, valid: jax.Array | None = None
) -> jax.Array:
  """Lite PPO advantage (R − mean_g R) / (std_batch R + ε), Bessel std over valid rows (§1)."""
  r, v = _prepare(rewards, group_size, valid)
  _, std = _batch_mean_std(r, v)
  return _finish(_group_centered(r, v) / (std + eps), v)


def reinforce_baseline(
  rewards: jax.Array, group_size: int, *, eps: float = 1e-6, valid: jax.Array | None = None
) -> jax.Array:
  """REINFORCE with a batch-mean baseline R − mean_batch R over valid rows (objectives.md §1).

  The baseline is the batch, not the group: a batch of identical rewards gives exactly 0, a
  single group of identical rewards in a mixed batch does not.
  """
  del eps
  r, v = _prepare(rewards, group_size, valid)
  mean, _ = _batch_mean_std(r, v)
  return _finish(r - mean, v)


WHITEN_VARIANCES = ("population", "unbiased")


def whiten(
  adv: jax.Array,
  mask: jax.Array,
  *,
  eps: float = 1e-6,
  shift_mean: bool = True,
  variance: str = "population",
) -> jax.Array:
  """Whitens advantages over the masked entries of the batch (objectives.md §1, `whiten=True`).

  adv and mask share a shape ([B] or [B, T]; token-level whitening weights each sequence by its
  length). variance="population": (A − mean) / (std + eps) with the population std (the spec's
  form); "unbiased": (A − mean)·rsqrt(var + 1e-8) with the n − 1 variance (verl's
  `masked_whiten`; `eps` unused). Masked entries return 0.
  """
  if variance not in WHITEN_VARIANCES:
    raise ValueError(
      f"unknown whitening variance {variance!r}; valid: {', '.join(WHITEN_VARIANCES)}"
    )
  check_float(adv)
  m = check_mask(mask, adv.ndim)
  chex.assert_equal_shape([adv, m])
  a = jnp.where(m > 0, adv.astype(jnp.float32), 0.0)
  n = m.sum()
  mean = safe_div(a.sum(), n)
  sq = (jnp.where(m > 0, a - mean, 0.0) ** 2).sum()
  if variance == "unbiased":
    out = (a - mean) * jax.lax.rsqrt(safe_div(sq, jnp.maximum(n - 1.0, 1.0)) + 1e-8)
  else:
    out = (a - mean) / (jnp.sqrt(safe_div(sq, n)) + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(m > 0, out, 0.0)


def reinforce_pp_baseline(
  rewards: jax.Array,
  group_size: int,
  *,
  mask: jax.Array,
  eps: float = 1e-6,
  valid: jax.Array | None = None,
) -> jax.Array:
  """REINFORCE++-baseline (verl): R − mean_g R, then whitened over the batch's tokens. [B, T].

  Not the spec's `reinforce_baseline` (R − mean_batch R): the group mean is the baseline and
  the result is broadcast over each completion's tokens (mask [B, T]) and whitened there with
  the unbiased variance, `whiten(..., variance="unbiased")`, so longer completions weigh more
  in the statistics. A group with a single valid row keeps its raw reward before whitening,
  as in verl.
  """
  del eps
  r, v = _prepare(rewards, group_size, valid)
  m = check_mask(mask, 2)
  chex.assert_shape(m, (rewards.shape[0], m.shape[1]))
  n = v.sum(axis=1, keepdims=True)
  centered = jnp.where(n > 1, _group_centered(r, v), r)
  seq = _finish(centered, v)
  tok_mask = m * v.reshape(-1)[:, None]
  return whiten(seq[:, None] * tok_mask, tok_mask, variance="unbiased")


def gae(
  rewards_tok: jax.Array,
  values: jax.Array,
  mask: jax.Array,
  gamma: float,
  lam: float,
  *,
  carry_masked: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation over tokens (objectives.md §1 `gae`, §2.9).

  δ_t = r_t + γ V_{t+1} − V_t with V = 0 past the last masked token, A_t = δ_t + γλ A_{t+1}.
  A reverse `lax.scan` over time. Masked positions inside a completion (non-action tokens of
  multi-turn or tool-use rollouts) reset V and A to 0 by default; with carry_masked=True they
  pass the next action's V and A through unchanged, so the action before the gap bootstraps
  from the action after it (verl's convention). Identical on prefix masks. Returns
  (advantages [B, T], returns = A + V [B, T]), both 0 on masked positions.
  """
  chex.assert_rank([rewards_tok, values], 2)
  check_float(rewards_tok, values)
  m = check_mask(mask, 2)
  chex.assert_equal_shape([rewards_tok, values, m])
  r = jnp.where(m > 0, rewards_tok.astype(jnp.float32), 0.0)
  v = jnp.where(m > 0, values.astype(jnp.float32), 0.0)

  def step(carry, xs):
    next_adv, next_value = carry  # the next action's A and V (0 past the end, or reset)
    r_t, v_t, m_t = xs
    delta = r_t + gamma * next_value - v_t
    adv_t = (delta + gamma * lam * next_adv) * m_t
    if carry_masked:
      return (adv_t + (1 - m_t) * next_adv, v_t * m_t + (1 - m_t) * next_value), adv_t
    return (adv_t, v_t * m_t), adv_t

  zeros = jnp.zeros(r.shape[:1], jnp.float32)
  _, adv_tb = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
  adv = adv_tb.T
  return adv, (adv + v) * m
