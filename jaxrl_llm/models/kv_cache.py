"""The transformer's key/value cache: its type, creation, growth and the writes of new tokens.

The cache has a fixed length N (static shape). Unrolled layers keep a tuple of per-layer
[B, J, N, Dh] arrays; scanned layers (`ModelConfig.scan_layers`) one stacked [L, B, J, N, Dh]
array per k and v (`models.scan` converts between the two). A prefill writes a prompt at a
static slot; a decode step writes one token per sequence at a traced slot, which stays one
dynamic_update_slice under a pack's vmap (`write_tokens`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_llm.models.config import ModelConfig

__all__ = [
  "CACHE_SEQ_AXIS",
  "KVCache",
  "grow_cache",
  "init_cache",
  "is_decode_step",
  "write_tokens",
]


@struct.dataclass
class KVCache:
  """Key/value cache of a fixed length N (static shape): per-layer arrays, or stacked ones when
  the layers are scanned (`ModelConfig.scan_layers`).

  Heads lead the sequence axis: a decode step's attention is then a batched matmul over
  (B, J) on contiguous [N, Dh] slices, with no relayout of the cache at every step.
  """

  k: tuple[jax.Array, ...] | jax.Array  # L x [B, J, N, Dh], or [L, B, J, N, Dh] scanned
  v: tuple[jax.Array, ...] | jax.Array  # L x [B, J, N, Dh], or [L, B, J, N, Dh] scanned

  @property
  def batch_axis(self) -> int:
    """The batch axis of the cache's arrays (1 when they are stacked over layers)."""
    return 0 if isinstance(self.k, tuple) else 1

  @property
  def seq_axis(self) -> int:
    """The sequence axis N of the cache's arrays."""
    return self.batch_axis + CACHE_SEQ_AXIS

  def repeat_rows(self, n: int) -> KVCache:
    """Each sequence's cache repeated n times in a row (a prompt's cache shared by its group)."""
    return jax.tree.map(lambda x: jnp.repeat(x, n, axis=self.batch_axis), self)


CACHE_SEQ_AXIS = 2  # the sequence axis N of each layer's [B, J, N, Dh] cache array


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
  """An all-zero cache for `batch` sequences of up to `length` tokens."""
  shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
  if cfg.scan_layers:
    zeros = jnp.zeros((cfg.num_layers, *shape), cfg.compute_dtype)
    return KVCache(k=zeros, v=zeros)
  zeros = tuple(jnp.zeros(shape, cfg.compute_dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros, v=zeros)


def is_decode_step(cache_index) -> bool:
  """Whether a pass with this cache slot is a decode step: its slot is traced (a loop's
  counter), where a prefill's or a learner pass's is a Python int."""
  return not isinstance(cache_index, int | np.integer)


def write_tokens(cache, new, index, layer=None, decode: bool | None = None) -> jax.Array:
  """The cache [B, J, N, Dh] (or stacked [L, B, J, N, Dh], then at `layer`) with `new`
  [B, J, Q, Dh] written at slot `index`. In a decode step (`decode`; by default: `index` is
  traced) the write stays one dynamic_update_slice under a pack's vmap (`_write_at`, not
  differentiable); elsewhere (a prefill, a learner pass) it is lax's own."""
  new = new.astype(cache.dtype)
  starts = (0, 0, index, 0) if layer is None else (layer, 0, 0, index, 0)
  if layer is not None:
    new = new[None]
  if not (is_decode_step(index) if decode is None else decode):
    return jax.lax.dynamic_update_slice(cache, new, starts)
  return _write_at(cache, new, jnp.stack([jnp.asarray(x, jnp.int32) for x in starts]))


@jax.custom_batching.custom_vmap
def _write_at(operand: jax.Array, update: jax.Array, starts: jax.Array) -> jax.Array:
  """`lax.dynamic_update_slice(operand, update, starts)`, whose vmap over arrays at unbatched
  `starts` (a pack's runs write the same slot) is again one dynamic_update_slice on the stacked
  arrays. JAX batches a dynamic_update_slice to a scatter, which XLA lowers to a select and an
  update of a copy, and on the CPU backend upcasts a bfloat16 cache to float32 around it: in
  every layer at every decode step, the whole cache read, converted and copied back. Not
  differentiable (decode steps only)."""
  return jax.lax.dynamic_update_slice(operand, update, tuple(starts))


@_write_at.def_vmap
def _write_at_vmap(axis_size, in_batched, operand, update, starts):
  """The batching rule of `_write_at`: the runs axis leads; per-run slots fall back to vmap."""
  operand_b, update_b, starts_b = in_batched
  if starts_b:  # runs at different slots: JAX's own batching (a scatter)
    fn = lambda o, u, s: jax.lax.dynamic_update_slice(o, u, tuple(s))  # noqa: E731
    axes = tuple(0 if b else None for b in in_batched)
    return jax.vmap(fn, in_axes=axes)(operand, update, starts), True
  lead = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *x.shape))  # noqa: E731
  starts = jnp.concatenate([jnp.zeros((1,), starts.dtype), starts])
  return _write_at(lead(operand, operand_b), lead(update, update_b), starts), True


def grow_cache(cache: KVCache, extra: int) -> KVCache:
  """The cache with `extra` empty slots appended to its sequence axis."""

  def grow(x):
    pad = [(0, 0)] * x.ndim
    pad[cache.seq_axis] = (0, extra)
    return jnp.pad(x, pad)

  return jax.tree.map(grow, cache)
