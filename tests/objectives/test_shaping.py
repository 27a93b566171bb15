"""Reward shaping, group filtering (objectives.md §6-§7) and entropy (§8)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from jaxrl_llm.objectives import (
  dynamic_sampling,
  entropy_from_logits,
  expand_groups,
  overlong_filter,
  reinforce_rej,
  soft_overlong,
)

jax.config.update("jax_enable_x64", False)


def test_soft_overlong():
  max_len, cache = 20, 8  # punishment starts after 12 tokens
  lengths = np.array([0, 5, 12, 13, 16, 20, 20])
  truncated = np.array([False, False, False, False, False, False, True])
  out = soft_overlong(jnp.asarray(lengths), jnp.asarray(truncated), max_len, cache)
  want = [0.0 if n <= 12 else (12 - n) / 8 for n in lengths]
  want[-1] = -1.0
  np.testing.assert_allclose(out, want, rtol=1e-6)
  assert out.dtype == jnp.float32
  with pytest.raises(ValueError, match="cache_len"):
    soft_overlong(jnp.asarray(lengths), jnp.asarray(truncated), 10, 0)


def test_overlong_filter_keeps_dtype():
  mask = np.ones((3, 4), bool)
  truncated = np.array([False, True, False])
  out = overlong_filter(jnp.asarray(mask), jnp.asarray(truncated))
  assert out.dtype == jnp.bool_
  np.testing.assert_array_equal(out, mask & ~truncated[:, None])
  out_f = overlong_filter(jnp.float32(mask), jnp.asarray(truncated))
  assert out_f.dtype == jnp.float32
  np.testing.assert_array_equal(out_f, (mask & ~truncated[:, None]).astype(np.float32))


def _groups(flags_spread, g=4, seed=0):
  """Rewards for groups that have spread (True) or are flat (False)."""
  rng = np.random.default_rng(seed)
  out = []
  for spread in flags_spread:
    if spread:
      r = rng.integers(0, 2, g).astype(np.float32)
      r[0], r[1] = 0.0, 1.0
    else:
      r = np.full(g, float(rng.integers(0, 2)), np.float32)
    out.append(r)
  return np.concatenate(out)


def test_dynamic_sampling_keeps_first_groups_with_spread():
  g = 4
  spread = [False, True, False, True, True, False, True, True]  # 8 sampled groups
  rewards = _groups(spread, g)
  idx, valid, metrics = dynamic_sampling(jnp.float32(rewards), g, 3)
  np.testing.assert_array_equal(valid, [True, True, True])
  np.testing.assert_array_equal(
    idx, np.concatenate([np.arange(k * g, k * g + g) for k in (1, 3, 4)])
  )
  kept = rewards[np.asarray(idx)].reshape(-1, g)
  assert np.all(kept.std(1) > 0)
  np.testing.assert_allclose(metrics["filter/zero_std_frac"], 3 / 8)
  np.testing.assert_allclose(metrics["filter/groups_used"], 3)
  np.testing.assert_allclose(metrics["filter/fill_frac"], 1.0)


def test_dynamic_sampling_fills_with_masked_groups_when_short():
  g = 2
  spread = [False, True, False, False, False, True]
  rewards = _groups(spread, g, seed=1)
  idx, valid, metrics = jax.jit(dynamic_sampling, static_argnums=(1, 2))(jnp.float32(rewards), g, 4)
  assert idx.shape == (8,) and valid.shape == (4,)
  np.testing.assert_array_equal(valid, [True, True, False, False])
  np.testing.assert_array_equal(np.asarray(idx).reshape(-1, g)[:, 0] // g, [1, 5, 0, 2])
  np.testing.assert_allclose(metrics["filter/fill_frac"], 0.5)
  np.testing.assert_allclose(metrics["filter/groups_used"], 2)
  np.testing.assert_allclose(metrics["filter/zero_std_frac"], 4 / 6)
  np.testing.assert_array_equal(expand_groups(valid, g), np.repeat([1, 1, 0, 0], g).astype(bool))


def test_reinforce_rej():
  rewards = [1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5000001]
  valid = reinforce_rej(jnp.asarray(rewards, jnp.float32), 4)
  np.testing.assert_array_equal(valid, [False, True, False, True])  # no refill, shape kept


def test_entropy_from_logits():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(2, 3, 7)) * 2
  tau = 0.7
  z = logits / tau
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = -(p * np.log(p)).sum(-1)
  out = entropy_from_logits(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32), tau)
  np.testing.assert_allclose(out, want, rtol=0.05)  # bf16-rounded logits
  out = entropy_from_logits(jnp.float32(logits), tau)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, want, rtol=1e-5)

  # gradient against finite differences of the float64 reference
  def h(x):
    zz = x / tau
    q = np.exp(zz - zz.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    return -(q * np.log(q)).sum()

  x = np.float64(np.float32(logits))
  g = jax.grad(lambda y: entropy_from_logits(y, tau).sum())(jnp.float32(x))
  np.testing.assert_allclose(g, ref.fd_grad(h, x), rtol=1e-4, atol=1e-5)


def test_entropy_with_banned_tokens_has_no_nan():
  logits = jnp.array([[[0.0, 1.0, -jnp.inf, 2.0]]])
  h, g = jax.value_and_grad(lambda x: entropy_from_logits(x, 1.0).sum())(logits)
  p = np.exp([0.0, 1.0, 2.0])
  p /= p.sum()
  np.testing.assert_allclose(h, -(p * np.log(p)).sum(), rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(g)))
  bf = entropy_from_logits(jnp.ones((1, 2, 5), jnp.bfloat16), 1.0)
  assert bf.dtype == jnp.float32
  np.testing.assert_allclose(bf, np.log(5), rtol=1e-6)
