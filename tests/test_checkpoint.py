"""Tests for orbax checkpointing: real checkpoints in a tmp dir, real flax/optax/grain objects."""

import json
import shutil

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import checkpoint, checkpoint_compat, checkpoint_manifest
from jaxrl_llm.config import tagged
from jaxrl_llm.types import TrainState

META = {"model": {"num_layers": 2, "d_model": 16, "dims": (4, 3)}, "task": "addition"}


class _Tiny(nn.Module):
  hidden: int = 8

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(self.hidden)(x)))


def _state(hidden=8, typed_key=True, ref=True, steps=2):
  params = _Tiny(hidden).init(jax.random.PRNGKey(0), jnp.ones((1, 4)))["params"]
  tx = optax.adamw(1e-2)
  opt_state = tx.init(params)
  for i in range(steps):  # non-trivial moments and count
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p + i), params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  rng = jax.random.key(42) if typed_key else jax.random.PRNGKey(42)
  return TrainState(
    step=jnp.int32(steps),
    params=params,
    opt_state=opt_state,
    ref_params=jax.tree.map(jnp.copy, params) if ref else None,
    rng=rng,
  )


def _leaves(tree):
  """Leaves as numpy, typed keys as their key data, for bit-exact comparison."""

  def host(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
    return (str(x.dtype), np.asarray(x))

  return [host(x) for x in jax.tree.leaves(tree)]


def _assert_bit_exact(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_leaves(a), _leaves(b)):
    assert x[:-1] == y[:-1]
    assert x[-1].dtype == y[-1].dtype and x[-1].shape == y[-1].shape
    assert x[-1].tobytes() == y[-1].tobytes()


def _abstract(state):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


@pytest.mark.parametrize("typed_key", [True, False], ids=["typed_key", "uint32_key"])
def test_train_state_round_trip_bit_exact(tmp_path, typed_key):
  state = _state(typed_key=typed_key)
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(2, state, meta=META)
    ckpt.wait()
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.latest_step() == 2
    restored, meta = ckpt.restore(2, _abstract(state))
    # The target jax.eval_shape gives (typed keys keep their key dtype) works as well.
    restored2, _ = ckpt.restore(2, jax.eval_shape(lambda: state))
  assert isinstance(restored, TrainState)
  _assert_bit_exact(restored, state)
  _assert_bit_exact(restored2, state)
  assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key) == typed_key
  assert meta == json.loads(json.dumps(META))
  # The restored key drives the same random stream.
  np.testing.assert_array_equal(
    jax.random.uniform(jax.random.fold_in(restored.rng, 7), (3,)),
    jax.random.uniform(jax.random.fold_in(state.rng, 7), (3,)),
  )


