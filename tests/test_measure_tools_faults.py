"""The measuring tools (tools/trace_summary.py, soak.py, device_check.py, same_behaviour.py)
and get_smollm2.py refuse a bad command line or trace with one `error:` line on stderr, exit status 2 and nothing on stdout, before any
run or check starts. These were argparse's usage block, tracebacks (a trace file that is not
gzip, cut short or not a trace; `soak.py --interval_s=-1` after the trainer had started), values
taken without a word (`--top=-3` listed all kernels but the last three, `soak.py --steps=0`
started a trainer that was refused) or an output path found bad only after every device check
had run (`device_check.py --json=DIR`), or by a run that failed minutes in (same_behaviour's
`--config` missing from a tree, `--set=foo`)."""

from __future__ import annotations

import gzip
import json
import os
import sys

import pytest
from conftest import REPO, refused

sys.path.insert(0, str(REPO / "tools"))
import device_check
import get_smollm2
import same_behaviour
import soak
import trace_summary


def _trace(path, raw: bytes) -> None:
  """A file named as jax.profiler names its perfetto trace, holding `raw`."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(raw)


@pytest.mark.parametrize("top", ["0", "-3", "x"])
def test_trace_summary_refuses_a_top_that_is_not_a_count(tmp_path, capsys, top):
  refused(capsys, trace_summary.main, [str(tmp_path), f"--top={top}"], f"'{top}': want a whole")


def test_trace_summary_names_a_missing_folder_as_missing(tmp_path, capsys):
  """A mistyped folder was "no perfetto_trace.json.gz under" it, as if it were there."""
  refused(capsys, trace_summary.main, [str(tmp_path / "typo")], "typo: no such directory; give")


def _gz(data: bytes) -> bytes:
  return gzip.compress(data, mtime=0)  # the same bytes at every collection (xdist compares ids)


@pytest.mark.parametrize(
  "raw, says",
  [
    (b"not gzip", "not a readable gzipped JSON trace (BadGzipFile"),
    (_gz(b'{"traceEvents": [')[:12], "not a readable gzipped JSON trace (EOFError"),
    (_gz(b'{"traceEvents": ['), "not a readable gzipped JSON trace (JSONDecodeError"),
    (_gz(b'{"a": 1}'), "not a trace: want a JSON list of events"),
    (_gz(b"[1, 2]"), "not a trace: want a JSON list of events"),
  ],
  ids=["not-gzip", "cut-short", "not-json", "an-object", "not-events"],
)
def test_trace_summary_names_a_trace_file_it_cannot_read(tmp_path, capsys, raw, says):
  path = tmp_path / "plugins" / "profile" / "run" / "host.perfetto_trace.json.gz"
  _trace(path, raw)
  err = refused(capsys, trace_summary.main, [str(tmp_path)], says)
  assert err.startswith(f"error: {path}: "), err


def test_trace_summary_still_reads_a_list_of_events(tmp_path, capsys):
  """The two forms a perfetto trace takes (a list, or an object with traceEvents) both read."""
  events = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "X", "name": "gemm", "pid": 1, "ts": 0, "dur": 3000},
    {"ph": "X", "name": "gemm", "pid": 1, "ts": 5000, "dur": 1000},
  ]
  path = tmp_path / "a.perfetto_trace.json.gz"
  for form in (events, {"traceEvents": events}):
    _trace(path, gzip.compress(json.dumps(form).encode()))
    assert trace_summary.main([str(tmp_path), "--top=1"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["busy_ms"] == 4.0 and got["span_ms"] == 6.0
    assert got["top"] == [{"kernel": "gemm", "ms": 4.0, "count": 2, "share": 1.0}]


def test_trace_summary_says_when_no_process_matches_the_device(tmp_path, capsys):
  """A CPU run's trace read with the default --device=GPU printed an empty `top` and exit 0
  with no word: a note names the processes there are."""
  events = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
    {"ph": "X", "name": "dot", "pid": 1, "ts": 0, "dur": 3000},
  ]
  _trace(tmp_path / "a.perfetto_trace.json.gz", gzip.compress(json.dumps(events).encode()))
  assert trace_summary.main([str(tmp_path)]) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)["top"] == []
  assert err.startswith("note: no process named like --device=GPU in ") and "/host:CPU" in err
  assert trace_summary.main([str(tmp_path), "--device=CPU"]) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)["top"][0]["kernel"] == "dot" and err == ""


@pytest.mark.parametrize(
  "argv, says",
  [
    (["--steps=0"], "argument --steps: '0': want a whole number >= 1"),
    (["--interval_s=-1"], "argument --interval_s: '-1': want a finite number > 0"),
    (["--interval_s=nan"], "argument --interval_s: 'nan': want a finite number > 0"),
    (["--interval_s=0"], "argument --interval_s: '0': want a finite number > 0"),
    (["--stpes=3"], "unrecognized arguments: --stpes=3"),
  ],
)
def test_soak_refuses_a_bad_flag_before_starting_the_trainer(tmp_path, capsys, argv, says):
  workdir = tmp_path / "run"
  refused(capsys, soak.main, [*argv, f"--workdir={workdir}", "--", "--config.sft.steps=0"], says)
  assert not workdir.exists()


def test_soak_refuses_a_workdir_that_cannot_be_made(tmp_path, capsys):
  (tmp_path / "file").write_text("kept")
  workdir = tmp_path / "file" / "run"
  refused(capsys, soak.main, [f"--workdir={workdir}"], "a file, not a directory")
  assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_device_check_refuses_a_read_only_json_before_the_checks(tmp_path, capsys):
  folder = tmp_path / "ro"
  folder.mkdir()
  (folder / "checks.json").write_text("earlier")
  folder.chmod(0o555)
  try:
    refused(capsys, device_check.main, [f"--json={folder / 'checks.json'}"], "read-only")
  finally:
    folder.chmod(0o755)
  assert (folder / "checks.json").read_text() == "earlier"


@pytest.mark.parametrize(
  "where, says",
  [
    ("dir", "is a directory; give a file path"),
    ("gs://bucket/checks.json", "is a URL; give a local file path"),
    ("file/checks.json", "a file, not a directory"),
  ],
)
def test_device_check_refuses_a_json_path_before_the_checks(tmp_path, capsys, where, says):
  """These failed only after every check had run (minutes on a GPU), with a traceback."""
  (tmp_path / "dir").mkdir()
  (tmp_path / "file").write_text("kept")
  path = where if "://" in where else str(tmp_path / where)
  refused(capsys, device_check.main, [f"--json={path}"], says)
  assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.parametrize(
  "argv, says",
  [
    (["--before=HEAD", "--steps=0"], "argument --steps: '0': want a whole number >= 1"),
    (["--before=HEAD", "--set=foo"], "--set=foo: want section.field=value"),
    (["--before=HEAD", "--grid=seed="], "--grid=seed=: want section.field=value"),
    (["--steps=3"], "--before is required (unless --freeze_configs)"),
    (["--before=no-such-revision"], "--before=no-such-revision: neither a folder nor a git"),
    (["--before=HEAD", "--after=no-such-revision"], "--after=no-such-revision: neither"),
  ],
)
def test_same_behaviour_refuses_a_bad_command_line_before_training(capsys, argv, says):
  """--steps=0 trained nothing and compared nothing; --set=foo passed `--config.foo` to both
  trainers, each refusing it minutes apart; a bad revision exited 1, as a difference does."""
  refused(capsys, same_behaviour.main, argv, says, stdout="revision" in says or "neither" in says)


def test_same_behaviour_refuses_a_config_missing_from_a_tree_before_training(capsys):
  """A --config that one tree lacks was found by that tree's trainer run failing, after the
  other side's run had trained; now both trees are looked in before any run."""
  err = refused(
    capsys,
    same_behaviour.main,
    ["--before=HEAD", "--config=configs/nope.py"],
    "no such file",
    stdout=True,
  )
  assert err.startswith("error: --config=configs/nope.py: no such file in the before tree, HEAD")


