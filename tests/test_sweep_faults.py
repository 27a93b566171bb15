"""tools/sweep.py given bad input: each is one `error:` line on stderr, exit status 2, no
traceback and nothing saved before lost; and no flag or value silently ignored or misread. Each
test failed before its fix (see its docstring)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, cli_env

sys.path.insert(0, str(REPO / "tools"))
import sweep

CONFIG = f"--config={REPO / 'configs' / 'default.py'}"
# Tiny settings, should a command refused here ever start a run.
TINY = "--set=train.num_steps=1,sft.steps=0,model.d_model=32,model.mlp_dim=64,model.num_layers=1"


def _main(capsys, *argv):
  """(exit status, stderr lines, stdout) of `sweep.main(argv)` in this process."""
  code = sweep.main(list(argv))
  out = capsys.readouterr()
  return code, out.err.strip().splitlines(), out.out


def _cli(*argv):
  """(exit status, stderr lines) of `python tools/sweep.py argv`, as a user runs it."""
  cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), *argv]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  return proc.returncode, proc.stderr.strip().splitlines()


def _commit(workdir, step):
  """A checkpoint at `step` in `workdir` as the sweep reads it: orbax's commit marker."""
  d = workdir / "checkpoints" / str(step)
  d.mkdir(parents=True)
  (d / "commit_success.txt").write_text("")


def test_a_bad_flag_is_one_error_line_not_the_usage(tmp_path, capsys):
  """A missing --root, a non-number --parallel or a mistyped flag (--grids): argparse printed
  the 4-line usage and `sweep.py: error: ...` (not starting `error:`) and raised SystemExit."""
  root = f"--root={tmp_path / 's'}"
  cases = {
    (CONFIG,): "error: the following arguments are required: --root",
    (CONFIG, root, "--parallel=abc"): "error: argument --parallel: invalid int value: 'abc'",
    (CONFIG, root, "--grids=seed=0,1"): "error: unrecognized arguments: --grids=seed=0,1",
  }
  for argv, said in cases.items():
    code, err, out = _main(capsys, *argv)
    assert code == 2 and len(err) == 1 and err[0].startswith(said), err
    assert out == ""
  assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("field", ["train.stop_after_steps", "train.profile_steps"])
def test_a_grid_over_a_field_that_only_paces_an_invocation_is_refused(tmp_path, capsys, field):
  """--grid=train.stop_after_steps=5,10 planned two runs that learn alike (the field ends an
  invocation); a plot then read them as one arm with its seed twice."""
  root = tmp_path / "s"
  code, err, out = _main(capsys, CONFIG, f"--root={root}", f"--grid={field}=5,10", "--dry_run")
  assert (code, err, out) == (
    2,
    [
      f"error: --grid={field}=...: {field} only ends or paces an invocation, and the runs would "
      "learn alike; give it with --set (one value for every run)"
    ],
    "",
  )
  assert not root.exists()


def test_an_empty_or_remote_root_is_refused_not_read_as_another_folder(tmp_path, capsys):
  """--root= (empty) planned the runs in the current directory, and --root=gs://b/x in the
  local folder ./gs:/b/x (the sweep writes its logs and sweep.json with local file calls)."""
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:
    code, err, out = _main(capsys, CONFIG, "--root=", "--seeds=0", "--dry_run")
    assert (code, out) == (2, "") and err == [
      "error: --root is empty; give the sweep's directory (one folder per run)"
    ], err
    for url in ("gs://b/x", "ftp://b/x"):  # a scheme the workdir takes, and one it does not
      code, err, out = _main(capsys, CONFIG, f"--root={url}", "--seeds=0", "--dry_run")
      assert (code, out) == (2, "") and len(err) == 1, err
      assert err[0].startswith(f"error: --root={url}: a sweep's root is a local directory"), err
  finally:
    os.chdir(cwd)
  assert not list(tmp_path.iterdir())


def test_an_empty_seeds_list_is_refused_not_ignored(tmp_path, capsys):
  """--seeds= (say, an unset shell variable) planned one run with the config's seed, exit 0."""
  code, err, out = _main(capsys, CONFIG, f"--root={tmp_path}", "--seeds=", "--dry_run")
  assert (code, err, out) == (2, ["error: --seeds='': empty value"], "")