def test_restore_into_named_shardings(tmp_path):
  state = _state()
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

  def spec(x):
    return P("data", *([None] * (x.ndim - 1))) if x.ndim >= 1 else P()

  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x))),
    jax.eval_shape(lambda: state),
  )
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(2, state, meta=META)
    ckpt.wait()
    restored, _ = ckpt.restore(2, target)
  _assert_bit_exact(restored, state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert isinstance(got.sharding, NamedSharding)
    assert got.sharding == want.sharding


def test_save_is_async_and_state_may_be_donated(tmp_path):
  state = _state()
  expected = _leaves(state)
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.save(2, state, meta=META)
    # As a donating jitted step would: the buffers are gone before the save is committed.
    for x in jax.tree.leaves(state):
      x.delete()
    ckpt.wait()
    restored, _ = ckpt.restore(2, _abstract(_state()))
  assert jax.tree.structure(restored) == jax.tree.structure(_state())
  for x, y in zip(_leaves(restored), expected, strict=True):
    assert x[:-1] == y[:-1] and x[-1].dtype == y[-1].dtype and x[-1].shape == y[-1].shape
    assert x[-1].tobytes() == y[-1].tobytes()


def test_incompatible_meta_raises_helpful_error(tmp_path):
  state = _state()
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(2, state, meta=META)
    ckpt.wait()
    # Same config (tuples compare equal to the lists JSON gives back); other keys are ignored.
    other_task = {**META, "task": "sort"}
    ckpt.restore(2, _abstract(state), expect=checkpoint.MetaCheck(other_task))
    current = {**META, "model": {**META["model"], "num_layers": 4}}
    with pytest.raises(checkpoint.CheckpointMismatchError) as err:
      ckpt.restore(2, _abstract(state), expect=checkpoint.MetaCheck(current))
  msg = str(err.value)
  assert f"workdir {tmp_path}" in msg
  assert "model.num_layers=2" in msg and "model.num_layers=4" in msg
  assert "use a new --workdir or match the model config" in msg
  assert err.value.diffs == {"model.num_layers": (2, 4)}
  assert isinstance(err.value, ValueError)


def test_check_compatible_reports_missing_and_extra_fields():
  """A field one side lacks is `<absent>` there; a subtree one side lacks is said once, as the
  subtree (a resume adding adapters on a base listed `<absent>` for each base field)."""
  saved = {"model": {"num_layers": 2, "moe": {"experts": 4, "top_k": {"train": 2}}}, "task": "a"}
  current = {"model": {"num_layers": 2, "rope": True}, "task": "b"}
  with pytest.raises(checkpoint_compat.CheckpointMismatchError) as err:
    checkpoint_compat.check_compatible(saved, current, keys=("model", "task"), workdir="/x")
  assert err.value.diffs == {
    "model.moe": ({"experts": 4, "top_k": {"train": 2}}, "<absent>"),
    "model.rope": ("<absent>", True),
    "task": ("a", "b"),
  }
  assert "model.moe.experts" not in str(err.value) and str(err.value).count("<absent>") == 2
  assert str(err.value).startswith("workdir /x holds a checkpoint of a model/task with")
  checkpoint_compat.check_compatible(saved, {**current, "model": saved["model"]}, keys=("model",))


def test_numerics_only_fields_are_not_compared():
  saved = {"model": {"num_layers": 2, "moe_impl": "ragged"}}
  current = {"model": {"num_layers": 2, "moe_impl": "auto"}}
  with pytest.raises(checkpoint_compat.CheckpointMismatchError, match=r"model\.moe_impl"):
    checkpoint_compat.check_compatible(saved, current)
  checkpoint_compat.check_compatible(saved, current, ignore=tagged("numerics"))
  other = {"model": {"num_layers": 3, "moe_impl": "auto"}}
  with pytest.raises(checkpoint_compat.CheckpointMismatchError, match=r"model\.num_layers"):
    checkpoint_compat.check_compatible(saved, other, ignore=tagged("numerics"))


def test_shape_mismatch_names_parameter_paths(tmp_path):
  state = _state(hidden=8, ref=False)
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(2, state, meta=META)
    ckpt.wait()
    with pytest.raises(checkpoint.CheckpointMismatchError) as err:
      ckpt.restore(2, _abstract(_state(hidden=6, ref=False)))
    msg = str(err.value)
    assert "params/Dense_1/kernel: saved (4, 8), expected (4, 6)" in msg
    assert "opt_state/0/mu/Dense_0/kernel: saved (8, 3), expected (6, 3)" in msg
    assert f"checkpoint step 2 in {tmp_path}/checkpoints" in msg
    # A target with a reference policy the checkpoint does not hold.
    with pytest.raises(checkpoint.CheckpointMismatchError, match="ref_params/Dense_0/bias"):
      ckpt.restore(2, _abstract(_state(hidden=8, ref=True)))


def _iterator():
  return iter(grain.MapDataset.range(100).shuffle(seed=0).repeat().batch(4).to_iter_dataset())


def test_grain_iterator_state_round_trips(tmp_path):
  state = _state()
  it = _iterator()
  for _ in range(3):
    next(it)
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(3, state, data_iter=it, meta=META)
    expected = [next(it) for _ in range(30)]  # crosses an epoch boundary
    ckpt.wait()
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    fresh = _iterator()
    _, _ = ckpt.restore(3, _abstract(state), data_iter=fresh)
  got = [next(fresh) for _ in range(30)]
  for a, b in zip(expected, got):
    np.testing.assert_array_equal(a, b)


def test_restoring_data_iter_without_saved_data_fails_clearly(tmp_path):
  state = _state()
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(1, state, meta=META)
    ckpt.wait()
    with pytest.raises(checkpoint.CheckpointMismatchError, match="no data-iterator state"):
      ckpt.restore(1, _abstract(state), data_iter=_iterator())
    restored, _ = ckpt.restore(1, _abstract(state))
  _assert_bit_exact(restored, state)


def test_save_every_max_to_keep_and_forced_final_save(tmp_path):
  state = _state()
  with checkpoint.Checkpointer(tmp_path, save_every=2, max_to_keep=2) as ckpt:
    saved = [s for s in range(1, 10) if ckpt.save(s, state, meta=META)]
    assert saved == [2, 4, 6, 8]
    assert ckpt.save(9, state, meta=META, force=True)
    assert not ckpt.save(9, state, meta=META, force=True)  # already saved: skipped
    ckpt.wait()
    assert ckpt.all_steps() == [8, 9] and ckpt.latest_step() == 9
  with checkpoint.Checkpointer(tmp_path, save_every=2, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() == 9
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["8", "9"]
    with pytest.raises(FileNotFoundError, match=r"available steps: \[8, 9\]"):
      ckpt.restore(2, _abstract(state))


def _saved(tmp_path, steps, max_to_keep):
  """A state saved at each of `steps` (committed, checksums written); returns it."""
  state = _state()
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=max_to_keep) as ckpt:
    for step in steps:
      ckpt.save(step, state, meta=META)
    ckpt.wait()
  return state


def test_unfinished_checkpoints_are_ignored_and_kept(tmp_path):
  state = _saved(tmp_path, (2, 4), max_to_keep=1)
  root = tmp_path / "checkpoints"
  # A crash mid-save: orbax's temporary directory, and a step directory without commit marker.
  (root / "6.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  (root / "6.orbax-checkpoint-tmp" / "state" / "blob").write_bytes(b"half")
  (root / "5").mkdir()
  (root / "5" / "state").write_bytes(b"data")
  (root / "7").mkdir()  # empty: holds nothing

  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=1) as ckpt:
    assert ckpt.latest_step() == 4 and ckpt.all_steps() == [4]
    assert [p.name for p in ckpt.uncommitted_dirs()] == ["5", "6.orbax-checkpoint-tmp", "7"]
    # Moved aside, not deleted, while no committed step supersedes it.
    assert [p.name for p in root.iterdir() if p.name.startswith("6.")] == ["6.orbax-checkpoint-tmp"]
    assert ckpt.save(5, state, meta=META)
    ckpt.wait()
    # Step 5 committed supersedes its own unfinished save (set aside, then removed).
    assert not [p for p in root.iterdir() if p.name.startswith("5.")]
    assert (root / "6.orbax-checkpoint-tmp" / "state" / "blob").read_bytes() == b"half"
    assert ckpt.save(6, state, meta=META)
    ckpt.wait()
    assert not [p for p in root.iterdir() if p.name.startswith("6.")]
    assert ckpt.save(7, state, meta=META)
    ckpt.wait()
    assert ckpt.all_steps() == [7]
    restored, _ = ckpt.restore(7, _abstract(state))
  _assert_bit_exact(restored, state)
  names = sorted(p.name for p in root.iterdir())
  assert names == ["7"]  # retention works; leftovers older than 7 are gone; 7 was replaced


def test_a_file_named_like_a_step_is_named_at_start_and_moved_aside_by_that_steps_save(
  tmp_path, caplog
):
  """`checkpoints/4` a file, not a folder: the run resumed from 3 without a word and, at step
  4's save, stopped with a NotADirectoryError traceback. Now it is named at start-up and moved
  aside, kept, when step 4 is saved."""
  state = _saved(tmp_path, (3,), max_to_keep=5)
  root = tmp_path / "checkpoints"
  (root / "4").write_text("mine")
  with caplog.at_level("WARNING"), checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.all_steps() == [3] and [p.name for p in ckpt.step_files()] == ["4"]
    assert ckpt.save(4, state, meta=META)
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]
  assert any("files named like steps" in r.getMessage() and "4" in r.getMessage()
             for r in caplog.records)  # fmt: skip
  aside = [p for p in root.iterdir() if p.name.startswith("4.uncommitted-")]
  assert len(aside) == 1 and aside[0].read_text() == "mine"


