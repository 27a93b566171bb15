"""A grouped matmul whose memory is O(rows x width): the portable mixture-of-experts path.

`jax.lax.ragged_dot` has a grouped lowering on TPU; on CPU and GPU XLA expands it to a dense
matmul over rows x (experts x width). `grouped_matmul` computes the same product on any
backend: the rows (sorted by group) are laid out so that each group starts on a tile boundary,
and a `lax.scan` over tiles multiplies each tile by its group's weight. Its gradient is its own
(`jax.custom_vjp`): the backward scans the same tiles for dx and accumulates dW per group, so
no per-tile copy of a weight is ever kept. `jax.lax.ragged_dot` is the reference (tests).

`grouped_swiglu` is the whole routed SwiGLU of a mixture-of-experts layer in the same tiles,
fused: each tile gathers its tokens' rows, runs gate/up/down with its expert's weights and
adds the gate-weighted result into the tokens' outputs. Neither the K-times-expanded token rows
nor the hidden activations of all assignments exist at once: memory is O(tokens x d_model)
plus one tile, and the backward recomputes each tile's activations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def tile_rows(num_rows: int, num_groups: int, max_tile: int = 64) -> int:
  """Rows per tile: about the mean group size (a power of two in [8, max_tile]), so the
  padding (< one tile per group) stays small next to the rows at any batch size. 64 rows keep
  E=64, M=16,384, K=1024, N=384 bf16 forward+backward at 446 MiB of temp on the CPU backend
  (128: 520 MiB; `jax.lax.ragged_dot` there: 8,032 MiB)."""
  mean = max(num_rows // max(num_groups, 1), 1)
  tile = 8
  while tile * 2 <= min(mean, max_tile):
    tile *= 2
  return tile


def _layout(group_sizes: jax.Array, num_rows: int, tile: int):
  """(destination row of each input row in the padded layout, group of each tile, padded rows).

  Group g's rows go to [padded_start_g, padded_start_g + size_g); padded starts are multiples
  of `tile`. Rows past sum(group_sizes) get an out-of-range destination (dropped).
  """
  e = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  padded = (sizes + tile - 1) // tile * tile
  ends, padded_ends = jnp.cumsum(sizes), jnp.cumsum(padded)
  starts, padded_starts = ends - sizes, padded_ends - padded
  m_pad = -(-(num_rows + e * (tile - 1)) // tile) * tile  # static upper bound
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # e past the end
  g = jnp.minimum(group, e - 1)
  dest = jnp.where(group < e, padded_starts[g] + rows - starts[g], m_pad)
  tile_starts = jnp.arange(m_pad // tile, dtype=jnp.int32) * tile
  tile_group = jnp.searchsorted(padded_ends, tile_starts, side="right").astype(jnp.int32)
  return dest, jnp.minimum(tile_group, e - 1), m_pad  # tiles past the end hold zero rows


@jax.custom_vjp
def _tiled(x_tiles: jax.Array, w: jax.Array, tile_group: jax.Array) -> jax.Array:
  """[T, t, K] tiles @ w[tile_group] -> [T, t, N], one tile per scan step."""

  def step(_, inputs):
    x_t, g = inputs
    y = jnp.dot(x_t, w[g], preferred_element_type=jnp.float32)
    return None, y.astype(x_tiles.dtype)

  return jax.lax.scan(step, None, (x_tiles, tile_group))[1]


def _tiled_fwd(x_tiles, w, tile_group):
  return _tiled(x_tiles, w, tile_group), (x_tiles, w, tile_group)


def _tiled_bwd(residuals, dy):
  x_tiles, w, tile_group = residuals

  def step(dw, inputs):
    x_t, dy_t, g = inputs
    dx = jnp.dot(dy_t, w[g].T, preferred_element_type=jnp.float32).astype(x_tiles.dtype)
    dw = dw.at[g].add(jnp.dot(x_t.T, dy_t, preferred_element_type=jnp.float32))
    return dw, dx

  dw, dx = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32), (x_tiles, dy, tile_group))
  return dx, dw.astype(w.dtype), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


@functools.partial(jax.jit, static_argnames=("tile",))
def grouped_matmul(
  x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int | None = None
) -> jax.Array:
  """x [M, K] (rows sorted by group) @ w [E, K, N] per group -> [M, N] in x's dtype.

  Rows [sum(sizes[:g]), sum(sizes[:g+1])) use w[g]; rows past sum(group_sizes) give zeros (as
  `jax.lax.ragged_dot`). Products accumulate in float32. Memory: the padded rows
  (M + E·tile) x (K + N) and, in the backward pass, one float32 dW; never E x M x N.
  """
  m, k = x.shape
  tile = tile or tile_rows(m, w.shape[0])
  dest, tile_group, m_pad = _layout(group_sizes, m, tile)
  x_pad = jnp.zeros((m_pad, k), x.dtype).at[dest].set(x, mode="drop")
  y_pad = _tiled(x_pad.reshape(m_pad // tile, tile, k), w, tile_group)
  return y_pad.reshape(m_pad, -1).at[dest].get(mode="fill", fill_value=0)


def _swiglu_layout(idx: jax.Array, num_experts: int, tile: int):
  """(token of each padded row [tiles, tile] (T past the end), assignment of each padded row
  (A past the end), expert of each tile, tiles holding rows) for idx [T, K].

  Assignments a = t·K + k are sorted by expert; experts outside [0, E) are dropped."""
  t, k = idx.shape
  flat = idx.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True)  # assignments grouped by expert (dropped ones last)
  sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
  dest, tile_group, m_pad = _layout(sizes, t * k, tile)
  assignment = jnp.full((m_pad,), t * k, jnp.int32).at[dest].set(order, mode="drop")
  token = jnp.where(assignment < t * k, assignment // k, t)
  used = -(-jnp.sum(((sizes + tile - 1) // tile) * tile) // tile)
  shape = (m_pad // tile, tile)
  return token.reshape(shape), assignment.reshape(shape), tile_group, used


def _varying_like(value: jax.Array, *like: jax.Array) -> jax.Array:
  """`value` typed as varying over every manual mesh axis that `like` vary over (inside
  `shard_map`), so a scan carry started from it keeps its type; `value` itself elsewhere."""
  axes = set()
  for x in like:
    axes |= set(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()))
  return jax.lax.pcast(value, tuple(sorted(axes)), to="varying") if axes else value


def _summed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """A cotangent summed over the manual mesh axes it varies over and `primal` does not (inside
  `shard_map`: the gradient of a weight replicated over the data axes is the sum of every data
  shard's part); `ct` itself elsewhere."""
  varying = lambda x: set(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()))  # noqa: E731
  extra = tuple(sorted(varying(ct) - varying(primal)))
  return jax.lax.psum(ct, extra) if extra else ct


