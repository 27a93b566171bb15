"""Loss aggregation over one optimiser minibatch (objectives.md §5).

Every mode is Σ_i (row term_i) / N, where the row term only needs that row's mask and N is a
scalar normaliser of the whole minibatch. Gradient accumulation computes N once with
`normalizer(minibatch_mask, mode)` and passes it to `aggregate` on every microbatch; the sum of
the microbatch results then equals the minibatch result exactly (in value and gradient). Under
data parallelism N is the global count (a jitted global-batch sum does this; under shard_map,
psum it).

Modes (L the per-token loss, m the mask, |o_i| = Σ_t m, B' = #{i : |o_i| > 0}):
  token_mean               Σ m L / Σ m
  seq_mean_token_mean      (1/B') Σ_i Σ_t m L / |o_i|
  seq_mean_token_sum       (1/B') Σ_i Σ_t m L
  seq_mean_token_sum_norm  (1/B') Σ_i Σ_t m L / L_max   (L_max = max_len, default T);
                           with sum_norm_sequences=False: Σ_i Σ_t m L / L_max (verl's form)
  seq_mean                 sequence mean; for a per-sequence term broadcast over its tokens it
                           is seq_mean_token_mean (see also `aggregate_seq` for [B] terms)
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import check_float, check_mask, safe_div

AGGREGATION_MODES = (
  "token_mean",
  "seq_mean_token_mean",
  "seq_mean_token_sum",
  "seq_mean_token_sum_norm",
  "seq_mean",
)


def _check_mode(mode: str) -> None:
  if mode not in AGGREGATION_MODES:
    raise ValueError(f"unknown aggregation {mode!r}; valid names: {', '.join(AGGREGATION_MODES)}")


def normalizer(
  mask: jax.Array, mode: str, max_len: int | None = None, *, sum_norm_sequences: bool = True
) -> jax.Array:
  """Scalar denominator N of an aggregation mode over a whole minibatch (objectives.md §5).

  mask [B, T]; sequences with |o_i| = 0 do not count. max_len (L_max) defaults to T and is
  only used by `seq_mean_token_sum_norm`, whose N is B'·L_max, or L_max alone with
  `sum_norm_sequences=False` (verl's normaliser; still one constant per minibatch, so the
  gradient does not depend on the number of microbatches).
  """
  _check_mode(mode)
  m = check_mask(mask, 2)
  if mode == "token_mean":
    return m.sum()
  num_seqs = (m.sum(-1) > 0).astype(jnp.float32).sum()
  if mode == "seq_mean_token_sum_norm":
    l_max = float(max_len if max_len is not None else m.shape[1])
    return num_seqs * l_max if sum_norm_sequences else jnp.float32(l_max)
  return num_seqs


_normalizer = normalizer  # the keyword argument `normalizer` below shadows the function


def aggregate(
  per_token_loss: jax.Array,
  mask: jax.Array,
  mode: str,
  *,
  max_len: int | None = None,
  normalizer: jax.Array | None = None,
  sum_norm_sequences: bool = True,
) -> jax.Array:
  """Aggregates a per-token loss [B, T] to a scalar (objectives.md §5).

  `normalizer` is the minibatch-level N from `normalizer(...)`; None computes it from `mask`
  (the whole minibatch is this call, with `sum_norm_sequences` as in `normalizer`). Masked
  positions contribute to neither value nor gradient.
  """
  _check_mode(mode)
  chex.assert_rank(per_token_loss, 2)
  check_float(per_token_loss)
  m = check_mask(mask, 2)
  chex.assert_equal_shape([per_token_loss, m])
  if normalizer is None:
    normalizer = _normalizer(m, mode, max_len, sum_norm_sequences=sum_norm_sequences)
  loss = jnp.where(m > 0, per_token_loss.astype(jnp.float32), 0.0)
  row_sum = loss.sum(-1)
  if mode in ("seq_mean_token_mean", "seq_mean"):
    row_sum = row_sum / jnp.maximum(m.sum(-1), 1.0)
  return safe_div(row_sum.sum(), jnp.asarray(normalizer, jnp.float32))


def aggregate_seq(
  per_seq_loss: jax.Array, seq_valid: jax.Array, normalizer: jax.Array | None = None
) -> jax.Array:
  """Sequence mean of a per-sequence loss [B] over valid sequences (objectives.md §2.3, §5).

  `normalizer` is the number of valid sequences in the whole minibatch (default Σ seq_valid);
  for seq_valid = (|o_i| > 0) it equals `normalizer(mask, "seq_mean")`.
  """
  chex.assert_rank(per_seq_loss, 1)
  check_float(per_seq_loss)
  v = check_mask(seq_valid, 1)
  chex.assert_equal_shape([per_seq_loss, v])
  if normalizer is None:
    normalizer = v.sum()
  total = jnp.where(v > 0, per_seq_loss.astype(jnp.float32), 0.0).sum()
  return safe_div(total, jnp.asarray(normalizer, jnp.float32))
