"""Study tools that were silently wrong (experiments/compare_tables.py, run_all.sh,
tools/sweep.py): each case runs the real script on real files, as a user would."""

from __future__ import annotations

import json
import pathlib
import sys
import time

import pytest
from conftest import run_in_session

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"


# compare_tables.py

_HEAD = "| objective.clip_high | sampling.temperature | seeds | acc |\n|---|---|---|---|\n"
_TWO_ARMS = (
  _HEAD + "| 0.2 | 0.7 | 3 | 0.500 [0.400, 0.600] |\n| 0.28 | 0.7 | 3 | 0.500 [0.400, 0.600] |\n"
)
_THREE_ARMS = (
  _HEAD + "| 0.2 | 0.7 | 3 | 0.510 [0.400, 0.600] |\n| 0.2 | 1.0 | 3 | 0.500 [0.400, 0.600] |\n"
  "| 0.28 | 0.7 | 3 | 0.900 [0.800, 1.000] |\n"
)


def _compare(tmp_path, committed: str, new: str):
  (tmp_path / "committed.md").write_text(committed)
  (tmp_path / "new.md").write_text(new)
  cmd = [sys.executable, str(EXPERIMENTS / "compare_tables.py"), "committed.md", "new.md"]
  return run_in_session(cmd, cwd=tmp_path)


def test_compare_tables_matches_the_shared_rows_of_a_table_that_gained_an_arm(tmp_path):
  """Each file's row label was as wide as its own rows needed (1 cell for two arms, 2 for
  three), so no row matched: "0/0 means within", every committed cell "missing", and the 0.28
  arm's move from 0.5 to 0.9 was never said. Rows are now named by the grouped columns in both
  files; the shared rows are compared, the new arm is reported as added."""
  proc = _compare(tmp_path, _TWO_ARMS, _THREE_ARMS)
  lines = proc.stdout.strip().splitlines()
  assert proc.returncode == 1, proc
  assert any("'0.28 | 0.7'" in x and "0.900" in x for x in lines), lines
  assert "added: table 0, row '0.2 | 1.0' (in the new file only)" in lines
  assert not any(x.startswith("missing") for x in lines), lines
  assert lines[-1].startswith("1/2 means within") and "1 rows added" in lines[-1], lines


def test_compare_tables_reports_a_committed_row_the_new_table_lost(tmp_path):
  """A new table that lost an arm reported every committed cell missing (the rows it kept
  too). Now the rows it kept are compared and the lost one is `removed:` (exit 1)."""
  proc = _compare(
    tmp_path, _THREE_ARMS, _THREE_ARMS.replace("| 0.2 | 1.0 | 3 | 0.500 [0.400, 0.600] |\n", "")
  )
  lines = proc.stdout.strip().splitlines()
  assert proc.returncode == 1, proc
  assert lines[:-1] == ["removed: table 0, row '0.2 | 1.0' (in the committed file only)"], lines
  assert lines[-1].startswith("2/2 means within") and "1 committed rows removed" in lines[-1]


def test_compare_tables_passes_a_table_that_only_gained_an_arm(tmp_path):
  """An added arm with every shared mean within tolerance is no fault (exit 0)."""
  proc = _compare(
    tmp_path, _TWO_ARMS, _THREE_ARMS.replace("0.900 [0.800, 1.000]", "0.520 [0.4, 0.6]")
  )
  assert proc.returncode == 0, proc
  assert proc.stdout.strip().splitlines()[-1].endswith("; 1 rows added"), proc.stdout


# run_all.sh


def _studies(tmp_path, bodies: dict[str, str]):
  """experiments/ under tmp_path: run_all.sh, study_env.sh and compare_tables.py beside fake
  studies (name -> run.sh body); tmp_path stands for the repository root."""
  root = tmp_path / "experiments"
  root.mkdir()
  for script in ("run_all.sh", "study_env.sh", "compare_tables.py"):
    (root / script).write_bytes((EXPERIMENTS / script).read_bytes())
  for name, body in bodies.items():
    (root / name).mkdir()
    (root / name / "run.sh").write_text(f"#!/usr/bin/env bash\nset -euo pipefail\n{body}\n")
  return root