def _swiglu_tile(x_t, g, w_gate, w_up, w_down):
  """One tile: (a, b, h, out) of SwiGLU x_t [t, D] through expert g; a, b, out float32."""
  a = jnp.dot(x_t, w_gate[g], preferred_element_type=jnp.float32)
  b = jnp.dot(x_t, w_up[g], preferred_element_type=jnp.float32)
  h = (jax.nn.silu(a) * b).astype(x_t.dtype)
  return a, b, h, jnp.dot(h, w_down[g], preferred_element_type=jnp.float32)


@jax.custom_vjp
def _fused(x, gate_tiles, w_gate, w_up, w_down, token_tiles, tile_group, used):
  """y [T, D] float32 = Σ over a token's assignments of gate · SwiGLU_expert(x[token])."""

  def step(y, inputs):
    i, tok, gate, g = inputs

    def run(y):
      _, _, _, out = _swiglu_tile(x.at[tok].get(mode="fill", fill_value=0), g, w_gate, w_up, w_down)
      return y.at[tok].add(gate[:, None] * out, mode="drop")

    return jax.lax.cond(i < used, run, lambda y: y, y), None

  tiles = jnp.arange(token_tiles.shape[0])
  y0 = _varying_like(jnp.zeros(x.shape, jnp.float32), x, gate_tiles, token_tiles)
  return jax.lax.scan(step, y0, (tiles, token_tiles, gate_tiles, tile_group))[0]


