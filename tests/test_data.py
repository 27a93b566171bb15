"""Tests for the grain prompt pipeline and its orbax checkpointing."""

from __future__ import annotations

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_llm.data import pipeline
from jaxrl_llm.data.tasks import get_task
from jaxrl_llm.types import PromptBatch


def _examples(n: int = 40) -> dict[str, np.ndarray]:
  """Rows whose ``id`` column identifies them; other columns derived from it."""
  ids = np.arange(n, dtype=np.int32)
  return {
    "id": ids,
    "tokens": np.stack([ids, ids + 1, ids + 2], axis=1),
    "mask": np.ones((n, 3), bool),
  }


def _take(it, k: int) -> list[dict[str, np.ndarray]]:
  return [next(it) for _ in range(k)]


def _assert_same(a: list[dict], b: list[dict]):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


def test_batches_have_leading_batch_dim():
  ex = _examples()
  batch = next(pipeline.make_prompt_iterator(ex, 8, seed=0))
  assert batch["id"].shape == (8,) and batch["tokens"].shape == (8, 3)
  assert batch["tokens"].dtype == np.int32 and batch["mask"].dtype == bool
  np.testing.assert_array_equal(batch["tokens"][:, 0], batch["id"])  # rows stay intact


def test_same_seed_same_stream_and_epochs_cover_all_rows():
  ex = _examples()
  a = _take(pipeline.make_prompt_iterator(ex, 8, seed=3), 12)
  b = _take(pipeline.make_prompt_iterator(ex, 8, seed=3), 12)
  _assert_same(a, b)
  c = _take(pipeline.make_prompt_iterator(ex, 8, seed=4), 12)
  assert not all(np.array_equal(x["id"], y["id"]) for x, y in zip(a, c))
  epochs = np.concatenate([x["id"] for x in a[:10]]).reshape(2, 40)  # 80 rows = 2 epochs
  for epoch in epochs:
    assert sorted(epoch.tolist()) == list(range(40))
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch
  ordered = _take(pipeline.make_prompt_iterator(ex, 8, seed=3, shuffle=False), 5)
  np.testing.assert_array_equal(np.concatenate([x["id"] for x in ordered]), np.arange(40))


def test_finite_epochs_drop_remainder():
  it = pipeline.make_prompt_iterator(_examples(), 16, seed=0, num_epochs=1)
  assert [x["id"].shape[0] for x in it] == [16, 16]  # 40 rows → 2 full batches


def test_get_state_set_state_continuation():
  ex = _examples()
  it = pipeline.make_prompt_iterator(ex, 8, seed=5)
  _take(it, 7)
  state = it.get_state()
  expected = _take(it, 6)
  fresh = pipeline.make_prompt_iterator(ex, 8, seed=5)
  fresh.set_state(state)
  _assert_same(_take(fresh, 6), expected)


def test_orbax_checkpoint_restores_iterator(tmp_path):
  ex = get_task("addition").train_examples(0)
  it = pipeline.make_prompt_iterator(ex, 16, seed=11)
  _take(it, 3)
  params = {"w": np.arange(4, dtype=np.float32)}
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
    mngr.save(
      3,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), data=grain.checkpoint.CheckpointSave(it)
      ),
    )
    mngr.wait_until_finished()
  expected = _take(it, 4)

  restored_it = pipeline.make_prompt_iterator(ex, 16, seed=11)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
    assert mngr.latest_step() == 3
    restored = mngr.restore(
      3,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params),
        data=grain.checkpoint.CheckpointRestore(restored_it),
      ),
    )
  np.testing.assert_array_equal(restored["params"]["w"], params["w"])
  assert restored["data"] is restored_it
  _assert_same(_take(restored_it, 4), expected)


def test_shards_are_disjoint_and_cover_the_data():
  ex = _examples(40)
  seen = []
  for shard in range(2):
    it = pipeline.make_prompt_iterator(
      ex, 4, seed=2, num_epochs=1, shard_index=shard, shard_count=2
    )
    seen.append(np.concatenate([x["id"] for x in it]))
  assert len(seen[0]) == len(seen[1]) == 20
  assert not set(seen[0].tolist()) & set(seen[1].tolist())
  assert sorted(np.concatenate(seen).tolist()) == list(range(40))


def test_input_validation():
  ex = _examples(10)
  with pytest.raises(ValueError, match="empty"):
    pipeline.make_prompt_iterator({}, 2, seed=0)
  with pytest.raises(ValueError, match="zero rows"):
    pipeline.make_prompt_iterator({"a": np.zeros((0, 3))}, 2, seed=0)
  with pytest.raises(ValueError, match="disagree on the number of rows"):
    pipeline.make_prompt_iterator({"a": np.zeros((4, 3)), "b": np.zeros(5)}, 2, seed=0)
  with pytest.raises(ValueError, match="batch_size"):
    pipeline.make_prompt_iterator(ex, 11, seed=0)
  with pytest.raises(ValueError, match="batch_size"):
    pipeline.make_prompt_iterator(ex, 6, seed=0, shard_count=2)
  with pytest.raises(ValueError, match="shard_index"):
    pipeline.make_prompt_iterator(ex, 2, seed=0, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match="num_epochs"):
    pipeline.make_prompt_iterator(ex, 2, seed=0, num_epochs=0)


def test_to_prompt_batch():
  task = get_task("reverse")
  batch = next(pipeline.make_prompt_iterator(task.train_examples(0), 4, seed=0))
  pb = pipeline.to_prompt_batch(batch)
  assert isinstance(pb, PromptBatch)
  assert pb.tokens.shape == (4, task.prompt_len) and pb.tokens.dtype == np.int32
  assert pb.answer.shape == (4, task.answer_len) and pb.answer_mask.dtype == bool
  assert isinstance(pb.tokens, jax.Array)
  np.testing.assert_array_equal(pb.tokens, batch["tokens"])
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  assert pipeline.to_prompt_batch(batch, sharding).mask.sharding == sharding
  with pytest.raises(ValueError, match="lacks keys"):
    pipeline.to_prompt_batch({"tokens": batch["tokens"]})
  bad = dict(batch, mask=batch["mask"][:, 1:])
  with pytest.raises(ValueError, match="Inconsistent"):
    pipeline.to_prompt_batch(bad)