def test_an_unknown_task_name_is_refused_before_any_run(tmp_path, capsys):
  """--grid=task.name=reverse,nosuch: the dry run planned both runs (exit 0) and the sweep
  started them, the second failing at start-up: the config check did not know task names."""
  grid = "--grid=task.name=reverse,nosuch"
  code, err, out = _main(capsys, CONFIG, f"--root={tmp_path / 's'}", grid, "--dry_run")
  assert (code, out) == (2, "") and len(err) == 1, err
  assert "grid point task.name=nosuch" in err[0], err
  assert "task.name='nosuch'; allowed: addition, countdown, reverse, sort" in err[0], err
  assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_flags_the_chosen_kind_of_sweep_ignores_are_refused(tmp_path, capsys):
  """--parallel=4 or --progress_s with --packed (one program: nothing to run at once, no run's
  log to show), --join_timeout_s without --distributed (no job to join): planned, exit 0; with
  it, a timeout of nan or -1 was used to join."""
  args = [CONFIG, f"--root={tmp_path}", "--seeds=0,1", "--dry_run"]
  cases = {
    ("--packed", "--parallel=4"): "error: --parallel=4 runs separate processes at once",
    ("--packed", "--progress_s=5"): "error: --progress_s shows each separate run's progress",
    ("--join_timeout_s=10",): "error: --join_timeout_s is how long --distributed waits",
  }
  for extra, said in cases.items():
    code, err, out = _main(capsys, *args, *extra)
    assert code == 2 and len(err) == 1 and err[0].startswith(said), err
    assert out == ""
  assert _main(capsys, *args, "--packed", "--parallel=1")[0] == 0  # the default, said: fine
  for bad in ("nan", "-1", "inf"):  # with --distributed: it tried to join with that timeout
    argv = [CONFIG, f"--root={tmp_path}", "--seeds=0,1", "--packed", "--distributed"]
    code, err, _ = _main(capsys, *argv, f"--join_timeout_s={bad}")
    assert (code, err) == (
      2,
      [f"error: --join_timeout_s must be a finite number of seconds > 0, got {float(bad)}"],
    ), err
  assert not list(tmp_path.iterdir())


def test_a_run_record_whose_overrides_are_not_an_object_is_one_line(tmp_path, capsys):
  """A run.json left from before with "overrides" a list or a string: AttributeError
  traceback ('list' object has no attribute 'get'); the record is kept."""
  for i, overrides in enumerate([["seed"], "seed=0"]):
    root = tmp_path / f"s{i}"
    (root / "seed=0").mkdir(parents=True)
    text = json.dumps({"config": CONFIG.removeprefix("--config="), "overrides": overrides})
    (root / "seed=0" / "run.json").write_text(text)
    code, err, _ = _main(capsys, CONFIG, f"--root={root}", "--seeds=0", "--dry_run")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {root / 'seed=0' / 'run.json'}: not a run record"), err
    assert (root / "seed=0" / "run.json").read_text() == text


def test_a_file_where_a_run_folder_should_be_is_named(tmp_path, capsys):
  """ROOT/seed=0 a file: the line named `ROOT/seed=0/run.json ... (Not a directory)`, a file
  that is not there; now the file in the way. The file is kept."""
  (tmp_path / "seed=0").write_text("mine")
  code, err, _ = _main(capsys, CONFIG, f"--root={tmp_path}", "--seeds=0", "--dry_run")
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith(f"error: {tmp_path / 'seed=0'} is a file, not the run's folder"), err
  assert (tmp_path / "seed=0").read_text() == "mine"