def _fused_fwd(x, gate_tiles, w_gate, w_up, w_down, token_tiles, tile_group, used):
  y = _fused(x, gate_tiles, w_gate, w_up, w_down, token_tiles, tile_group, used)
  return y, (x, gate_tiles, w_gate, w_up, w_down, token_tiles, tile_group, used)


def _fused_bwd(residuals, dy):
  x, gate_tiles, w_gate, w_up, w_down, token_tiles, tile_group, used = residuals
  f32 = lambda w: _varying_like(jnp.zeros(w.shape, jnp.float32), dy, x, gate_tiles)  # noqa: E731

  def step(carry, inputs):
    i, tok, gate, g = inputs

    def run(carry):
      dx, dwg, dwu, dwd = carry
      x_t = x.at[tok].get(mode="fill", fill_value=0)
      a, b, h, out = _swiglu_tile(x_t, g, w_gate, w_up, w_down)
      dy_t = dy.at[tok].get(mode="fill", fill_value=0)  # [t, D] float32
      d_gate = jnp.sum(dy_t * out, axis=-1)
      d_out = (dy_t * gate[:, None]).astype(x.dtype)
      dwd = dwd.at[g].add(jnp.dot(h.T, d_out, preferred_element_type=jnp.float32))
      dh = jnp.dot(d_out, w_down[g].T, preferred_element_type=jnp.float32)
      sig = jax.nn.sigmoid(a)
      da = (dh * b * sig * (1 + a * (1 - sig))).astype(x.dtype)
      db = (dh * a * sig).astype(x.dtype)
      dx_t = jnp.dot(da, w_gate[g].T, preferred_element_type=jnp.float32)
      dx_t += jnp.dot(db, w_up[g].T, preferred_element_type=jnp.float32)
      dx = dx.at[tok].add(dx_t, mode="drop")
      dwg = dwg.at[g].add(jnp.dot(x_t.T, da, preferred_element_type=jnp.float32))
      dwu = dwu.at[g].add(jnp.dot(x_t.T, db, preferred_element_type=jnp.float32))
      return (dx, dwg, dwu, dwd), d_gate

    def skip(carry):
      return carry, _varying_like(jnp.zeros(tok.shape, jnp.float32), dy, x, gate_tiles)

    return jax.lax.cond(i < used, run, skip, carry)

  tiles = jnp.arange(token_tiles.shape[0])
  carry0 = (f32(x), f32(w_gate), f32(w_up), f32(w_down))
  (dx, dwg, dwu, dwd), d_gate = jax.lax.scan(
    step, carry0, (tiles, token_tiles, gate_tiles, tile_group)
  )
  cast = lambda d, like: _summed_like(d, like).astype(like.dtype)  # noqa: E731
  grads = (
    cast(dx, x),
    cast(d_gate, gate_tiles),
    cast(dwg, w_gate),
    cast(dwu, w_up),
    cast(dwd, w_down),
  )
  return (*grads, None, None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.jit, static_argnames=("tile",))
