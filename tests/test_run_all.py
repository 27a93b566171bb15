"""experiments/run_all.sh tells an interrupted study from a failed one."""

from __future__ import annotations

import pathlib
import shutil
import signal
import subprocess
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _studies(tmp_path, scripts: dict[str, str]) -> pathlib.Path:
  """A copy of run_all.sh beside fake studies (name -> run.sh body)."""
  shutil.copy(REPO / "experiments" / "run_all.sh", tmp_path / "run_all.sh")
  for name, body in scripts.items():
    (tmp_path / name).mkdir()
    (tmp_path / name / "run.sh").write_text(f"#!/usr/bin/env bash\n{body}\n")
  return tmp_path / "run_all.sh"


def test_a_study_stopped_by_sigterm_is_interrupted_and_the_rest_do_not_start(tmp_path):
  """SIGTERM to run_all.sh while a study runs: that study's whole process group stops, it is
  reported INTERRUPTED (not FAILED) with its committed tables kept, the next study does not
  start, and run_all.sh exits 130. A study that fails on its own is FAILED and the next runs."""
  started = tmp_path / "started"
  nap = f"sleep 120.{time.time_ns() % 10**9:09d}"  # this test's own: pgrep finds no other's
  script = _studies(
    tmp_path,
    {
      "a_fails": "echo broken >&2; exit 1",
      "b_slow": f"touch {started}; {nap} & wait",
      "c_later": "echo '| x |'",
    },
  )
  (tmp_path / "b_slow" / "tables.md").write_text("committed\n")
  env = {"PATH": "/usr/bin:/bin", "ROOT_BASE": str(tmp_path / "out")}
  proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
  deadline = time.time() + 60
  while not started.exists():
    assert time.time() < deadline and proc.poll() is None
    time.sleep(0.1)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 130, out
  assert "== a_fails\n   FAILED" in out
  assert "== b_slow\n   INTERRUPTED" in out and "FAILED" not in out.split("== b_slow")[1]
  assert "== c_later" not in out
  assert (tmp_path / "b_slow" / "tables.md").read_text() == "committed\n"
  assert not (tmp_path / "b_slow" / "tables.md.new").exists()
  sleeping = subprocess.run(["pgrep", "-f", nap], capture_output=True, text=True)
  assert not sleeping.stdout.strip(), "the study's own processes still run"


def test_studies_that_finish_write_their_tables(tmp_path):
  """Without a signal every study runs; a finished one's tables replace its tables.md."""
  script = _studies(tmp_path, {"a": "echo '| a |'", "b": "echo '| b |'"})
  env = {"PATH": "/usr/bin:/bin", "ROOT_BASE": str(tmp_path / "out")}
  proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert (tmp_path / "b" / "tables.md").read_text() == "| b |\n"
  assert "INTERRUPTED" not in proc.stdout and "FAILED" not in proc.stdout


def test_a_study_killed_by_sigkill_is_failed_and_the_rest_still_run(tmp_path):
  """A study killed by SIGKILL (exit 137, e.g. the out-of-memory killer) is no interruption: it
  is reported FAILED with its exit status, its committed tables kept, the next study still runs
  and writes its tables, and run_all.sh exits 1 (a failed study), not 130."""
  script = _studies(tmp_path, {"a_oom": "kill -KILL $$", "b_next": "echo '| b |'"})
  (tmp_path / "a_oom" / "tables.md").write_text("committed\n")
  env = {"PATH": "/usr/bin:/bin", "ROOT_BASE": str(tmp_path / "out")}
  proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "== a_oom\n   FAILED (exit 137: killed by SIGKILL; log: " in proc.stdout
  assert "INTERRUPTED" not in proc.stdout and "interrupted" not in proc.stderr
  assert "== b_next\n   done in" in proc.stdout
  assert (tmp_path / "b_next" / "tables.md").read_text() == "| b |\n"
  assert (tmp_path / "a_oom" / "tables.md").read_text() == "committed\n"
  assert not (tmp_path / "a_oom" / "tables.md.new").exists()
  assert proc.stderr.strip().splitlines()[-1] == "failed: a_oom"
