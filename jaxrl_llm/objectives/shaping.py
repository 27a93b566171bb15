"""Reward shaping (objectives.md §6) and group filtering (objectives.md §7).

Everything keeps static shapes so it can run inside the jitted update.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import check_float


def soft_overlong(
  lengths: jax.Array, truncated: jax.Array, max_len: int, cache_len: int
) -> jax.Array:
  """DAPO soft overlong punishment R_len [B] float32 (objectives.md §6).

  0 if |o| ≤ L_max − L_cache; ((L_max − L_cache) − |o|)/L_cache up to L_max; −1 if truncated.
  """
  chex.assert_rank([lengths, truncated], 1)
  chex.assert_equal_shape([lengths, truncated])
  traced = isinstance(cache_len, jax.Array)  # a per-run value of a pack (checked by its config)
  if not traced and not 0 < cache_len <= max_len:
    raise ValueError(f"cache_len must be in (0, max_len={max_len}], got {cache_len}")
  n = lengths.astype(jnp.float32)
  start = (max_len - cache_len).astype(jnp.float32) if traced else float(max_len - cache_len)
  r = jnp.where(n <= start, 0.0, (start - n) / cache_len)
  r = jnp.maximum(r, -1.0)  # lengths beyond max_len cannot occur; keep the range [−1, 0]
  return jnp.where(truncated.astype(bool), -1.0, r)


def overlong_filter(mask: jax.Array, truncated: jax.Array) -> jax.Array:
  """Overlong filtering: m ← 0 on truncated completions, same dtype as mask (§6)."""
  chex.assert_rank(mask, 2)
  chex.assert_rank(truncated, 1)
  chex.assert_shape(truncated, (mask.shape[0],))
  keep = ~truncated.astype(bool)[:, None]
  if mask.dtype == jnp.bool_:
    return mask & keep
  return mask * keep.astype(mask.dtype)


def _group_has_spread(rewards: jax.Array, group_size: int) -> jax.Array:
  """std_g R > 0 per group [P] bool (exactly: max ≠ min)."""
  chex.assert_rank(rewards, 1)
  check_float(rewards)
  if group_size < 1 or rewards.shape[0] % group_size:
    raise ValueError(f"group_size={group_size} must divide the batch size {rewards.shape[0]}")
  r = rewards.astype(jnp.float32).reshape(-1, group_size)
  return r.max(axis=1) > r.min(axis=1)


def expand_groups(group_valid: jax.Array, group_size: int) -> jax.Array:
  """Group flags [P] → per-sequence flags [P*G] (rows grouped contiguously, §1/§7)."""
  chex.assert_rank(group_valid, 1)
  return jnp.repeat(group_valid, group_size, total_repeat_length=group_valid.shape[0] * group_size)


def dynamic_sampling(
  rewards: jax.Array, group_size: int, num_keep_groups: int
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """DAPO dynamic sampling with static shapes (objectives.md §7).

  rewards [k*P*G] for ⌈k·P⌉ sampled groups. Keeps the first P = num_keep_groups groups (in
  sampling order) with std_g R > 0; if fewer qualify, fills the remaining slots with the first
  non-qualifying groups, marked invalid. Returns (indices [P*G] int32 into the sampled rows,
  group_valid [P] bool, metrics): filter/zero_std_frac (of all sampled groups), filter/groups_used
  (valid groups kept), filter/fill_frac (groups_used / P: the fraction of slots filled).
  """
  q = _group_has_spread(rewards, group_size)
  n = q.shape[0]
  if not 0 < num_keep_groups <= n:
    raise ValueError(f"num_keep_groups must be in [1, {n}] (sampled groups), got {num_keep_groups}")
  idx = jnp.arange(n, dtype=jnp.int32)
  key = jnp.where(q, 0, n) + idx  # qualifying first, then by index: unique keys, stable order
  kept = jnp.argsort(key)[:num_keep_groups].astype(jnp.int32)
  group_valid = q[kept]
  indices = (kept[:, None] * group_size + jnp.arange(group_size, dtype=jnp.int32)).reshape(-1)
  used = group_valid.astype(jnp.float32).sum()
  metrics = {
    "filter/zero_std_frac": 1.0 - q.astype(jnp.float32).mean(),
    "filter/groups_used": used,
    "filter/fill_frac": used / num_keep_groups,
  }
  return indices, group_valid, metrics


def reinforce_rej(rewards: jax.Array, group_size: int) -> jax.Array:
  """Reinforce-Rej: group_valid [P] bool, False for zero-spread groups, no refill (§7)."""
  return _group_has_spread(rewards, group_size)
