"""A `gs://` workdir end to end, against a local Cloud Storage emulator (tests/gcs_emulator.py):
the path helpers, the checkpointer's checksums and renames, and a real training run that writes
events, config.json and checkpoints to the bucket, resumes from them and reads its tags back."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from gcs_emulator import GcsEmulator
from parsed import train_and_evaluate

from jaxrl_llm import checkpoint, checkpoint_manifest, metrics, paths

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")


@pytest.fixture(scope="module")
def gcs():
  """An emulated bucket `gs://bucket/` for the tests of this module."""
  with GcsEmulator("bucket") as emulator:
    yield emulator


@pytest.fixture
def in_tmp_cwd(tmp_path):
  """Runs the test in an empty current directory (where a folder made from a URL would land)."""
  before = os.getcwd()
  os.chdir(tmp_path)
  try:
    yield tmp_path
  finally:
    os.chdir(before)


def test_urls_map_to_paths_and_unknown_schemes_are_refused(tmp_path):
  assert paths.is_remote("gs://bucket/run") and not paths.is_remote(tmp_path)
  assert os.fspath(paths.as_path("gs://bucket/run")) == "gs://bucket/run"
  assert paths.join("gs://bucket/run", "sft") == "gs://bucket/run/sft"
  assert os.fspath(paths.as_path(f"file://{tmp_path}")) == str(tmp_path)
  with pytest.raises(ValueError, match="unsupported URL 'memory://x'"):
    paths.as_path("memory://x")


def test_path_helpers_on_a_bucket(gcs, in_tmp_cwd):
  root = gcs.url("helpers")
  paths.makedirs(root)  # nothing to create on an object store
  assert not paths.exists(root) and paths.listdir(root) == []
  paths.write_text(paths.join(root, "a", "x.json"), '{"x": 1}')
  paths.write_text(paths.join(root, "a", "sub", "y.txt"), "y")
  assert json.loads(paths.read_text(paths.join(root, "a", "x.json"))) == {"x": 1}
  assert paths.is_dir(paths.join(root, "a")) and paths.exists(root)
  assert [os.fspath(p) for p in paths.files_under(root)] == [
    f"{root}/a/sub/y.txt",
    f"{root}/a/x.json",
  ]
  paths.rename(paths.join(root, "a"), paths.join(root, "b"))
  assert [p.name for p in paths.listdir(root)] == ["b"]
  assert paths.read_text(paths.join(root, "b", "sub", "y.txt")) == "y"
  paths.write_text(paths.join(root, "c"), "c")
  with pytest.raises(FileExistsError):
    paths.rename(paths.join(root, "b"), paths.join(root, "c"))

  # Appends reach the object whole (gcsfs has no append mode: "a" overwrites).
  log = paths.AppendFile(paths.join(root, "log.bin"))
  log.write(b"one,")
  log.flush()
  log.write(b"two")
  log.close()
  assert paths.as_path(paths.join(root, "log.bin")).read_bytes() == b"one,two"

  paths.remove_tree(paths.join(root, "b"))
  assert not paths.exists(paths.join(root, "b")) and paths.exists(paths.join(root, "c"))
  assert os.listdir(in_tmp_cwd) == []  # no local folder named after the URL


def test_event_files_in_a_bucket_are_rewritten_whole_and_roll_over(gcs, in_tmp_cwd):
  logdir = gcs.url("events")
  with metrics.SummaryWriter(logdir, flush_secs=0, rollover_bytes=600) as writer:
    for step in range(1, 7):
      writer.scalars(step, {"a": step, "b": -step})
      writer.text(step, "notes", f"step {step} " + "x" * 100)
    # Flushed events are readable while the writer is open.
    assert metrics.read_scalars(logdir)["a"] == [(s, float(s)) for s in range(1, 7)]
  files = [p.name for p in paths.listdir(logdir)]
  assert len(files) > 1 and all(n.startswith("events.out.tfevents.") for n in files)
  assert metrics.read_scalars(logdir)["b"] == [(s, -float(s)) for s in range(1, 7)]
  notes = metrics.read_text(logdir)["notes"]  # the TEXT metadata is in every file
  assert [s for s, _ in notes] == list(range(1, 7)) and notes[-1][1].startswith("step 6 ")
  assert os.listdir(in_tmp_cwd) == []


def _state(seed: int):
  return {"w": jnp.arange(6.0).reshape(2, 3) + seed, "step": jnp.int32(seed)}


def test_checkpoints_on_a_bucket_verify_and_move_bad_steps_aside(gcs, in_tmp_cwd):
  workdir = gcs.url("ckpt")
  root = paths.as_path(workdir) / "checkpoints"
  with checkpoint.Checkpointer(workdir, save_every=1, max_to_keep=3) as ckpt:
    for s in (2, 4, 6):
      assert ckpt.save(s, _state(s), meta={"model": {"d": 1}})
  assert all(paths.exists(root / str(s) / "checksums.json") for s in (2, 4, 6))
  assert checkpoint_manifest.verify_manifest(root / "6") is None

  # Step 6's largest array file changes under its checksums; a crash left step 7 uncommitted.
  blob = max(paths.files_under(root / "6" / "state"), key=paths.size)
  data = bytearray(blob.read_bytes())
  data[len(data) // 2] ^= 0xFF
  blob.write_bytes(bytes(data))
  paths.write_text(root / "7" / "state" / "half", "half")

  abstract = {"w": jnp.zeros((2, 3)), "step": jnp.int32(0)}
  with checkpoint.Checkpointer(workdir, save_every=1, max_to_keep=3) as ckpt:
    assert [p.name for p in ckpt.uncommitted_dirs()] == ["7"]
    step, restored, meta = ckpt.restore_latest(abstract)
    assert step == 4 and meta == {"model": {"d": 1}} and ckpt.all_steps() == [2, 4]
    np.testing.assert_array_equal(restored["w"], _state(4)["w"])
    assert ckpt.save(7, _state(7), meta={"model": {"d": 1}})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4, 7]
  names = [p.name for p in paths.listdir(root)]
  # Step 7's unfinished save was set aside while 7 was saved again, then removed once 7
  # committed (it superseded it); the corrupt step 6 is kept.
  assert len(names) == 4 and names[:2] == ["2", "4"] and names[3] == "7"
  assert names[2].startswith("6.corrupt-")
  assert os.listdir(in_tmp_cwd) == []


@pytest.mark.slow
def test_a_run_in_a_bucket_writes_events_config_and_checkpoints_and_resumes(gcs, in_tmp_cwd):
  workdir = gcs.url("run")
  config = tiny_config(**{"train.checkpoint_every": 2, "train.stop_after_steps": 2})
  train_and_evaluate(config, workdir)  # steps 1-2 of 4
  with checkpoint.Checkpointer(workdir, save_every=2) as ckpt:
    assert ckpt.all_steps() == [2]
  record = json.loads(paths.read_text(paths.join(workdir, "config.json")))
  assert record["config"]["train"]["num_steps"] == 4 and record["step"] == 0
  assert max(s for s, _ in metrics.read_scalars(workdir)["rollout/reward_mean"]) == 2

  result = train_and_evaluate(config, workdir)  # resumes at step 2: steps 3-4
  with checkpoint.Checkpointer(workdir, save_every=2) as ckpt:
    assert ckpt.all_steps() == [2, 4]
    assert all(checkpoint_manifest.verify_manifest(ckpt.directory / str(s)) is None for s in (2, 4))
  names = {p.name for p in paths.listdir(workdir)}
  events = {n for n in names if n.startswith("events.out.tfevents.")}
  assert names - events == {"checkpoints", "config.json"} and len(events) == 2  # one per launch

  scalars = metrics.read_scalars(workdir)
  assert [s for s, _ in scalars["rollout/reward_mean"]] == [1, 2, 3, 4]
  assert [s for s, _ in scalars["eval/accuracy"]] == [0, 2, 4]
  assert result["eval/accuracy"] == scalars["eval/accuracy"][-1][1]
  tags = metrics.read_tags(workdir)
  assert {"samples", "config"} <= set(tags["plugins"]["text"])
  assert "reward" in tags["plugins"]["histograms"]

  # Relaunched when finished: its last evaluation, read back from the bucket; nothing written.
  again = train_and_evaluate(config, workdir)
  assert again["eval/accuracy"] == result["eval/accuracy"]
  assert {p.name for p in paths.listdir(workdir)} == names
  assert os.listdir(in_tmp_cwd) == []  # nothing local named after the URL