def test_a_sweep_json_that_is_a_folder_is_one_line_before_any_run(tmp_path, capsys):
  """ROOT/sweep.json a directory: the dry run planned, the sweep died on writing it with a
  SweepError traceback saying to free space; now one line up front, dry run too, nothing
  touched."""
  (tmp_path / "sweep.json").mkdir()
  (tmp_path / "sweep.json" / "mine.txt").write_text("mine")
  said = [
    f"error: {tmp_path / 'sweep.json'} is not a file (the sweep's record); move it aside or "
    "give another --root"
  ]
  args = [CONFIG, f"--root={tmp_path}", "--seeds=0", TINY]
  assert _main(capsys, *args, "--dry_run")[:2] == (2, said)
  for extra in ([], ["--packed"]):
    assert _cli(*args, *extra) == (2, said)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]
  assert (tmp_path / "sweep.json" / "mine.txt").read_text() == "mine"


def test_a_record_that_cannot_be_written_mid_sweep_is_one_line(tmp_path):
  """A run's record that cannot be written once the sweep has started (here its temporary file
  name taken by a folder): a SweepError traceback that said to free space; now one line naming
  the cause, exit 2, before the run starts."""
  (tmp_path / "seed=0" / "run.json.tmp").mkdir(parents=True)
  code, err = _cli(CONFIG, f"--root={tmp_path}", "--seeds=0", TINY)
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith(f"error: {tmp_path / 'seed=0' / 'run.json'} could not be written"), err
  assert "(Is a directory)" in err[0] and "free space" not in err[0], err
  assert not (tmp_path / "seed=0" / "run.log").exists()  # the run never started
  record = json.loads((tmp_path / "sweep.json").read_text())
  assert [r["status"] for r in record["runs"]] == ["pending"]


@pytest.mark.parametrize("step", [1, 5])
def test_the_dry_run_says_skip_for_every_run_the_sweep_skips(tmp_path, capsys, step):
  """A workdir with a checkpoint past the final step (train.num_steps lowered): the sweep skips
  it (complete) but the dry run said `resume at step 5`."""
  _commit(tmp_path / "seed=0", step)
  code, _, out = _main(capsys, CONFIG, f"--root={tmp_path}", "--seeds=0", TINY, "--dry_run")
  assert code == 0 and out.startswith("[1/1] skip (complete): seed=0"), out
  config, fixed = CONFIG.removeprefix("--config="), [TINY.removeprefix("--set=")]
  assert sweep.is_complete(sweep.plan(config, str(tmp_path), [], fixed, "0")[0])  # as it skips


@pytest.mark.extended  # CI's time (2026-12-06)
def test_a_sweep_run_again_with_another_grid_keeps_the_earlier_runs_in_its_record(tmp_path):
  """Seeds 0 then seed 1 in one root: sweep.json was rewritten with seed=1 alone, so the record
  lost seed=0 while its workdir stayed; now it keeps it, as it was, under `earlier_runs`."""
  assert _cli(CONFIG, f"--root={tmp_path}", "--seeds=0", TINY)[0] == 0
  first = json.loads((tmp_path / "sweep.json").read_text())["runs"]
  assert _cli(CONFIG, f"--root={tmp_path}", "--seeds=1", TINY)[0] == 0
  record = json.loads((tmp_path / "sweep.json").read_text())
  assert [r["name"] for r in record["runs"]] == ["seed=1"]
  assert record["earlier_runs"] == first and first[0]["status"] == "done"
  assert _cli(CONFIG, f"--root={tmp_path}", "--seeds=0", TINY)[0] == 0  # named again: a run
  record = json.loads((tmp_path / "sweep.json").read_text())
  assert [r["name"] for r in record["runs"]] == ["seed=0"]
  assert [r["name"] for r in record["earlier_runs"]] == ["seed=1"]
  assert record["runs"][0]["status"] == "skipped"