def grouped_swiglu(
  x: jax.Array,
  idx: jax.Array,
  gates: jax.Array,
  w_gate: jax.Array,
  w_up: jax.Array,
  w_down: jax.Array,
  *,
  tile: int | None = None,
) -> jax.Array:
  """Routed SwiGLU experts of x [T, D]: Σ_k gates[t, k] · SwiGLU_{idx[t, k]}(x[t]) -> [T, D]
  float32, with w_gate / w_up [E, D, F] and w_down [E, F, D] (x's dtype in the matmuls,
  float32 accumulation and activations). Experts outside [0, E) contribute nothing (their
  assignments are dropped). Gradients for x, gates and the weights (not idx)."""
  t, k = idx.shape
  e = w_gate.shape[0]
  tile = tile or tile_rows(t * k, e)
  token_tiles, assignment, tile_group, used = _swiglu_layout(idx, e, tile)
  gate_tiles = gates.reshape(-1).at[assignment].get(mode="fill", fill_value=0)
  return _fused(x, gate_tiles, w_gate, w_up, w_down, token_tiles, tile_group, used)


# --- The Hopper kernel path: Mosaic GPU grouped matmuls shipped with JAX. ---------------------

KERNEL_BLOCK_K = 64  # contraction block of the Mosaic GPU kernels (128-byte swizzle in bf16)
KERNEL_DTYPES = ("bfloat16", "float16")  # wgmma operand types the kernels accept


def interpreting() -> bool:
  """Whether Pallas kernels run in the interpreter (`force_gpu_interpret_mode`, tests)."""
  from jax._src import config  # the interpreter switch has no public getter

  return config.pallas_tpu_interpret_mode_context_manager.value is not None


def kernel_unsupported(device, dtype, dims: tuple[int, ...]) -> str | None:
  """Why the Mosaic GPU grouped matmul cannot run here (None when it can): it needs a Hopper
  GPU (compute capability 9.x), a 16-bit compute dtype and every matmul width (d_model,
  expert width) a multiple of 64."""
  if device is None or device.platform != "gpu":
    platform = "none" if device is None else device.platform
    return f"it runs on NVIDIA Hopper GPUs only (this program is compiled for {platform})"
  capability = str(getattr(device, "compute_capability", ""))
  if not capability.startswith("9"):
    return f"it needs a Hopper GPU (compute capability 9.x); this one reports {capability!r}"
  if jnp.dtype(dtype).name not in KERNEL_DTYPES:
    return f"it needs model.compute_dtype in {KERNEL_DTYPES}, not {jnp.dtype(dtype).name}"
  bad = [n for n in dims if n % KERNEL_BLOCK_K]
  if bad:
    return f"every matmul width must be a multiple of {KERNEL_BLOCK_K}; got {bad}"
  return None


def kernel_blocks(n: int) -> dict[str, int]:
  """Block sizes of the grouped kernel (forward and input gradient) for an output width n:
  the family measured fastest on an H100 at E=64, K=1024, N=384 (block_m 128, block_n 192 or
  128, block_k 64, 4 stages, 2 column blocks)."""
  block_n = next(b for b in (192, 128, 64) if n % b == 0)
  return dict(
    block_m=128,
    block_n=block_n,
    block_k=KERNEL_BLOCK_K,
    max_concurrent_steps=4,
    grid_block_n=2 if n % (2 * block_n) == 0 else 1,
  )


def weight_grad_blocks(k: int, n: int) -> dict[str, int]:
  """Block sizes of the transposed grouped kernel (the weight gradient [G, k, n]): block_m
  tiles the input width k, block_n the output width n. The family measured fastest on an H200
  at E=64, M=16,384, K=1024, N=384 (`tools/bench_grouped.py --sweep`: 52 us by CUPTI against
  69 us with block_n 128, 2 stages and one column block)."""
  block_n = next(b for b in (192, 128, 64) if n % b == 0)
  return dict(
    block_m=next(b for b in (128, 64) if k % b == 0),
    block_n=block_n,
    block_k=KERNEL_BLOCK_K,
    max_concurrent_steps=4,
    grid_block_n=2 if n % (2 * block_n) == 0 else 1,
  )