def _byte_files(step_dir):
  """The files of a step's array data, largest first."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  return sorted(files, key=lambda p: -p.stat().st_size)


def _flip_byte(path, offset=None):
  data = bytearray(path.read_bytes())
  i = len(data) // 2 if offset is None else offset
  data[i] ^= 0xFF
  path.write_bytes(bytes(data))


CORRUPTIONS = {
  "flipped-array-byte": lambda d: _flip_byte(_byte_files(d)[0]),
  "truncated-array-file": lambda d: _byte_files(d)[0].write_bytes(b""),
  "emptied-ocdbt-manifest": lambda d: next((d / "state").rglob("manifest.ocdbt")).write_bytes(b""),
  "garbage-metadata": lambda d: (d / "state" / "_METADATA").write_bytes(b"{not json"),
  "meta-deleted": lambda d: __import__("shutil").rmtree(d / "meta"),
  "checksums-garbage": lambda d: (d / "checksums.json").write_text("]["),
  # valid JSON of another shape (a TypeError traceback out of the resume, exit 1)
  "checksums-files-null": lambda d: (d / "checksums.json").write_text('{"files": null}'),
  "checksums-entry-short": lambda d: (d / "checksums.json").write_text(
    '{"files": {"meta/metadata": [96]}}'
  ),
}


def _three_steps(tmp_path):
  states = {s: _state(steps=s) for s in (2, 4, 6)}
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    for s, st in states.items():
      ckpt.save(s, st, meta=META)
  return states


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS))
def test_a_corrupted_latest_step_falls_back_to_the_newest_that_verifies(tmp_path, corrupt):
  states = _three_steps(tmp_path)
  root = tmp_path / "checkpoints"
  assert all((root / str(s) / "checksums.json").exists() for s in states)
  CORRUPTIONS[corrupt](root / "6")
  before = sorted(str(p.relative_to(root / "6")) for p in (root / "6").rglob("*"))
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    step, restored, meta = ckpt.restore_latest(
      _abstract(states[4]), expect=checkpoint.MetaCheck(META)
    )
    assert step == 4 and ckpt.all_steps() == [2, 4]
    _assert_bit_exact(restored, states[4])
    assert meta["task"] == "addition"
    # The run goes on: step 6 is saved again next to the bad copy.
    assert ckpt.save(6, states[6], meta=META)
  (aside,) = [p for p in root.iterdir() if p.name.startswith("6.corrupt-")]
  assert sorted(str(p.relative_to(aside)) for p in aside.rglob("*")) == before  # kept whole
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    assert ckpt.restore_latest(_abstract(states[6]))[0] == 6


def test_a_step_without_checksums_that_fails_to_load_falls_back_too(tmp_path):
  """A kill between commit and checksums leaves a step unverifiable: loading is the check."""
  states = _three_steps(tmp_path)
  step_dir = tmp_path / "checkpoints" / "6"
  (step_dir / "checksums.json").unlink()
  next((step_dir / "state").rglob("manifest.ocdbt")).write_bytes(b"")
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    step, restored, _ = ckpt.restore_latest(_abstract(states[4]))
  assert step == 4
  _assert_bit_exact(restored, states[4])


@pytest.mark.parametrize("manifest", ["deleted", "emptied"])
def test_a_step_whose_checksums_were_removed_is_unverified_and_an_older_one_loads(
  tmp_path, manifest
):
  """Delete (or empty) the newest step's checksums and flip a bit of it: the older step that
  verifies loads, bit-exactly; the unverifiable one is set aside, kept."""
  states = _three_steps(tmp_path)
  root = tmp_path / "checkpoints"
  if manifest == "deleted":
    (root / "6" / "checksums.json").unlink()
  else:
    (root / "6" / "checksums.json").write_text('{"format": "crc32", "files": {}}')
  _flip_byte(_byte_files(root / "6")[0])
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    step, restored, _ = ckpt.restore_latest(_abstract(states[4]))
  assert step == 4
  _assert_bit_exact(restored, states[4])
  label = "unverified" if manifest == "deleted" else "corrupt"
  assert [p.name for p in root.iterdir() if p.name.startswith(f"6.{label}-")], list(root.iterdir())


def test_a_leftover_of_the_last_steps_interrupted_save_goes_once_that_step_commits(tmp_path):
  """A kill during the final step's save leaves its temporary folder; the relaunch saves that
  step again and the leftover (set aside as `<step>.partial-*`) is removed, not kept forever."""
  state = _saved(tmp_path, (2,), max_to_keep=3)
  root = tmp_path / "checkpoints"
  (root / "4.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  (root / "4.orbax-checkpoint-tmp" / "state" / "blob").write_bytes(b"half")
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    assert ckpt.save(4, state, meta=META, force=True)
    ckpt.wait()
  assert sorted(p.name for p in root.iterdir()) == ["2", "4"]


def test_a_committed_step_carries_its_checksums_before_anything_else_runs(tmp_path, caplog):
  """The checksums are part of the commit (one process): a run killed right after a save
  commits, before the next save or `wait`, leaves a step that verifies; one without them (an
  older layout, several processes) loads with a warning naming it."""
  states = {2: _state(steps=2)}
  ckpt = checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3)
  assert ckpt.save(2, states[2], meta=META)
  ckpt._manager.wait_until_finished()  # committed; nothing of ours has run since the save
  step_dir = tmp_path / "checkpoints" / "2"
  assert (step_dir / "commit_success.txt").exists() and (step_dir / "checksums.json").exists()
  assert checkpoint_manifest.verify_manifest(step_dir) is None
  ckpt.close()
  (step_dir / "checksums.json").unlink()
  with caplog.at_level("WARNING"), checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.restore_latest(_abstract(states[2]))[0] == 2
  assert any("step 2" in r.getMessage() and "unverified" in r.getMessage() for r in caplog.records)


def test_when_no_step_verifies_the_restore_stops_and_moves_nothing(tmp_path):
  states = _three_steps(tmp_path)
  root = tmp_path / "checkpoints"
  for s in states:
    _flip_byte(_byte_files(root / str(s))[0])
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"step 6: .*step 4: .*step 2:"):
      ckpt.restore_latest(_abstract(states[6]))
    assert ckpt.all_steps() == [2, 4, 6]
  assert sorted(p.name for p in root.iterdir()) == ["2", "4", "6"]


def test_a_config_mismatch_is_not_taken_for_corruption(tmp_path):
  states = _three_steps(tmp_path)
  other = {**META, "model": {**META["model"], "num_layers": 3}}
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    with pytest.raises(checkpoint.CheckpointMismatchError, match="num_layers"):
      ckpt.restore_latest(_abstract(states[6]), expect=checkpoint.MetaCheck(other))
    assert ckpt.all_steps() == [2, 4, 6]


def test_meta_must_be_json(tmp_path):
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    with pytest.raises(TypeError, match="JSON"):
      ckpt.save(1, _state(), meta={"model": object()})


def test_a_step_half_deleted_by_retention_is_removed_once_superseded(tmp_path):
  """The process died while retention deleted step 2: `checkpoints/2/` holds only `state/`
  (its commit marker gone). It is not a checkpoint, and a newer committed step supersedes it:
  the next save's clean-up removes it; the committed steps are untouched."""
  state = _saved(tmp_path, (2, 4), max_to_keep=2)
  root = tmp_path / "checkpoints"
  for p in list((root / "2").iterdir()):  # what a killed rmtree leaves
    if p.name != "state":
      shutil.rmtree(p) if p.is_dir() else p.unlink()
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=2) as ckpt:
    assert ckpt.all_steps() == [4]
    assert ckpt.save(6, state, meta=META)
    ckpt.wait()
    assert not (root / "2").exists() and ckpt.all_steps() == [4, 6]
    _assert_bit_exact(ckpt.restore(4, _abstract(state))[0], state)


