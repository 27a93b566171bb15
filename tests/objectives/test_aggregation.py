"""Loss aggregation (objectives.md §5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from jaxrl_llm.objectives import aggregation

jax.config.update("jax_enable_x64", False)

RTOL, ATOL = 1e-5, 1e-6
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def _loss_and_mask(seed=0):
  rng = np.random.default_rng(seed)
  mask = np.arange(8)[None] < np.array([8, 2, 0, 5, 1, 7])[:, None]
  loss = np.float64(np.float32(rng.normal(size=mask.shape)))
  return loss, mask


@pytest.mark.parametrize("mode", [*MODES, "seq_mean"])
@pytest.mark.parametrize("max_len", [None, 12])
def test_value_and_gradient_match_reference(mode, max_len):
  loss, mask = _loss_and_mask()
  out = aggregation.aggregate(jnp.float32(loss), mask, mode, max_len=max_len)
  np.testing.assert_allclose(out, ref.aggregate(loss, mask, mode, max_len), rtol=RTOL)
  g = jax.grad(lambda x: aggregation.aggregate(x, mask, mode, max_len=max_len))(jnp.float32(loss))
  want = ref.fd_grad(lambda x: ref.aggregate(x, mask, mode, max_len), loss, mask)
  np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL)


def test_empty_sequences_drop_out_of_the_batch():
  loss, mask = _loss_and_mask()
  keep = mask.sum(-1) > 0
  for mode in MODES:
    full = aggregation.aggregate(jnp.float32(loss), mask, mode, max_len=8)
    dropped = aggregation.aggregate(jnp.float32(loss[keep]), mask[keep], mode, max_len=8)
    np.testing.assert_allclose(full, dropped, rtol=RTOL)
  assert float(aggregation.normalizer(mask, "seq_mean_token_mean")) == keep.sum()


def test_token_and_sequence_level_differ_on_unequal_lengths():
  mask = np.array([[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], bool)
  loss = np.array([[1.0] * 6, [3.0] + [0.0] * 5])
  tok = float(aggregation.aggregate(jnp.float32(loss), mask, "token_mean"))
  seq = float(aggregation.aggregate(jnp.float32(loss), mask, "seq_mean_token_mean"))
  np.testing.assert_allclose(tok, 9 / 7, rtol=RTOL)
  np.testing.assert_allclose(seq, (1 + 3) / 2, rtol=RTOL)
  # and equal lengths make them agree
  full = np.ones_like(mask)
  a = aggregation.aggregate(jnp.float32(loss), full, "token_mean")
  b = aggregation.aggregate(jnp.float32(loss), full, "seq_mean_token_mean")
  np.testing.assert_allclose(a, b, rtol=RTOL)


@pytest.mark.parametrize("mode", [*MODES, "seq_mean"])
def test_microbatch_sum_equals_minibatch(mode):
  loss, mask = _loss_and_mask(1)
  n = aggregation.normalizer(mask, mode, max_len=10)
  whole = aggregation.aggregate(jnp.float32(loss), mask, mode, max_len=10)
  parts = sum(
    aggregation.aggregate(jnp.float32(loss[s]), mask[s], mode, max_len=10, normalizer=n)
    for s in (slice(0, 2), slice(2, 3), slice(3, 6))
  )
  np.testing.assert_allclose(parts, whole, rtol=RTOL)


def test_aggregate_seq():
  rng = np.random.default_rng(2)
  x = np.float32(rng.normal(size=5))
  valid = np.array([1, 0, 1, 1, 0], bool)
  out = aggregation.aggregate_seq(jnp.asarray(x), valid)
  np.testing.assert_allclose(out, x[valid].mean(), rtol=RTOL)
  g = jax.grad(lambda y: aggregation.aggregate_seq(y, valid))(jnp.asarray(x))
  np.testing.assert_allclose(g, valid / 3.0, rtol=RTOL)
  parts = aggregation.aggregate_seq(jnp.asarray(x[:2]), valid[:2], normalizer=3.0)
  parts += aggregation.aggregate_seq(jnp.asarray(x[2:]), valid[2:], normalizer=3.0)
  np.testing.assert_allclose(parts, out, rtol=RTOL)


def test_all_masked_is_zero_not_nan():
  mask = np.zeros((2, 3), bool)
  for mode in MODES:
    v, g = jax.value_and_grad(lambda x, m=mode: aggregation.aggregate(x, mask, m))(jnp.ones((2, 3)))
    assert float(v) == 0 and np.all(np.asarray(g) == 0)


def test_unknown_mode_lists_valid_names():
  with pytest.raises(ValueError, match="token_mean"):
    aggregation.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "tokenmean")
