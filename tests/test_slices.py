"""The KV cache's dynamic slices (`models/slices.py`): the same values and gradients as
`lax.dynamic_slice` / `lax.dynamic_update_slice`, and one slice, not a scatter, under a pack's
vmap when the start indices are shared."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import slices


def _data():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return jax.random.normal(k1, (3, 2, 6, 4)), jax.random.normal(k2, (3, 2, 1, 4))


def _ours(cache, new, at):
  out = slices.update_slice(cache, new, [0, at, 0])
  return out, slices.take_slice(out, [0, at, 0], (2, 1, 4))


def _plain(cache, new, at):
  out = jax.lax.dynamic_update_slice(cache, new, (0, at, 0))
  return out, jax.lax.dynamic_slice(out, (0, at, 0), (2, 1, 4))


def _primitives(fn, *args, in_axes) -> set[str]:
  """The StableHLO ops of `fn` vmapped over `in_axes` that move slices."""
  text = jax.jit(jax.vmap(fn, in_axes=in_axes)).lower(*args).as_text()
  ops = ("scatter", "gather", "dynamic_update_slice", "dynamic_slice")
  return {op for op in ops if f"stablehlo.{op}" in text}


@pytest.mark.parametrize("in_axes", [(0, 0, None), (0, None, None), (None, 0, None), (0, 0, 0)])
def test_values_under_vmap_equal_the_lax_slices(in_axes):
  cache, new = _data()
  at = jnp.array([1, 4, 5]) if in_axes[2] == 0 else jnp.int32(4)
  args = (
    cache if in_axes[0] == 0 else cache[0],
    new if in_axes[1] == 0 else new[0],
    at,
  )
  got = jax.vmap(_ours, in_axes=in_axes)(*args)
  want = jax.vmap(_plain, in_axes=in_axes)(*args)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_shared_starts_stay_slices_under_vmap_and_per_run_starts_scatter():
  cache, new = _data()
  shared = _primitives(_ours, cache, new, jnp.int32(4), in_axes=(0, 0, None))
  assert "scatter" not in shared and "gather" not in shared
  assert {"dynamic_update_slice", "dynamic_slice"} <= shared
  assert "scatter" in _primitives(_plain, cache, new, jnp.int32(4), in_axes=(0, 0, None))
  per_run = _primitives(_ours, cache, new, jnp.array([1, 4, 5]), in_axes=(0, 0, 0))
  assert "scatter" in per_run


def _loss(fn):
  def f(cache, new):
    out, read = fn(cache, new, 4)
    return jnp.sum(out * out) + jnp.sum(jnp.sin(read))

  return jax.grad(f, (0, 1))


def test_gradients_equal_the_lax_slices_alone_and_under_vmap():
  cache, new = _data()
  alone = _loss(_ours)(cache[0], new[0]), _loss(_plain)(cache[0], new[0])
  packed = jax.vmap(_loss(_ours))(cache, new), jax.vmap(_loss(_plain))(cache, new)
  for got, want in (alone, packed):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
