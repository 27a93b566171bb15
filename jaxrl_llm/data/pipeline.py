"""Grain prompt pipeline: in-memory example arrays → checkpointable iterator of batches.

The iterator is a ``grain.DatasetIterator``; save and restore its position with orbax::

  mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(train_state),
      data=grain.checkpoint.CheckpointSave(prompt_iter)))
  mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data=grain.checkpoint.CheckpointRestore(prompt_iter)))  # restores prompt_iter in place
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import chex
import grain
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.types import PromptBatch

PROMPT_KEYS = ("tokens", "mask", "answer", "answer_mask")


class ArraySource:
  """Random-access grain data source over a dict of equal-length numpy arrays.

  Element ``i`` is ``{key: array[i]}``.
  """

  def __init__(self, examples: Mapping[str, np.ndarray]):
    self._arrays = {k: np.asarray(v) for k, v in examples.items()}
    self._len = _num_rows(self._arrays)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {k: v[index] for k, v in self._arrays.items()}

  def __repr__(self) -> str:
    shapes = {k: v.shape for k, v in self._arrays.items()}
    return f"ArraySource({shapes})"


def _num_rows(examples: Mapping[str, np.ndarray]) -> int:
  """Common leading dimension of the example arrays; ValueError when absent or mismatched."""
  if not examples:
    raise ValueError("examples is empty: expected a dict of numpy arrays.")
  rows = {k: (np.shape(v)[0] if np.ndim(v) else None) for k, v in examples.items()}
  if any(n is None for n in rows.values()):
    raise ValueError(f"Every example array needs a leading row dimension; got rows {rows}.")
  if len(set(rows.values())) != 1:
    raise ValueError(f"Example arrays disagree on the number of rows: {rows}.")
  n = next(iter(rows.values()))
  if n == 0:
    raise ValueError("examples has zero rows.")
  return n


def make_prompt_iterator(
  examples: Mapping[str, np.ndarray],
  batch_size: int,
  seed: int,
  *,
  shuffle: bool = True,
  num_epochs: int | None = None,
  shard_index: int = 0,
  shard_count: int = 1,
  batch_fn: Callable[[Sequence[dict[str, np.ndarray]]], dict[str, np.ndarray]] | None = None,
) -> grain.DatasetIterator:
  """Checkpointable iterator of batches ``{key: [batch_size, ...] numpy array}``.

  Pipeline: source → shuffle(seed) (reshuffled each epoch) → repeat(num_epochs; None repeats
  forever) → global batch of ``batch_size * shard_count`` rows (drop_remainder=True) → this
  shard's contiguous block of ``batch_size`` rows. All shards must use the same seed: they then
  read disjoint blocks of the same global batches, so the global batch (the rows assembled over
  the processes, in process order) does not depend on the number of processes.

  Args:
    examples: dict of numpy arrays sharing the leading dimension N (e.g. a task's
      ``train_examples(seed)``).
    batch_size: rows per batch (per shard).
    seed: shuffle seed, in [0, 2**32).
    shuffle: whether to shuffle; False keeps the source order.
    num_epochs: passes over the data, or None for an endless stream.
    shard_index: this process's shard in ``[0, shard_count)``.
    shard_count: number of shards (data-loading processes).
    batch_fn: stacks a list of rows into a batch; None uses grain's default (``np.stack`` per
      key).
  """
  n = _num_rows(examples)
  if shard_count < 1 or not 0 <= shard_index < shard_count:
    raise ValueError(
      f"Need shard_count >= 1 and 0 <= shard_index < shard_count; got shard_index="
      f"{shard_index}, shard_count={shard_count}."
    )
  per_shard = n // shard_count
  if batch_size < 1 or batch_size > per_shard:  # a global batch must fit in the data
    raise ValueError(
      f"batch_size must be in [1, {per_shard}] (N={n} rows over {shard_count} shard(s)); "
      f"got {batch_size}."
    )
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs must be None (forever) or >= 1, got {num_epochs}.")
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}.")

  ds = grain.MapDataset.source(ArraySource(examples))
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  ds = ds.batch(batch_size * shard_count, drop_remainder=True, batch_fn=batch_fn)
  if shard_count > 1:
    block = slice(shard_index * batch_size, (shard_index + 1) * batch_size)
    ds = ds.map(lambda batch: {k: v[block] for k, v in batch.items()})
  # Data is already in memory: read in the calling thread, no prefetch threads.
  read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  return iter(ds.to_iter_dataset(read_options))


def to_prompt_batch(
  np_batch: Mapping[str, np.ndarray], sharding: jax.sharding.Sharding | None = None
) -> PromptBatch:
  """Converts one iterator batch to a ``PromptBatch`` of device arrays.

  ``tokens``/``mask`` must be [P, S] and ``answer``/``answer_mask`` [P, A]. With ``sharding``
  the arrays are placed with ``jax.device_put(..., sharding)``; otherwise on the default device.
  """
  missing = [k for k in PROMPT_KEYS if k not in np_batch]
  if missing:
    raise ValueError(f"Batch lacks keys {missing}; has {sorted(np_batch)}.")
  tokens, mask = np.asarray(np_batch["tokens"]), np.asarray(np_batch["mask"])
  answer, answer_mask = np.asarray(np_batch["answer"]), np.asarray(np_batch["answer_mask"])
  try:
    chex.assert_rank([tokens, mask, answer, answer_mask], 2)
    chex.assert_equal_shape([tokens, mask])
    chex.assert_equal_shape([answer, answer_mask])
    chex.assert_equal_shape_prefix([tokens, answer], 1)
  except AssertionError as e:
    raise ValueError(f"Inconsistent prompt batch shapes: {e}") from e
  batch = PromptBatch(
    tokens=tokens.astype(np.int32),
    mask=mask.astype(bool),
    answer=answer.astype(np.int32),
    answer_mask=answer_mask.astype(bool),
  )
  if sharding is not None:
    return jax.device_put(batch, sharding)
  return jax.tree.map(jnp.asarray, batch)