@pytest.mark.parametrize("printed", ["", "warning only\n"], ids=["nothing", "prose"])
def test_run_all_keeps_the_committed_tables_when_a_study_prints_no_table(tmp_path, printed):
  """A study that exited 0 without a table had its empty output moved over the committed
  tables.md, "done", exit 0 (compare_tables.py's exit 2 was ignored). Now the study is FAILED
  with a line saying why, tables.md is kept and the output stays in tables.md.new."""
  root = _studies(tmp_path, {"fake": f"printf {printed!r}", "good": "printf '| a |\\n'"})
  committed = "| a | seeds | acc |\n|---|---|---|\n| 0.2 | 8 | 0.500 [0.400, 0.600] |\n"
  (root / "fake" / "tables.md").write_text(committed)
  env = {"ROOT_BASE": str(tmp_path / "out")}
  proc = run_in_session(["bash", str(root / "run_all.sh")], env=env)
  assert proc.returncode == 1, proc
  line = next(x for x in proc.stdout.splitlines() if "FAILED" in x)
  assert "no Markdown table" in line and "fake/tables.md is kept as it was" in line, line
  assert "fake/tables.md.new" in line and "done" not in proc.stdout.split("== good")[0]
  assert (root / "fake" / "tables.md").read_text() == committed
  assert (root / "fake" / "tables.md.new").read_text() == printed
  assert (root / "good" / "tables.md").read_text() == "| a |\n"  # the next study still ran
  assert proc.stderr.strip() == "failed: fake", proc.stderr


def test_run_all_keeps_the_committed_tables_when_they_cannot_be_compared(tmp_path):
  """A header with no rows is no table to compare_tables.py (exit 2): the study fails with its
  line, and neither file is lost."""
  root = _studies(tmp_path, {"fake": "printf '| a | acc |\\n'"})
  committed = "| a | seeds | acc |\n|---|---|---|\n| 0.2 | 8 | 0.500 [0.400, 0.600] |\n"
  (root / "fake" / "tables.md").write_text(committed)
  proc = run_in_session(
    ["bash", str(root / "run_all.sh")], env={"ROOT_BASE": str(tmp_path / "out")}
  )
  assert proc.returncode == 1, proc
  assert "FAILED (exit 0, but " in proc.stdout and "tables.md.new: no Markdown table" in proc.stdout
  assert (root / "fake" / "tables.md").read_text() == committed
  assert (root / "fake" / "tables.md.new").read_text() == "| a | acc |\n"


def test_run_all_reads_a_relative_root_base_from_the_callers_directory(tmp_path):
  """ROOT_BASE=relout: the study (study_env.sh cds to the repository) wrote its runs under
  <repo>/relout, while run_all.sh (which cds to experiments/) wrote the log to
  experiments/relout.<study>.log and printed a log path found from neither. Now both lie under
  the caller's directory and the printed path is that log."""
  body = (
    'source "$(dirname "$0")/../study_env.sh"\nmkdir -p "$ROOT"; echo hello > "$ROOT/out.txt"\n'
    "echo 'study log line' >&2; exit 1"
  )
  root = _studies(tmp_path, {"fakec": body})
  caller = tmp_path / "caller"
  caller.mkdir()
  proc = run_in_session(["bash", str(root / "run_all.sh")], env={"ROOT_BASE": "relout"}, cwd=caller)
  assert proc.returncode == 1, proc
  assert (caller / "relout" / "fakec" / "out.txt").read_text() == "hello\n"
  log = caller / "relout.fakec.log"
  assert "study log line" in log.read_text()
  assert f"log: {log})" in proc.stdout, proc.stdout
  assert not (tmp_path / "relout").exists() and not (root / "relout").exists()
  assert not (root / "relout.fakec.log").exists()


def test_a_study_reads_a_relative_root_from_the_callers_directory(tmp_path):
  """`ROOT=relout bash experiments/<study>/run.sh` wrote the study's runs under <repo>/relout
  (study_env.sh cds to the repository first), not where the caller stood."""
  body = 'source "$(dirname "$0")/../study_env.sh"\nmkdir -p "$ROOT"; echo "$PWD" > "$ROOT/at.txt"'
  root = _studies(tmp_path, {"fakec": body})
  caller = tmp_path / "caller"
  caller.mkdir()
  proc = run_in_session(
    ["bash", str(root / "fakec" / "run.sh")], env={"ROOT": "relout"}, cwd=caller
  )
  assert proc.returncode == 0, proc
  assert (caller / "relout" / "at.txt").read_text() == f"{tmp_path}\n"  # it ran at the repo
  assert not (tmp_path / "relout").exists()


# tools/sweep.py

sys.path.insert(0, str(REPO / "tools"))
import sweep  # noqa: E402