def test_same_behaviour_refuses_a_freeze_path_it_cannot_write(tmp_path, capsys):
  (tmp_path / "file").write_text("kept")
  for path, says in ((tmp_path, "is a directory"), (tmp_path / "file" / "x.json", "a file, not")):
    refused(capsys, same_behaviour.main, [f"--freeze_configs={path}"], says)
  assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.parametrize(
  "argv, says",
  [
    (["--root={tmp}/file/x"], "--root={tmp}/file/x cannot be made: {tmp}/file is a file, not a"),
    (["--root={tmp}/file"], "--root={tmp}/file is a file, not a directory"),
    (["--root=gs://bucket/cache"], "--root=gs://bucket/cache is a URL; give a local folder"),
    (["--dtype=int8"], "argument --dtype: invalid choice: 'int8'"),
  ],
)
def test_get_smollm2_refuses_a_bad_root_or_flag_before_fetching(tmp_path, capsys, argv, says):
  """A root under a file was `[Errno 20] Not a directory` (no flag named) and a URL root made a
  local folder `gs:`; a bad flag was argparse's usage block. Nothing is fetched or written."""
  (tmp_path / "file").write_text("kept")
  argv = [a.format(tmp=tmp_path) for a in argv]
  code = get_smollm2.cli(argv)
  out, err = capsys.readouterr()
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
  assert err.startswith(f"error: {says.format(tmp=tmp_path)}"), err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
  assert (tmp_path / "file").read_text() == "kept" and not os.path.exists("gs:")