def test_a_sigterm_stop_line_waits_for_the_save_in_flight(tmp_path, monkeypatch):
  """SIGTERM during the first evaluation after a warm start: the line was built while
  checkpoint 0 was still being written (`0.orbax-checkpoint-tmp`), and said "no checkpoint was
  saved yet ... relaunch to start" beside "(checkpoint 0 holds the warm start)". The stop now
  waits for the save first; a warm start's own saved progress counts as saved too."""
  from jaxrl_llm import sigterm
  from jaxrl_llm.run import preempt

  monkeypatch.setitem(sigterm._TERM, "seen", True)
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.save(0, _state(typed_key=True), meta=META)
    with pytest.raises(preempt.Preempted) as e:
      preempt.stop_if_asked("during the first evaluation", str(tmp_path), 0, ckpt.wait)
  assert str(e.value) == (
    f"stopped by SIGTERM during the first evaluation: the checkpoints in {tmp_path} are kept; "
    "relaunch the same command to resume"
  )
  other = tmp_path / "other"
  (other / "checkpoints" / "1.orbax-checkpoint-tmp-5").mkdir(parents=True)  # not committed
  (other / "checkpoints" / "2").mkdir()  # renamed into place, never committed (no marker)
  assert preempt.none_saved(str(other))
  (other / "sft" / "checkpoints" / "3").mkdir(parents=True)  # the warm start's progress
  (other / "sft" / "checkpoints" / "3" / "commit_success.txt").touch()
  assert not preempt.none_saved(str(other))