def test_sweep_progress_shows_only_the_latest_launchs_lines(tmp_path, capsys):
  """A resumed run's run.log (appended across launches) still ends with the earlier launch's
  last line, "step 4/4 100% ... ETA 0:00:00", which the sweep showed as the resumed run's
  progress while it compiled: it looked finished. Only lines after the newest launch header
  count now."""
  workdir = tmp_path / "a"
  workdir.mkdir()
  stale = "step 4/4 100% 5.88 steps/s ETA 0:00:00 | reward 0 acc 0"
  (workdir / "run.log").write_text(f"\n### 2024-01-01 00:00:00 python -m jaxrl_llm.main\n{stale}\n")
  code = "import time; print('compiling the step', flush=True); time.sleep(60)"
  argv = [sys.executable, "-c", code, "--config=x"]
  run = sweep.Run(name="a", workdir=str(workdir), params={}, overrides={}, argv=argv, final_step=6)
  runner = sweep.Sweep([run], str(tmp_path), spec={}, progress_s=0)
  runner._launch(0, run)
  try:
    runner._progress(run, 0.0)  # before the new launch logs anything: nothing to show
    for _ in range(200):
      if (workdir / "run.log").read_text().endswith("compiling the step\n"):
        break
      time.sleep(0.05)
    runner._progress(run, 0.0)
  finally:
    for _, proc, log, _ in runner._running:
      proc.kill()
      proc.wait()
      log.close()
  out = capsys.readouterr().out
  assert "step 4/4" not in out, out
  assert "[1/1] compiling the step - a" in out, out


def _sweep_cli(*args):
  cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), *args]
  return run_in_session(
    cmd, env={"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=120
  )


@pytest.mark.parametrize("where", ["run.json", "sweep.json"])
def test_sweep_refuses_a_point_that_respells_a_run_already_in_root(tmp_path, where):
  """Relaunched with `sampling.temperature=0.70,1` into a root holding the runs `=0.7` and
  `=1.0`, the sweep planned both as new (folder names come from the spelling) and trained each
  again from step 0 beside its twin: seed tables then refused the study and plots averaged the
  duplicates. Now one `error:` line names the run already there; nothing is written."""
  config = str(REPO / "configs" / "default.py")
  root = tmp_path / "my sweep"
  runs = []
  for value in ("0.7", "1.0"):
    name = f"sampling.temperature={value}"
    overrides = {"sampling.temperature": value}
    argv = [
      sys.executable,
      "-m",
      "jaxrl_llm.main",
      f"--config={config}",
      f"--workdir={root / name}",
    ]
    runs.append({"name": name, "argv": argv, "overrides": overrides, "status": "done"})
    if where == "run.json":
      (root / name).mkdir(parents=True)
      (root / name / "run.json").write_text(
        json.dumps({"config": config, "overrides": overrides, "command": "python ..."})
      )
  if where == "sweep.json":
    root.mkdir()
    (root / "sweep.json").write_text(json.dumps({"runs": runs[1:], "earlier_runs": runs[:1]}))
  before = sorted(p.relative_to(root) for p in root.rglob("*"))
  grid, twin = ("0.70,0.8", "0.7") if where == "run.json" else ("0.8,1", "1.0")
  proc = _sweep_cli(
    f"--config={config}", f"--root={root}", f"--grid=sampling.temperature={grid}", "--dry_run"
  )
  err = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), proc
  assert f"{root / f'sampling.temperature={twin}'} already in --root" in err[0], err
  proc = _sweep_cli(
    f"--config={config}", f"--root={root}", "--grid=sampling.temperature=0.7,1.0,0.8", "--dry_run"
  )
  assert proc.returncode == 0, proc  # the runs' own spelling resumes them, as before
  assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


@pytest.mark.parametrize("extra", [["--dry_run"], ["--packed"]], ids=["runs", "packed"])
def test_sweep_refuses_a_root_that_is_a_single_runs_workdir(tmp_path, extra):
  """--root at a single run's workdir was said to hold "a pack's checkpoints ... pass --packed";
  doing so wrote sweep.json and run.json records into that run's folder, failed at restore
  (exit 1) and left records that refused every corrected command. Its checkpoint's meta names
  no pack: the sweep now says the root is a single run's workdir, in one line, and writes
  nothing."""
  root = tmp_path / "one run"
  step = root / "checkpoints" / "40"
  (step / "meta").mkdir(parents=True)
  (step / "commit_success.txt").write_text("")
  (step / "meta" / "metadata").write_text(json.dumps({"model": {"d_model": 32}, "step": 40}))
  (root / "run.log").write_text("the run's log\n")
  before = sorted(p.relative_to(root) for p in root.rglob("*"))
  config = f"--config={REPO / 'configs' / 'default.py'}"
  proc = _sweep_cli(config, f"--root={root}", "--grid=objective.clip_high=0.2,0.28", *extra)
  err = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(err) == 1, proc
  assert err[0].startswith(f"error: --root={root} is a single run's workdir"), err
  assert "give another --root" in err[0] and "--packed" not in err[0], err
  assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
