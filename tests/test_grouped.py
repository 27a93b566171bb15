"""The portable grouped matmul: `jax.lax.ragged_dot`'s values and gradients in O(rows) memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.kernels.grouped import grouped_matmul, tile_rows
from jaxrl_llm.models.moe import resolve_impl

SIZES = {
  "mixed_with_empty": [3, 0, 5, 0, 8, 1],
  "one_hot_expert": [0, 0, 17, 0, 0, 0],
  "even": [3, 3, 3, 3, 3, 3],
  "rows_past_the_end": [2, 0, 1, 4, 0, 0],  # 7 of 20 rows in groups; the rest give zeros
  "all_empty": [0, 0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("tile", [None, 8, 4])
@pytest.mark.parametrize("name", list(SIZES))
def test_values_and_gradients_equal_ragged_dot(name, tile):
  sizes = jnp.asarray(SIZES[name], jnp.int32)
  e, m, k, n = sizes.shape[0], 20, 16, 12
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(len(name)), 3)
  x = jax.random.normal(kx, (m, k))
  w = jax.random.normal(kw, (e, k, n))
  cot = jax.random.normal(kc, (m, n))

  def loss(fn, x, w):
    return jnp.sum(jnp.sin(fn(x, w)) * cot)

  want = jax.lax.ragged_dot(x, w, sizes)
  got = grouped_matmul(x, w, sizes, tile=tile)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(got)[int(sizes.sum()) :])
  g_want = jax.grad(loss, argnums=(1, 2))(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
  g_got = jax.grad(loss, argnums=(1, 2))(lambda a, b: grouped_matmul(a, b, sizes, tile=tile), x, w)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bfloat16_matches_the_float32_product():
  sizes = jnp.asarray([5, 0, 11, 16], jnp.int32)
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 64)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(1), (4, 64, 48)).astype(jnp.bfloat16)
  got = grouped_matmul(x, w, sizes)
  assert got.dtype == jnp.bfloat16
  want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
  np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=2e-2, atol=5e-2)


def test_forward_and_backward_memory_is_rows_times_width_not_experts():
  """Compile-only at E=64, M=16,384, K=1024, N=384 bf16 (nothing is allocated)."""
  e, m, k, n = 64, 16384, 1024, 384
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((e,), jnp.int32)

  def temp_mib(fn):
    loss = lambda x, w, s: jnp.sum(fn(x, w, s).astype(jnp.float32))  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, sizes).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20

  portable = temp_mib(grouped_matmul)
  assert portable < 512, portable
  # The CPU backend expands ragged_dot densely: rows x experts x width.
  assert temp_mib(jax.lax.ragged_dot) > 8 * portable


def test_tile_follows_the_mean_group_size_and_auto_picks_by_backend():
  assert tile_rows(64 * 8, 64) == 8  # a decode step: 8 rows per expert on average
  assert tile_rows(16384, 64) == 64
  assert tile_rows(4, 64) == 8
  assert resolve_impl("auto", "tpu") == "ragged"
  assert resolve_impl("auto", "cpu") == resolve_impl("auto", "gpu") == "portable"
  assert resolve_impl("dense", "tpu") == "dense"
