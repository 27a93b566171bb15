"""Dynamic slices of the KV cache that stay slices under a pack's vmap.

JAX batches `lax.dynamic_slice` / `lax.dynamic_update_slice` as a gather / scatter even when
only the array is batched and the start indices are not (a pack's runs share the decode
step). On XLA's CPU backend that scatter, at every decode step, copied each layer's whole
cache three times (a pack of one run stepped 34% slower than the run alone). These versions
batch as the same slice with a leading 0 index when the starts are shared, and fall back to
the gather / scatter when they are not. Both are differentiable (a custom VJP: the slice's
cotangent is the slice of the output's, and the reverse).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def _starts(starts: Sequence) -> jax.Array:
  return jnp.stack([jnp.asarray(s, jnp.int32) for s in starts])


def update_slice(operand: jax.Array, update: jax.Array, starts: Sequence) -> jax.Array:
  """`lax.dynamic_update_slice(operand, update, starts)`, one slice under vmap when the
  starts are not batched."""
  return _update(update.shape, operand, update, _starts(starts))


def take_slice(operand: jax.Array, starts: Sequence, sizes: Sequence[int]) -> jax.Array:
  """`lax.dynamic_slice(operand, starts, sizes)`, one slice under vmap when the starts are
  not batched."""
  sizes = tuple(int(s) for s in sizes)
  return _take(operand.shape, sizes, operand, _starts(starts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _update(shape, operand, update, starts):
  return _batched_update(operand, update, starts)


def _update_fwd(shape, operand, update, starts):
  return _batched_update(operand, update, starts), starts


def _update_bwd(shape, starts, g):
  hole = _batched_update(g, jnp.zeros(shape, g.dtype), starts)
  return hole, _batched_take(g, starts, shape), None


_update.defvjp(_update_fwd, _update_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _take(shape, sizes, operand, starts):
  return _batched_take(operand, starts, sizes)


def _take_fwd(shape, sizes, operand, starts):
  return _batched_take(operand, starts, sizes), starts


def _take_bwd(shape, sizes, starts, g):
  return _batched_update(jnp.zeros(shape, g.dtype), g, starts), None


_take.defvjp(_take_fwd, _take_bwd)


def _batched_update(operand, update, starts):
  """The update as one slice under vmap when `starts` are shared (a leading 0 start)."""

  def plain(operand, update, starts):
    return jax.lax.dynamic_update_slice(operand, update, tuple(starts))

  write = jax.custom_batching.custom_vmap(plain)

  @write.def_vmap
  def _rule(axis_size, in_batched, operand, update, starts):
    op_b, up_b, st_b = in_batched
    if st_b:  # each run its own slot: JAX's own batching (a scatter)
      axes = (0 if op_b else None, 0 if up_b else None, 0)
      return jax.vmap(plain, in_axes=axes)(operand, update, starts), True
    if not op_b:
      operand = jnp.broadcast_to(operand, (axis_size, *operand.shape))
    if not up_b:
      update = jnp.broadcast_to(update, (axis_size, *update.shape))
    return _batched_update(operand, update, _starts([0, *starts])), True

  return write(operand, update, starts)


def _batched_take(operand, starts, sizes):
  """The slice as one slice under vmap when `starts` are shared (a leading 0 start)."""

  def plain(operand, starts):
    return jax.lax.dynamic_slice(operand, tuple(starts), sizes)

  read = jax.custom_batching.custom_vmap(plain)

  @read.def_vmap
  def _rule(axis_size, in_batched, operand, starts):
    op_b, st_b = in_batched
    if st_b or not op_b:  # per-run starts, or nothing batched to slice: JAX's own batching
      axes = (0 if op_b else None, 0 if st_b else None)
      return jax.vmap(plain, in_axes=axes)(operand, starts), True
    return _batched_take(operand, _starts([0, *starts]), (axis_size, *sizes)), True

  return read(operand, starts)
