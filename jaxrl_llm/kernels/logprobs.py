"""Token log-probs and entropies from hidden states without a [B, T, V] float32 buffer.

The learner needs, at each completion position, ℓ = log softmax(z / τ)[token] and the entropy
H of softmax(z / τ), where z = unembed(h) are the logits (spec §0, §8). At a 152k vocabulary a
float32 [B, T, V] logits tensor (and its softmax and gradient) dominates the learner's memory.

  reference(...)  the plain computation over the whole [B, T, V] (the test oracle)
  chunked(...)    a `lax.scan` over chunks of positions, each under `jax.checkpoint`: only a
                  [B, c, V] block of logits exists at a time, forward and backward
  select(...)     which one the learner runs, and the chunk size
Both take `unembed(h [B, c, D]) -> float32 logits [B, c, V]` so they serve tied and untied
output layers alike; log-softmax and entropy are float32 whatever the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives.regularizers import entropy_from_logprobs

Unembed = Callable[[jax.Array], jax.Array]

# Bytes of one float32 [B, c, V] logits block the chunked path aims for (per microbatch).
DEFAULT_BLOCK_BYTES = 256 * 2**20


def _logp_and_entropy(logits: jax.Array, tokens: jax.Array, temperature: float):
  """(ℓ [..], H [..]) of float32 logits [.., V] at temperature τ for the given tokens."""
  z = logits.astype(jnp.float32) / temperature
  logp_all = jax.nn.log_softmax(z, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]
  return logp, entropy_from_logprobs(logp_all)


def reference(hidden: jax.Array, unembed: Unembed, tokens: jax.Array, temperature: float):
  """ℓ [B, T] and H [B, T] through the full [B, T, V] logits (the oracle)."""
  chex.assert_rank([hidden, tokens], [3, 2])
  return _logp_and_entropy(unembed(hidden), tokens, temperature)


def chunked(hidden: jax.Array, unembed: Unembed, tokens: jax.Array, temperature: float, chunk: int):
  """ℓ [B, T] and H [B, T], `chunk` positions at a time, recomputed in the backward pass.

  T must be a multiple of `chunk` (`select` picks one that is).
  """
  chex.assert_rank([hidden, tokens], [3, 2])
  b, t, d = hidden.shape
  if t % chunk:
    raise ValueError(f"chunk={chunk} must divide the number of positions T={t}")
  n = t // chunk
  h = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)  # [n, B, c, D]
  tok = tokens.reshape(b, n, chunk).swapaxes(0, 1)  # [n, B, c]

  @jax.checkpoint
  def block(h_c, tok_c):
    return _logp_and_entropy(unembed(h_c), tok_c, temperature)

  _, (logp, entropy) = jax.lax.scan(lambda c, x: (c, block(*x)), None, (h, tok))
  return logp.swapaxes(0, 1).reshape(b, t), entropy.swapaxes(0, 1).reshape(b, t)


def chunk_size(batch: int, positions: int, vocab: int, block_bytes: int = DEFAULT_BLOCK_BYTES):
  """The largest divisor c of `positions` with batch·c·vocab·4 bytes <= block_bytes (>= 1)."""
  best = 1
  for c in range(1, positions + 1):
    if positions % c == 0 and batch * c * vocab * 4 <= block_bytes:
      best = c
  return best


def select(
  hidden: jax.Array,
  unembed: Unembed,
  tokens: jax.Array,
  temperature: float,
  vocab: int,
  *,
  block_bytes: int | None = None,
):
  """ℓ and H through `chunked` when a whole [B, T, V] block would exceed `block_bytes`
  (default DEFAULT_BLOCK_BYTES), else through `reference` (one block: nothing to save)."""
  b, t, _ = hidden.shape
  c = chunk_size(b, t, vocab, block_bytes or DEFAULT_BLOCK_BYTES)
  if c >= t:
    return reference(hidden, unembed, tokens, temperature)
  return chunked(hidden, unembed, tokens, temperature, c)
