"""The grouped matmuls: `jax.lax.ragged_dot`'s values and gradients in O(rows) memory (the
portable tiles here, the Hopper kernels under the Pallas GPU interpreter)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

from jaxrl_llm.kernels import grouped, verify
from jaxrl_llm.kernels.grouped import grouped_matmul, grouped_swiglu, tile_rows
from jaxrl_llm.models.moe import EXPERTS, _experts_dense, resolve_impl

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
  # Hopper picks the Mosaic GPU kernels when they accept the dtype and widths and their
  # checks pass on this process's device; others do not. Here (a CPU) the checks cannot run,
  # so even a Hopper that accepts them falls back: `auto` never picks an unverified kernel.
  hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
  ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
  assert not verify.verified("moe_kernel")
  assert resolve_impl("auto", hopper, jnp.bfloat16, (1024, 384)) == "portable"
  assert resolve_impl("auto", hopper, jnp.float32, (1024, 384)) == "portable"
  assert resolve_impl("auto", hopper, jnp.bfloat16, (1024, 100)) == "portable"
  assert resolve_impl("auto", ampere, jnp.bfloat16, (1024, 384)) == "portable"


@pytest.mark.parametrize(
  "device, dtype, dims, why",
  [
    ("cpu", jnp.bfloat16, (64,), "NVIDIA Hopper GPUs only"),
    (types.SimpleNamespace(platform="gpu", compute_capability="8.6"), jnp.bfloat16, (64,), "9.x"),
    (types.SimpleNamespace(platform="gpu", compute_capability="9.0"), jnp.float32, (64,), "bf"),
    (types.SimpleNamespace(platform="gpu", compute_capability="9.0"), jnp.bfloat16, (96,), "64"),
  ],
)
def test_explicit_kernel_where_it_cannot_run_names_why(device, dtype, dims, why):
  if isinstance(device, str):
    device = jax.devices()[0]  # this machine's CPU
  with pytest.raises(ValueError, match=r"moe_impl='kernel'.*" + why + r".*Allowed"):
    resolve_impl("kernel", device, dtype, dims)


@pytest.mark.parametrize(
  "sizes",
  [
    [37, 0, 100, 63],  # empty
    pytest.param([0, 0, 200, 0], marks=pytest.mark.extended),  # hot
    [0, 0, 0, 0],  # none
    pytest.param([50, 50, 50, 20], marks=pytest.mark.extended),  # < M
  ],
  ids=["random-with-empty", "one-hot-expert", "no-rows", "rows-past-the-groups"],
)
def test_mosaic_gpu_kernel_equals_ragged_dot_in_the_interpreter(sizes):
  """The Hopper forward kernel, run by the Pallas GPU interpreter on CPU, gives
  `jax.lax.ragged_dot`'s values; the custom gradient gives its gradients. (The interpreter
  cannot run the two backward kernels: `transpose_rhs` and the transposed kernel's layout
  casts do not lower on CPU, so here the backward uses their reference forms.)"""
  m, k, n = 200, 128, 192
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(sum(sizes)), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (4, k, n), jnp.bfloat16)
  c = jax.random.normal(kc, (m, n), jnp.float32)
  sizes = jnp.asarray(sizes, jnp.int32)

  def loss(fn):
    return lambda x, w: jnp.sum(c * fn(x, w, sizes).astype(jnp.float32))

  kernel = functools.partial(grouped.kernel_matmul, ops="mgpu_forward")
  with force_gpu_interpret_mode():
    y = jax.jit(kernel)(x, w, sizes)
    grads = jax.jit(jax.grad(loss(kernel), argnums=(0, 1)))(x, w)
  ref = jax.lax.ragged_dot(x, w, sizes)
  ref_grads = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=1e-2)
  assert not np.any(np.asarray(y)[int(jnp.sum(sizes)) :])  # rows past the groups are zero
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )


def _swiglu_case(idx, t=None, d=16, f=12, e=6, dtype=jnp.float32, seed=0):
  idx = jnp.asarray(idx, jnp.int32)
  t, k = idx.shape
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  args = (
    jax.random.normal(ks[0], (t, d)).astype(dtype),
    jax.random.uniform(ks[1], (t, k)),
    (0.3 * jax.random.normal(ks[2], (e, d, f))).astype(dtype),
    (0.3 * jax.random.normal(ks[3], (e, d, f))).astype(dtype),
    (0.3 * jax.random.normal(ks[4], (e, f, d))).astype(dtype),
  )
  return idx, args, jax.random.normal(ks[5], (t, d))


ROUTES = {
  "random": jax.random.randint(jax.random.PRNGKey(3), (37, 3), 0, 6),
  "one_hot_expert": jnp.full((21, 2), 4),
  "empty_experts": jnp.asarray([[0, 5]] * 9 + [[5, 0]] * 4),
  "dropped_assignments": jnp.asarray([[1, 6], [6, 6], [2, 3], [7, 0]]),  # 6, 7 are not experts
}


@pytest.mark.parametrize(
  "name,tile",
  [(name, None) for name in ROUTES if name != "one_hot_expert"]
  + [
    pytest.param(name, tile, marks=pytest.mark.extended)
    for name, tile in [("one_hot_expert", None), ("random", 4), ("empty_experts", 8)]
  ],
)
def test_fused_swiglu_equals_the_dense_experts(name, tile):
  """`grouped_swiglu` = every expert on every token combined by a one-hot gate matrix (the
  `dense` reference), values and gradients for x, gates and all three weights."""
  idx, args, cot = _swiglu_case(ROUTES[name])
  in_range = jnp.where(idx < 6, idx, 0)
  kept = (idx < 6).astype(jnp.float32)

  def want(x, gates, *w):
    return _experts_dense(x[None], in_range[None], (gates * kept)[None], *w)[0]

  def got(x, gates, *w):
    return grouped_swiglu(x, idx, gates, *w, tile=tile)

  np.testing.assert_allclose(got(*args), want(*args), rtol=1e-5, atol=1e-5)
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)) * cot)  # noqa: E731
  g_want = jax.grad(loss(want), argnums=range(5))(*args)
  g_got = jax.grad(loss(got), argnums=range(5))(*args)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_fused_swiglu_in_bfloat16_stays_near_float32():
  idx, args, _ = _swiglu_case(ROUTES["random"], dtype=jnp.bfloat16, d=64, f=48)
  got = grouped_swiglu(
    idx=idx, x=args[0], gates=args[1], w_gate=args[2], w_up=args[3], w_down=args[4]
  )
  f32 = [a.astype(jnp.float32) for a in args]
  want = grouped_swiglu(f32[0], idx, *f32[1:])
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)


def test_fused_swiglu_memory_is_tokens_times_width():
  """Compile-only, fwd+bwd of a 64-expert top-8 layer over 4,096 tokens (d1024, width 384,
  bf16): beside the float32 weight-gradient accumulators (288 MiB) the fused tiles need
  O(tokens x d_model), where the `ragged` path holds the K-times-expanded sorted rows (which the
  CPU backend also expands over experts)."""
  t, k, e, d, f = 4096, 8, 64, 1024, 384
  bf = jnp.bfloat16
  shapes = (
    jax.ShapeDtypeStruct((1, t, d), bf),
    jax.ShapeDtypeStruct((1, t, k), jnp.int32),
    jax.ShapeDtypeStruct((1, t, k), jnp.float32),
    jax.ShapeDtypeStruct((e, d, f), bf),
    jax.ShapeDtypeStruct((e, d, f), bf),
    jax.ShapeDtypeStruct((e, f, d), bf),
  )

  def temp_mib(impl):
    def loss(x, idx, gates, *w):
      return jnp.sum(EXPERTS[impl](x, idx, gates, *w))

    grad = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5)))
    return grad.lower(*shapes).compile().memory_analysis().temp_size_in_bytes / 2**20

  fused = temp_mib("portable")
  weight_grads = 3 * e * d * f * 4 / 2**20
  tokens = t * d * 4 / 2**20  # one float32 [T, D]: 16 MiB
  assert fused < weight_grads + 4 * tokens, fused
  ragged = temp_mib("ragged")
  assert ragged > 10 * fused, (ragged, fused)


def test_rows_the_backward_kernel_leaves_unwritten_never_reach_the_gradient():
  """The Hopper input-gradient kernel writes only the rows inside the groups (on an H200 the
  rest came back non-finite). `kernel_matmul`'s backward zeroes them: here an input-gradient
  op that fills those rows with NaN, as unwritten memory may hold, gives the reference's dx."""

  def unwritten_rows(dy, w, group_sizes):
    dx = grouped.reference_input_grad(dy, w, group_sizes)
    inside = jnp.arange(dx.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(inside[:, None], dx, jnp.nan)

  weight_grad = grouped.KERNEL_OPS["mgpu_forward"][2]
  grouped.KERNEL_OPS["unwritten_rows"] = (jax.lax.ragged_dot, unwritten_rows, weight_grad)
  try:
    m, k, n = 200, 64, 64
    kx, kw, kc = jax.random.split(jax.random.PRNGKey(7), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (3, k, n), jnp.float32)
    c = jax.random.normal(kc, (m, n), jnp.float32)
    sizes = jnp.asarray([50, 0, 90], jnp.int32)  # 60 rows past the groups, 56 rows of padding
    kernel = functools.partial(grouped.kernel_matmul, ops="unwritten_rows")
    got = jax.grad(lambda x: jnp.sum(c * kernel(x, w, sizes)))(x)
    want = jax.grad(lambda x: jnp.sum(c * jax.lax.ragged_dot(x, w, sizes)))(x)
  finally:
    del grouped.KERNEL_OPS["unwritten_rows"]
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
