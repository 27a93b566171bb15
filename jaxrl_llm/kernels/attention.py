"""Causal grouped-query attention over left-padded rows, by one of several implementations.

Query i of a call sits at cache slot `start + i` and attends key n when n <= start + i and
`key_valid[b, n]`. Rows are left-padded: each row of `key_valid` is a run of False (padding)
then True, as `sampling.sample` and `sampling.score` build it. Softmax is float32 whatever the
compute dtype; a query with no valid key (a padding position) has an unspecified output.

  reference(...)      einsum scores, float32 softmax, `_NEG_INF` masking (the test oracle)
  one_query(...)      the same einsums for a decode step (Q = 1), with the query axis dropped
  one_query_beside(.) `one_query` over the cache as it was before the step's write, with the
                      query's own key and value beside it (what an einsum decode step runs)
  filled_slots_beside(.) the same by jax's Pallas GPU decode kernel, which reads only the key
                      blocks holding each row's filled slots (per-row lengths)
  xla(...)            `jax.nn.dot_product_attention(implementation="xla")`: `is_causal` plus a
                      [B, 1, 1, Q] key mask from slot 0, else the full [B, 1, Q, N] boolean mask
  padded_causal(...)  the cuDNN form: each row rotated so its padding comes last, then causal
                      attention with per-row sequence lengths (no bias tensor; cuDNN skips the
                      masked blocks), rotated back
  select(...)         which one runs for a pass (`select_decode` for a decode step);
                      `attend(...)` runs it

cuDNN flash attention (through `jax.nn.dot_product_attention`) refuses float32 inputs, head
dims that are not a multiple of 8 or exceed 128 (256 from compute capability 9.0), and a
boolean mask or bias whose query/key dims are broadcast: a key-padding mask must be
materialised as a [B, 1, Q, N] bias, whose gradient its backward pass also computes (jax
0.10). Its causal mask has no diagonal offset and its padding is right-padding (sequence
lengths). So it serves the passes that start at slot 0 (learner, reference, prefill) through
sequence lengths after the rotation above, and the other passes keep einsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

AUTO = "auto"  # the fastest implementation verified on this device, else einsum
IMPLEMENTATIONS = (AUTO, "einsum", "xla", "cudnn", "pallas")
DECODE_BLOCK = 16  # the Pallas decode kernel's smallest key block (a Triton tile)
DECODE_SPLITS = 4  # at most this many key splits per row and KV head (the kernel's k_splits)
SEQ_TILE = 64  # the cuDNN form pads its sequence slots to a multiple of this
_NEG_INF = -1e30


def _starts_at_zero(start) -> bool:
  """Whether the queries start at a static slot 0 (no cache, or a prefill into one)."""
  return isinstance(start, int | np.integer) and int(start) == 0


def mask(key_valid: jax.Array, num_q: int, start: jax.Array | int) -> jax.Array:
  """[B, Q, N] bool: causal from slot `start` and valid keys. key_valid: [B, N]."""
  q_slot = start + jnp.arange(num_q)
  causal = q_slot[:, None] >= jnp.arange(key_valid.shape[1])[None, :]  # [Q, N]
  return causal[None, :, :] & key_valid[:, None, :]


def _token_major(x: jax.Array, dtype) -> jax.Array:
  """[B, J, N, Dh] (the cache layout) -> [B, N, J, Dh] (dot_product_attention's) at `dtype`."""
  return x.swapaxes(1, 2).astype(dtype)


def _probs(scores: jax.Array, m: jax.Array, head_dim: int, dtype) -> jax.Array:
  """Scaled, masked float32 softmax of raw scores [.., N] (m broadcasts to them), at `dtype`."""
  scores = scores.astype(jnp.float32) / jnp.sqrt(jnp.float32(head_dim))
  return jax.nn.softmax(jnp.where(m, scores, _NEG_INF), axis=-1).astype(dtype)


def reference(q: jax.Array, keys: jax.Array, values: jax.Array, m: jax.Array) -> jax.Array:
  """q [B, Q, H, Dh], keys/values [B, J, N, Dh], mask [B, Q, N] -> [B, Q, H, Dh] (einsum)."""
  b, num_q, h, dh = q.shape
  j = keys.shape[1]
  qg = q.reshape(b, num_q, j, h // j, dh)  # [B, Q, J, H/J, Dh]
  scores = jnp.einsum("bqjgd,bjkd->bjgqk", qg, keys.astype(q.dtype))
  probs = _probs(scores, m[:, None, None, :, :], dh, q.dtype)
  out = jnp.einsum("bjgqk,bjkd->bqjgd", probs, values.astype(q.dtype))
  return out.reshape(b, num_q, h, dh)


def one_query(q: jax.Array, keys: jax.Array, values: jax.Array, m: jax.Array) -> jax.Array:
  """`reference` for one query per row (q [B, 1, H, Dh], mask [B, 1, N]): the contractions
  batch over (b, j) with the G query heads of a KV head as rows, so no size-1 query axis sits
  between batch and row dims, and the output needs no transpose (1.7x faster per decode layer
  on the CPU backend at 128 rows x 77 slots)."""
  b, _, h, dh = q.shape
  j = keys.shape[1]
  qg = q.reshape(b, j, h // j, dh)  # [B, J, G, Dh]
  scores = jnp.einsum("bjgd,bjkd->bjgk", qg, keys.astype(q.dtype))
  probs = _probs(scores, m[:, :, None, :], dh, q.dtype)  # mask [B, 1, 1, N] over [B, J, G, N]
  out = jnp.einsum("bjgk,bjkd->bjgd", probs, values.astype(q.dtype))
  return out.reshape(b, 1, h, dh)


def one_query_beside(q, keys, values, own_k, own_v, key_valid, start) -> jax.Array:
  """`one_query` for a decode step at traced slot `start` over the cache *before* this step's
  write: keys/values [B, J, N, Dh] are attended at the slots before `start` (and valid), and the
  query's own key/value own_k, own_v [B, J, 1, Dh] beside them (valid where `key_valid` is at
  `start`), in one float32 softmax over the N + 1 scores. The same attention as writing the own
  key at `start` first; reading the cache unwritten lets the step's cache write feed nothing but
  the next step, so XLA writes it in place also when the step is vmapped over a pack's runs
  (which otherwise copied every layer's cache at every step)."""
  b, _, h, dh = q.shape
  n, j = keys.shape[2], keys.shape[1]
  qg = q.reshape(b, j, h // j, dh)  # [B, J, G, Dh]
  f32 = jnp.float32
  scores = jnp.concatenate(
    [
      jnp.einsum("bjgd,bjkd->bjgk", qg, keys.astype(q.dtype), preferred_element_type=f32),
      jnp.einsum("bjgd,bjkd->bjgk", qg, own_k.astype(q.dtype), preferred_element_type=f32),
    ],
    axis=-1,
  )  # [B, J, G, N + 1]
  before = (jnp.arange(n)[None, :] < start) & key_valid  # [B, N]
  own_valid = jax.lax.dynamic_slice_in_dim(key_valid, start, 1, axis=1)  # [B, 1]
  m = jnp.concatenate([before, own_valid], axis=1)[:, None, None, :]  # over [B, J, G, N + 1]
  probs = _probs(scores, m, dh, q.dtype)
  out = jnp.einsum(
    "bjgk,bjkd->bjgd", probs[..., :n], values.astype(q.dtype), preferred_element_type=f32
  )
  out += jnp.einsum(
    "bjgk,bjkd->bjgd", probs[..., n:], own_v.astype(q.dtype), preferred_element_type=f32
  )
  return out.astype(q.dtype).reshape(b, 1, h, dh)


@functools.cache
def _decode_kernel():
  """jax's Pallas GPU decode kernel module, imported when first needed; None where this jax has
  none. jax 0.11 deprecates the Pallas Triton ops of `jax.experimental.pallas.ops.gpu` (and the
  Triton backend): a later release removes them, and then `auto` decodes by einsum."""
  try:
    from jax.experimental.pallas.ops.gpu import decode_attention
  except ImportError:
    return None
  return decode_attention


def pallas_refusal(dtype, cache_dtype, head_dim: int, num_slots: int) -> str | None:
  """Why the Pallas decode kernel cannot serve a decode step over `num_slots` cache slots
  (None if it can). Off a GPU it runs in the Pallas interpreter (tests only: slow)."""
  if head_dim < DECODE_BLOCK or head_dim & (head_dim - 1):
    return f"head_dim={head_dim} must be a power of two >= {DECODE_BLOCK}"
  if num_slots % DECODE_BLOCK:
    return f"the cache's {num_slots} slots must be a multiple of {DECODE_BLOCK} (`cache_slots`)"
  if jnp.dtype(cache_dtype) != jnp.dtype(dtype):
    return f"the cache's dtype {jnp.dtype(cache_dtype).name} must be the compute dtype's"
  if _decode_kernel() is None:
    return (
      f"jax {jax.__version__} has no Pallas GPU decode kernel "
      "(jax.experimental.pallas.ops.gpu.decode_attention)"
    )
  return None


def cache_slots(length: int) -> int:
  """The slots a sampler's cache gets for `length` tokens: rounded up to a multiple of
  DECODE_BLOCK, so the Pallas decode kernel can read it (the extra slots are never valid)."""
  return -(-length // DECODE_BLOCK) * DECODE_BLOCK


def decode_blocks(num_slots: int) -> tuple[int, int]:
  """(block_k, k_splits) for the Pallas decode kernel over `num_slots` (a multiple of
  DECODE_BLOCK): the largest power-of-two key block up to 128 dividing it, and the most splits
  (up to DECODE_SPLITS) into whole blocks."""
  block_k = DECODE_BLOCK
  while block_k < 128 and num_slots % (2 * block_k) == 0:
    block_k *= 2
  blocks = num_slots // block_k
  k_splits = max(s for s in range(1, DECODE_SPLITS + 1) if blocks % s == 0)
  return block_k, k_splits


def filled_slots_beside(q, keys, values, own_k, own_v, key_valid, start) -> jax.Array:
  """`one_query_beside` by jax's Pallas GPU decode kernel (`decode_attn_unbatched`, one program
  per row, KV head and key split): row b reads only the key blocks that hold its filled slots
  [first_b, start), first_b its left padding (skipped to split granularity), and none of the
  unfilled slots after `start`. The kernel returns the unnormalised output with its softmax
  sum and maximum; the query's own key and value join them here in float32, so the cache is
  read before this step's write as in `one_query_beside`. Same arguments and output."""
  b, _, h, dh = q.shape
  j, n = keys.shape[1], keys.shape[2]
  block_k, k_splits = decode_blocks(n)
  block_h = max(DECODE_BLOCK, 1 << (h // j - 1).bit_length())  # the G heads of a KV head
  kernel = functools.partial(
    _decode_kernel().decode_attn_unbatched,
    sm_scale=1.0 / float(np.sqrt(dh)),
    block_h=block_h,
    block_k=block_k,
    k_splits=k_splits,
    num_warps=None,
    num_stages=2,
    grid=None,
    interpret=jax.devices()[0].platform != "gpu",
    debug=False,
    return_residuals=True,
    normalize_output=False,
  )
  first = jnp.argmax(key_valid, axis=1).astype(jnp.int32)  # [B]: the first valid slot
  end = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
  qg = q.reshape(b, j, h // j, dh)
  # Under a jit of its own, which dead-code elimination drops when nothing reads it: jax keeps a
  # bare pallas_call, and flax 0.12.9+ refuses an nn.scan body (scanned layers) that keeps one in
  # its trace for the broadcast variables ("broadcasted variable has a data dependency").
  per_head = jax.vmap(kernel, in_axes=(0, 0, 0, None, None))
  o, (total, top) = jax.jit(jax.vmap(per_head))(qg, keys, values, first, end)  # o [B, J, G, Dh]
  f32 = jnp.float32
  own = jnp.einsum("bjgd,bjd->bjg", qg.astype(f32), own_k[:, :, 0].astype(f32)) / np.sqrt(dh)
  own_valid = jax.lax.dynamic_slice_in_dim(key_valid, start, 1, axis=1)[:, :, None]  # [B, 1, 1]
  own = jnp.where(own_valid, own, _NEG_INF)
  top_all = jnp.maximum(top, own)
  old, new = jnp.exp(top - top_all), jnp.exp(own - top_all)  # [B, J, G]
  out = o.astype(f32) * old[..., None] + new[..., None] * own_v[:, :, :1].astype(f32)
  out = out / (total * old + new)[..., None]
  return out.astype(q.dtype).reshape(b, 1, h, dh)


def ordered_after(out: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
  """`xs` made to depend on the attention output `out` [B, ...] (equal to them where `out` is
  finite), so that a cache write of them is ordered after the attention's read of the cache.
  Without the dependency XLA cannot prove the read comes first and copies the whole cache
  before writing one slot, in every layer at every decode step (an optimization barrier does not
  keep the order on the CPU backend, which removes barriers before it inserts copies)."""
  tie = jnp.sum(out.reshape(out.shape[0], -1), axis=1) * 0  # [B]
  return tuple(x + tie.astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1)) for x in xs)


def xla(q, keys, values, key_valid, start):
  """`jax.nn.dot_product_attention`'s XLA implementation; same arguments as `attend`."""
  num_q = q.shape[1]
  keys, values = _token_major(keys, q.dtype), _token_major(values, q.dtype)
  if _starts_at_zero(start):  # keys past the last query are causally masked: drop them
    kv_mask = key_valid[:, None, None, :num_q]  # [B, 1, 1, Q]
    return jax.nn.dot_product_attention(
      q, keys[:, :num_q], values[:, :num_q], mask=kv_mask, is_causal=True, implementation="xla"
    )
  m = mask(key_valid, num_q, start)[:, None]  # [B, 1, Q, N]
  return jax.nn.dot_product_attention(q, keys, values, mask=m, implementation="xla")


def padded_causal(q, keys, values, key_valid, implementation: str = "cudnn"):
  """Causal attention of Q queries over their own Q keys (slot 0), rows left-padded.

  cuDNN expresses padding only as sequence lengths (valid tokens first) and its causal mask
  only from slot 0, so each row is rotated left by its padding length p, attended with
  `is_causal` and lengths Q - p, and rotated back. Exact for left-padded `key_valid`; the
  padding positions come out as zeros. q: [B, Q, H, Dh]; keys, values: [B, J, >= Q, Dh].
  """
  num_q = q.shape[1]
  keys = _token_major(keys[:, :, :num_q], q.dtype)
  values = _token_major(values[:, :, :num_q], q.dtype)
  n_valid = jnp.sum(key_valid[:, :num_q], axis=1, dtype=jnp.int32)  # [B]
  pad = num_q - n_valid
  ar = jnp.arange(num_q)[None, :]
  fwd = ((ar + pad[:, None]) % num_q)[:, :, None, None]  # row slot i <- original slot i + p
  bwd = ((ar - pad[:, None]) % num_q)[:, :, None, None]
  rot = lambda x, idx: jnp.take_along_axis(x, idx, axis=1)  # noqa: E731
  lengths = jnp.maximum(n_valid, 1)  # an all-padding row attends one (padding) key, not none
  # cuDNN's backward refuses odd sequence lengths: pad the slots to a multiple of SEQ_TILE at
  # the end, past every row's length, so the padding is masked and sliced off.
  extra = -num_q % SEQ_TILE
  tile = lambda x, idx: jnp.pad(rot(x, idx), ((0, 0), (0, extra), (0, 0), (0, 0)))  # noqa: E731
  out = jax.nn.dot_product_attention(
    tile(q, fwd),
    tile(keys, fwd),
    tile(values, fwd),
    is_causal=True,
    query_seq_lengths=lengths,
    key_value_seq_lengths=lengths,
    implementation=implementation,
  )
  return rot(out[:, :num_q], bwd)


def cudnn_refusal(dtype, head_dim: int) -> str | None:
  """Why cuDNN flash attention cannot run on this backend for this model (None if it can)."""
  device = jax.devices()[0]
  version = str(getattr(device.client, "platform_version", "")).lower()
  if device.platform != "gpu" or "cuda" not in version:
    return f"it needs a CUDA GPU (the default device is {device.platform})"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"it takes bfloat16 or float16 compute, not {jnp.dtype(dtype).name}"
  capability = tuple(int(x) for x in str(device.compute_capability).split("."))
  h_max = 256 if capability >= (9, 0) else 128
  if head_dim % 8 or head_dim > h_max:
    return f"head_dim={head_dim} must be a multiple of 8 and <= {h_max} on this GPU"
  return None


def select(implementation: str, dtype, head_dim: int, start) -> str:
  """The implementation one pass runs: einsum | xla | cudnn.

  auto: cuDNN for passes from slot 0 where `cudnn_refusal` finds nothing and its check
  (`verify.choose`, once per process) passes on this device, else einsum.
  cudnn: the same passes, and a ValueError where cuDNN cannot run at all. Passes from a later
  slot (decode steps at a traced `cache_index`, a learner pass from a prefix cache) keep einsum
  under both: cuDNN has no causal offset, and a decode step (one query per row) is a
  memory-bound matrix-vector product over the cache that XLA's einsum already reads once.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"attention={implementation!r} (model.attention); allowed: {', '.join(IMPLEMENTATIONS)}"
    )
  if implementation in ("einsum", "xla"):
    return implementation
  if implementation == "pallas":  # its decode steps are `select_decode`'s; other passes einsum
    return "einsum"
  refusal = cudnn_refusal(dtype, head_dim)
  if implementation == "cudnn" and refusal:
    raise ValueError(f"attention='cudnn' (model.attention) cannot run: {refusal}")
  if refusal is None and _starts_at_zero(start) and implementation == "auto":
    from jaxrl_llm.kernels import verify  # verify imports this module

    return verify.choose("cudnn_attention", "cudnn", "einsum")
  return "cudnn" if refusal is None and _starts_at_zero(start) else "einsum"


def select_decode(implementation: str, dtype, cache_dtype, head_dim: int, num_slots: int) -> str:
  """The implementation a decode step (one query per row at a traced slot) runs: pallas |
  einsum | xla. pallas: the Pallas decode kernel, a ValueError where `pallas_refusal` finds a
  reason. auto: the kernel on a single GPU (it has no partitioning rule) where nothing refuses it and its check (`verify.choose`,
  once per process) passes, else einsum. cudnn decodes by einsum (`select`)."""
  if implementation == "pallas":
    refusal = pallas_refusal(dtype, cache_dtype, head_dim, num_slots)
    if refusal:
      raise ValueError(f"attention='pallas' (model.attention) cannot run: {refusal}")
    return "pallas"
  one_gpu = jax.devices()[0].platform == "gpu" and jax.device_count() == 1  # no partitioning rule
  if implementation == AUTO and one_gpu:
    if pallas_refusal(dtype, cache_dtype, head_dim, num_slots) is None:
      from jaxrl_llm.kernels import verify  # verify imports this module

      return verify.choose("pallas_decode", "pallas", "einsum")
  return select(implementation, dtype, head_dim, 1)  # a traced slot: einsum unless xla


def attend(
  q: jax.Array,  # [B, Q, H, Dh]
  keys: jax.Array,  # [B, J, >= N, Dh], the cache layout (N = Q without a cache)
  values: jax.Array,  # [B, J, >= N, Dh]
  key_valid: jax.Array,  # [B, N] bool, left-padded rows
  start: jax.Array | int,  # slot of query 0: static 0, a static prefix length, or traced
  implementation: str = "einsum",  # an IMPLEMENTATIONS name
  own: tuple[jax.Array, jax.Array] | None = None,  # this call's keys, values [B, J, Q, Dh]
) -> jax.Array:
  """Attention output [B, Q, H, Dh] by the implementation `select` (`select_decode`) picks,
  over the first N = key_valid's width slots of keys and values (the Pallas decode kernel:
  the filled ones). With `own`, keys and values are a cache before this call's write and `own`
  the keys/values written at `start` (a decode step reads them beside the cache:
  `one_query_beside`, `filled_slots_beside`)."""
  decode = own is not None and q.shape[1] == 1 and not _starts_at_zero(start)
  if decode:
    impl = select_decode(implementation, q.dtype, keys.dtype, q.shape[-1], keys.shape[2])
    if impl == "pallas":  # the whole cache: the kernel reads up to `start` only
      return filled_slots_beside(q, keys, values, *own, key_valid, start)
  else:
    impl = select(implementation, q.dtype, q.shape[-1], start)
  n = key_valid.shape[1]  # the slots the other implementations read (a no-op slice at N)
  keys, values = (jax.lax.slice_in_dim(c, 0, n, axis=2) for c in (keys, values))
  if decode and impl == "einsum":
    return one_query_beside(q, keys, values, *own, key_valid, start)
  if own is not None:
    write = lambda c, new: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, 2)  # noqa: E731
    keys, values = write(keys, own[0]), write(values, own[1])
  if impl == "cudnn":
    return padded_causal(q, keys, values, key_valid, "cudnn")
  if impl == "xla":
    return xla(q, keys, values, key_valid, start)
  m = mask(key_valid, q.shape[1], start)
  if q.shape[1] == 1:
    return one_query(q, keys, values, m)
  return reference(q, keys, values, m)