def _mgpu_forward(x, w, group_sizes, blocks=None):
  """x [M, K] rows sorted by group @ w[g] [K, N] -> [M, N] on the Mosaic GPU kernel (`blocks`:
  other block sizes than `kernel_blocks`', for `tools/bench_grouped.py --sweep`)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  blocks = blocks or kernel_blocks(w.shape[2])
  return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes, **blocks)


def _mgpu_input_grad(dy, w, group_sizes, blocks=None):
  """dy [M, N] @ w[g].T -> [M, K], reading w in place (`transpose_rhs`)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  blocks = blocks or kernel_blocks(w.shape[1])
  return ragged_dot_mgpu.ragged_dot(dy, w, group_sizes=group_sizes, transpose_rhs=True, **blocks)


def _mgpu_weight_grad(x, dy, group_sizes, blocks=None):
  """dW[g] = x[rows of g].T @ dy[rows of g] -> [G, K, N] (`transposed_ragged_dot`)."""
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

  blocks = blocks or weight_grad_blocks(x.shape[1], dy.shape[1])
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy, group_sizes=group_sizes, **blocks)


def reference_input_grad(dy, w, group_sizes):
  """`jax.lax.ragged_dot` form of `_mgpu_input_grad` (oracle; the interpreter cannot run the
  transposed-operand kernel)."""
  return jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), group_sizes)


def reference_weight_grad(x, dy, group_sizes):
  """`jax.lax.ragged_dot_general` form of `_mgpu_weight_grad` (oracle)."""
  dims = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
  )
  return jax.lax.ragged_dot_general(x, dy, group_sizes, ragged_dot_dimension_numbers=dims)


KERNEL_OPS = {
  "mgpu": (_mgpu_forward, _mgpu_input_grad, _mgpu_weight_grad),
  # Forward on the Mosaic GPU kernel, gradients by the reference: what the CPU interpreter can
  # run (it lowers neither `transpose_rhs` nor the transposed kernel's layout casts).
  "mgpu_forward": (_mgpu_forward, reference_input_grad, reference_weight_grad),
}


KERNEL_BLOCK_M = 128  # rows per block; the rows are padded to a multiple of it


def kernel_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, ops: str = "mgpu"):
  """Grouped matmul on the Mosaic GPU kernels: x [M, K] (rows sorted by group; rows past
  sum(group_sizes) give zeros) @ w[g] [G, K, N] -> [M, N] in x's dtype. Its gradient is its
  own: dx by the same kernel against w read transposed, dW by the transposed grouped kernel,
  so memory stays O(rows x width) (`jax.lax.ragged_dot` on GPU holds rows x G·N)."""
  m = x.shape[0]
  pad = -m % KERNEL_BLOCK_M  # every block the kernel reads lies inside the buffer
  y = _kernel_matmul(jnp.pad(x, ((0, pad), (0, 0))), w, group_sizes.astype(jnp.int32), ops)[:m]
  used = jnp.arange(m) < jnp.sum(group_sizes)  # the kernel leaves other rows unwritten
  return jnp.where(used[:, None], y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_matmul(x, w, group_sizes, ops):
  """`kernel_matmul` on rows padded to whole blocks."""
  return KERNEL_OPS[ops][0](x, w, group_sizes)


def _kernel_fwd(x, w, group_sizes, ops):
  return _kernel_matmul(x, w, group_sizes, ops), (x, w, group_sizes)


def _kernel_bwd(ops, residuals, dy):
  x, w, group_sizes = residuals
  _, input_grad, weight_grad = KERNEL_OPS[ops]
  dy = dy.astype(x.dtype)
  dx = input_grad(dy, w, group_sizes).astype(x.dtype)
  used = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)  # the kernel leaves other rows unwritten
  dx = jnp.where(used[:, None], dx, jnp.zeros((), dx.dtype))
  dw = weight_grad(x, dy, group_sizes).astype(w.dtype)
  return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_kernel_matmul.defvjp(_kernel_fwd, _kernel_bwd)