@pytest.mark.extended  # CI's time (2026-12-06)
def test_a_packed_sweep_run_again_with_another_set_is_refused_as_separate_runs_are(tmp_path):
  """A pack run again with a changed --set (a field every run shares): its dry run planned it,
  and only the built pack refused it, in the trainer's words, as a pack wrote no run.json. Now
  each run's folder holds its run.json, and the change is refused as it is for separate runs,
  dry run too, before anything is built; nothing is touched."""
  args = [CONFIG, f"--root={tmp_path}", "--seeds=0,1", TINY, "--packed"]
  assert _cli(*args, "--set=objective.clip_low=0.2")[0] == 0
  record = json.loads((tmp_path / "seed=0" / "run.json").read_text())
  assert record["overrides"]["objective.clip_low"] == "0.2"
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  for dry in ([], ["--dry_run"]):
    code, err = _cli(*args, "--set=objective.clip_low=0.1", *dry)
    assert code == 2 and err[0] == "error: these workdirs were run with other settings:", err
    assert err[1] == "  seed=0: objective.clip_low: '0.2' -> '0.1'", err
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
def test_a_sweep_json_that_is_not_a_record_is_refused_not_overwritten(tmp_path, capsys):
  """A sweep.json that is not JSON (or not a sweep's record) was overwritten without a word
  once the first run started; now it is one line before any run, dry run too, and kept."""
  args = [CONFIG, f"--root={tmp_path}", "--seeds=0", TINY]
  for text, why in (
    ("my notes", "cannot be read as the sweep's record"),
    ('{"runs": [1]}', "not a sweep's record"),
    ('{"runs": {"a": 1}}', "not a sweep's record"),  # it was a TypeError traceback
  ):
    (tmp_path / "sweep.json").write_text(text)
    code, err, out = _main(capsys, *args, "--dry_run")
    assert code == 2 and len(err) == 1 and why in err[0] and out == "", (err, out)
    assert err[0].startswith(f"error: {tmp_path / 'sweep.json'}: "), err
    assert _cli(*args) == (2, err)
    assert (tmp_path / "sweep.json").read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]


@pytest.mark.slow
def test_a_refused_pack_leaves_no_run_records_to_refuse_the_corrected_command(tmp_path):
  """A pack refused before it trained (sampling.tool varied: it changes the program) left a
  run.json in each run's new folder, so the corrected command, as separate runs with another
  --set, was refused for settings no run had trained with. Now the root keeps only its log,
  and a root the refused command made goes with it."""
  grid = "--grid=sampling.tool=none,calculator"
  code, err = _cli(CONFIG, f"--root={tmp_path}", grid, TINY, "--packed")
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith("error: a pack cannot vary sampling.tool: it changes the program")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt"]
  # A root the refused command made goes with its log, as a refused run's workdir does.
  code, err = _cli(CONFIG, f"--root={tmp_path / 'new' / 'root'}", grid, TINY, "--packed")
  assert code == 2 and err[0].startswith("error: a pack cannot vary sampling.tool"), err
  assert not (tmp_path / "new").exists()
  code, err = _cli(CONFIG, f"--root={tmp_path}", grid, TINY, "--set=kl.beta=0.01", "--dry_run")
  assert code == 0 and err == [], err


def test_a_misspelt_grid_or_set_field_is_named_as_the_flag_given(tmp_path, capsys):
  """A typo in --grid or --set was named as the trainer's `--config.FIELD=VALUE` the sweep
  turns it into, a flag the user never typed; now as the --grid/--set flag given."""
  for flag in ("--grid=objective.clip_hgh=0.2,0.28", "--set=objective.clip_hgh=0.2"):
    code, err, _ = _main(capsys, CONFIG, f"--root={tmp_path}", flag, "--dry_run")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: unknown config field 'objective.clip_hgh' in '{flag}': ")
    assert "'clip_high'" in err[0] and "--config." not in err[0]


def test_two_processes_checking_one_new_root_at_once_both_pass(tmp_path):
  """A --distributed sweep's processes check the same new --root at once: one removed the
  folder its check had made while the other tested writing in it, which then refused the
  root ("cannot write in it: No such file or directory"; CI at d479cd0). Two threads stand
  for the two processes; a missing root is now tested in its parent with a folder of a unique
  name, so neither makes or removes the root the other tests."""
  import threading

  failed = []
  for i in range(100):
    root = str(tmp_path / f"r{i}" / "pack")
    both = threading.Barrier(2)

    def check(root=root, both=both):
      both.wait()
      try:
        sweep.check_root(root)
      except sweep.SweepError as e:
        failed.append(str(e))

    threads = [threading.Thread(target=check) for _ in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  assert failed == []
  assert list(tmp_path.iterdir()) == []  # nothing made is left behind
