"""tools/sweep.py and tools/compare.py: a real tiny sweep, skipping finished runs, validation."""

import csv
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, cli_env, default_sigint

from jaxrl_llm import checkpoint, metric_info, metrics

sys.path.insert(0, str(REPO / "tools"))
import compare
import same_behaviour
import sweep

CLIPS = ("0.2", "0.28")
CONFIG = f"--config={REPO / 'configs' / 'default.py'}"
GRID = f"--grid=objective.clip_high={','.join(CLIPS)}"
TINY = (
  "--set=train.num_steps=2,sft.steps=0,task.eval_size=8,rl.num_prompts=4,train.eval_every=2",
  "--set=train.log_every=1,train.pass_k=1,model.d_model=32,model.mlp_dim=64,model.num_layers=1",
  "--set=sampling.group_size=4,rl.num_minibatches=2",  # two updates a rollout: the clip binds
)


def _tool(name, *args):
  """Runs tools/<name>.py as a user would, on one CPU device (no fake-device XLA_FLAGS)."""
  env = cli_env()
  cmd = [sys.executable, str(REPO / "tools" / f"{name}.py"), *args]
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
  return proc, time.time() - t0


def _sweep_args(root, *extra):
  return [CONFIG, f"--root={root}", GRID, "--seeds=0", *TINY, *extra]


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
  """One real two-run sweep shared by the tests below: (root, process, sweep.json as written)."""
  root = tmp_path_factory.mktemp("sweep")
  proc, _ = _tool("sweep", *_sweep_args(root, "--parallel=2", "--progress_s=0.5"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return root, proc, json.loads((root / "sweep.json").read_text())


def _names():
  return [f"objective.clip_high={c},seed=0" for c in CLIPS]


def test_plan_expands_the_grid_with_readable_names(tmp_path):
  runs = sweep.plan(
    str(REPO / "configs" / "default.py"),
    str(tmp_path),
    ["objective.clip_high=0.2,0.28", "sampling.temperature=0.7,1.0"],
    ["train.num_steps=200"],
    "0,1",
  )
  names = [r.name for r in runs]
  assert len(names) == 8 and len(set(names)) == 8
  assert "objective.clip_high=0.28,sampling.temperature=0.7,seed=1" in names
  run = runs[names.index("objective.clip_high=0.28,sampling.temperature=0.7,seed=1")]
  assert run.workdir == str(tmp_path / run.name)
  assert run.argv[1:3] == ["-m", "jaxrl_llm.main"]
  assert f"--workdir={run.workdir}" in run.argv
  for flag in ("train.num_steps=200", "objective.clip_high=0.28", "seed=1"):
    assert f"--config.{flag}" in run.argv
  assert run.final_step == 200
  assert not tmp_path.joinpath(run.name).exists()  # planning runs nothing


def test_set_splits_assignments_but_keeps_commas_inside_values():
  assert sweep.parse_set("a.b=1,c=x") == [("a.b", "1"), ("c", "x")]
  rules = 'mesh.rules=(("mlp","model"),)'
  assert sweep.parse_set(rules) == [("mesh.rules", '(("mlp","model"),)')]
  with pytest.raises(sweep.SweepError, match="FIELD=V1,V2"):
    sweep.parse_grid("objective.clip_high")


def test_unknown_field_fails_before_any_run(tmp_path):
  root = tmp_path / "sweep"
  proc, _ = _tool(
    "sweep", "--config=configs/default.py", f"--root={root}", "--grid=objective.clip_hihg=0.2,0.3"
  )
  assert proc.returncode == 2
  assert "unknown config field 'objective.clip_hihg'" in proc.stderr
  assert "clip_high" in proc.stderr  # lists the allowed fields
  assert not root.exists()  # nothing started, not even sweep.json


def test_bad_value_and_repeated_field_fail_before_any_run(tmp_path, capsys):
  args = [CONFIG, f"--root={tmp_path / 's'}"]
  assert sweep.main([*args, "--grid=train.num_steps=2,x"]) == 2
  assert "--config.train.num_steps=x" in capsys.readouterr().err
  assert sweep.main([*args, GRID, "--set=objective.clip_high=0.3"]) == 2
  assert "more than once" in capsys.readouterr().err
  # A value out of its range: refused before the good arm trains (it was a failed run after).
  assert sweep.main([*args, "--grid=objective.clip_high=0.3,-1.0"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: grid point objective.clip_high=-1.0"), err
  assert "objective.clip_high=-1.0 must be" in err[0]
  # Two spellings of one value are one run: refused in one line, not trained twice.
  assert sweep.main([*args, "--grid=sampling.temperature=0.7,0.70"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "are the same run" in err[0], err
  assert "sampling.temperature=0.7 and sampling.temperature=0.70" in err[0]
  # A clip swept where it cannot bind (one update per rollout: every ratio is 1): one line.
  assert sweep.main([*args, GRID, "--set=rl.num_minibatches=1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "objective.clip_high" in err[0] and "no clip binds" in err[0], err
  # With the old policy's own forward pass (dropout or MoE routing may move a ratio off 1): planned.
  cfg, grid = str(REPO / "configs" / "default.py"), [GRID.removeprefix("--grid=")]
  old_pass = ["rl.num_minibatches=1,rl.old_pass=always"]
  assert len(sweep.plan(cfg, str(tmp_path / "p"), grid, old_pass, None)) == 2
  one = ["objective.clip_high=0.28"]  # one value: nothing is compared, nothing refused
  assert len(sweep.plan(cfg, str(tmp_path / "p"), one, ["rl.num_minibatches=1"], "0,1")) == 2
  assert not (tmp_path / "s").exists()
  # A --root that is a file: one line, nothing written.
  (tmp_path / "f").write_text("x")
  assert sweep.main([CONFIG, f"--root={tmp_path / 'f'}", GRID]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [
    f"error: --root={tmp_path / 'f'} is a file; give a directory (it holds a folder per run)"
  ]
  assert (tmp_path / "f").read_text() == "x"


def test_sweep_runs_every_grid_point(tiny_sweep):
  root, proc, record = tiny_sweep
  assert [r["name"] for r in record["runs"]] == _names()
  assert [r["status"] for r in record["runs"]] == ["done", "done"]
  assert record["grid"] == {"objective.clip_high": list(CLIPS), "seed": ["0"]}
  # Not silent while the runs start and train: their newest lines, named, as they go.
  for i, name in enumerate(_names()):
    shown = [x for x in proc.stdout.splitlines() if x.startswith(f"[{i + 1}/2] ")]
    assert len(shown) >= 3 and any(x.endswith(f" - {name}") for x in shown), proc.stdout
  for clip, run in zip(CLIPS, record["runs"]):
    workdir = root / run["name"]
    assert run["workdir"] == str(workdir) and run["returncode"] == 0
    assert run["params"] == {"objective.clip_high": clip, "seed": "0"}
    assert f"--config.objective.clip_high={clip}" in run["argv"]
    assert f"--config.objective.clip_high={clip}" in (workdir / "run.log").read_text()
    assert sweep.committed_steps(str(workdir)) == [2]
    scalars = metrics.read_scalars(str(workdir))
    # --set values took effect: 2 steps, eval every 2, log every step, pass@1.
    assert [s for s, _ in scalars["eval/accuracy"]] == [0, 2]
    assert [s for s, _ in scalars["eval/pass@1"]] == [0, 2]
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [1, 2]
    assert run["metrics"]["eval/accuracy"] == scalars["eval/accuracy"][-1][1]
    with checkpoint.Checkpointer(str(workdir), save_every=0) as ckpt:
      meta = ckpt.read_meta(2)
    assert meta["model"]["d_model"] == 32 and meta["task"]["eval_size"] == 8
  table = proc.stdout.split("objective.clip_high", 2)[-1]
  assert "eval/accuracy" in table and "0.28" in table and "done" in table


def test_rerun_skips_finished_runs(tiny_sweep):
  root, _, _ = tiny_sweep
  logs = {n: (root / n / "run.log").read_text() for n in _names()}
  events = sorted(p.name for p in root.rglob("events.out.tfevents.*"))
  proc, _ = _tool("sweep", *_sweep_args(root))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("skip (checkpoint at final step 2)") == 2
  record = json.loads((root / "sweep.json").read_text())
  assert [r["status"] for r in record["runs"]] == ["skipped", "skipped"]
  assert all("eval/accuracy" in r["metrics"] for r in record["runs"])
  # nothing was trained or compiled: no event file, and no run log line, was written
  assert sorted(p.name for p in root.rglob("events.out.tfevents.*")) == events
  assert {n: (root / n / "run.log").read_text() for n in _names()} == logs


def test_resume_with_other_settings_is_refused(tiny_sweep, capsys):
  root, _, _ = tiny_sweep
  assert sweep.main([*_sweep_args(root), "--set=optim.learning_rate=1e-3", "--dry_run"]) == 2
  err = capsys.readouterr().err
  assert "other settings" in err and "optim.learning_rate: None -> '1e-3'" in err
  assert sweep.main([*_sweep_args(root), "--dry_run"]) == 0
  assert capsys.readouterr().out.count("skip (complete)") == 2


def test_sweep_fills_the_hparams_view(tiny_sweep):
  """TensorBoard's HParams tab on the sweep root (its plugin's own backend): one row per run,
  the swept fields as columns with each run's values, final metrics as values."""
  root, _, _ = tiny_sweep
  table = metrics.hparams_table(str(root))
  # Trial ids name the swept values (short, readable); the swept field is the first column.
  assert [r["name"] for r in table] == [f"ch{c} s0" for c in CLIPS]
  for name in _names():
    assert metrics.read_hparams(str(root / name))["columns"][0] == "objective.clip_high"
  for row, clip in zip(table, CLIPS):
    assert row["hparams"]["objective.clip_high"] == pytest.approx(float(clip))
    assert row["hparams"]["seed"] == 0 and row["hparams"]["objective.name"] == "ppo_clip"
    assert "train.num_steps" not in row["hparams"]  # fixed by --set: not a column
    assert row["status"] == "success"
    final = metrics.read_scalars(str(root / f"objective.clip_high={clip},seed=0"))
    for tag in ("eval/accuracy", "rollout/reward_mean", "policy/entropy", "policy/clip_frac"):
      assert row["metrics"][tag] == pytest.approx(final[tag][-1][1])


def test_compare_prints_both_runs(tiny_sweep, tmp_path):
  root, _, _ = tiny_sweep
  out = tmp_path / "out.csv"
  proc, _ = _tool(
    "compare", f"--root={root}", "--tags=eval/accuracy,rollout/reward_mean", f"--csv={out}"
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in _names():
    assert name in proc.stdout
  assert "eval/accuracy final" in proc.stdout and "rollout/reward_mean best" in proc.stdout
  with open(out) as f:
    rows = list(csv.DictReader(f))
  assert [r["run"] for r in rows] == _names()
  for r in rows:
    assert r["step"] == "2"
    assert 0 <= float(r["eval/accuracy final"]) <= 1
    assert float(r["rollout/reward_mean best"]) >= float(r["rollout/reward_mean final"])


def test_compare_names_a_mistyped_tag_and_the_tag_it_meant(tiny_sweep):
  root, _, _ = tiny_sweep
  proc, _ = _tool("compare", f"--root={root}", "--tags=eval/acuracy")
  assert proc.returncode == 2 and not proc.stdout.strip()
  assert "'eval/acuracy' is in no run" in proc.stderr and "eval/accuracy" in proc.stderr


def test_failed_runs_are_reported_and_the_sweep_goes_on(tmp_path):
  root = tmp_path / "bad"
  # Both values are in range, but the trainer rejects them at start-up: 16 sequences do not
  # split into 3 or 5 microbatches (a check across sections, with the built run).
  proc, _ = _tool(
    "sweep",
    CONFIG,
    f"--root={root}",
    "--grid=rl.num_microbatches=3,5",
    *TINY,
    "--parallel=2",
  )
  assert proc.returncode == 1
  record = json.loads((root / "sweep.json").read_text())
  assert [(r["status"], r["returncode"]) for r in record["runs"]] == [("failed", 2)] * 2
  for n in ("3", "5"):
    assert f"rl.num_microbatches={n}" in proc.stderr  # named in the failure list
    log = (root / f"rl.num_microbatches={n}" / "run.log").read_text()
    assert "invalid config" in log and f"rl.num_microbatches={n}" in log.split("invalid")[-1]
    assert log.strip().splitlines()[-1] in proc.stderr  # the tail of the log is shown


def _interrupt_when_committed(args, workdir, signum=signal.SIGTERM, group=False):
  """Starts `tools/sweep.py args` and sends it `signum` once `workdir` holds a committed
  checkpoint (polled, not timed); with `group`, to its whole process group (a terminal's
  Ctrl-C) once the next save is in flight. Returns (the sweep's exit status, its stderr)."""
  cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), *args]
  pipe = subprocess.PIPE
  proc = subprocess.Popen(
    cmd,
    cwd=REPO,
    env=cli_env(),
    stdout=pipe,
    stderr=pipe,
    text=True,
    start_new_session=True,
    preexec_fn=default_sigint,  # a test run in the background ignores SIGINT
  )
  deadline = time.time() + 180
  while not sweep.committed_steps(str(workdir)):
    if proc.poll() is not None or time.time() > deadline:
      os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its trainer
      out, err = proc.communicate()
      pytest.fail(f"no checkpoint committed in {workdir}:\n{out[-2000:]}\n{err[-3000:]}")
    time.sleep(0.05)
  if group:
    saves = workdir / "checkpoints"
    while proc.poll() is None and not any(
      ".orbax-checkpoint-tmp" in p.name for p in saves.iterdir()
    ):
      time.sleep(0.001)
    os.killpg(proc.pid, signum)
  else:
    proc.send_signal(signum)
  _, err = proc.communicate(timeout=120)
  return proc.returncode, err


def test_a_run_past_its_final_step_counts_as_complete(tmp_path):
  """A workdir whose newest committed step is past the run's final step (a longer run resumed
  under a shorter grid) is complete: it was retried on every rerun as incomplete."""
  done = tmp_path / "checkpoints" / "40"
  done.mkdir(parents=True)
  run = sweep.Run("r", str(tmp_path), {}, {}, [], final_step=20)
  assert not sweep.is_complete(run)  # not committed yet
  (done / "commit_success.txt").write_text("")
  assert sweep.is_complete(run)
  assert not sweep.is_complete(dataclasses.replace(run, final_step=41))


@pytest.mark.extended
def test_ctrl_c_in_a_terminal_lets_each_run_stop_on_its_own(tmp_path):
  """A terminal's Ctrl-C reaches the sweep and its running trainer, mid-save: the sweep waits
  for the trainer to stop on its own (its one line, exit 130) instead of sending it SIGTERM in
  the middle of that (which killed it, exit -15, and cut the save it was finishing); the sweep
  exits 130 and records the run as interrupted with the trainer's status."""
  root = tmp_path / "s"
  longer = TINY[0].replace("num_steps=2", "num_steps=200").replace("eval_every=2", "eval_every=999")
  args = [CONFIG, f"--root={root}", GRID, "--seeds=0", longer, *TINY[1:]]
  args += ["--set=train.checkpoint_every=1"]  # a save after every step: Ctrl-C lands near one
  first = root / _names()[0]
  code, err = _interrupt_when_committed(args, first, signal.SIGINT, group=True)
  assert code == 130, err[-3000:]
  record = json.loads((root / "sweep.json").read_text())
  assert [(r["status"], r["returncode"]) for r in record["runs"]] == [
    ("interrupted", 130),
    ("pending", None),
  ]
  log = (first / "run.log").read_text()
  assert "stopped by SIGINT (Ctrl-C): the checkpoints committed before it are intact" in log
  assert 1 <= max(sweep.committed_steps(str(first))) < 200


@pytest.mark.extended
def test_an_interrupted_sweep_resumes_its_unfinished_run_at_its_newest_checkpoint(tmp_path, capsys):
  """SIGTERM to a sweep while its first run trains: the sweep stops that run (the trainer saves
  the step it has just finished, exit 143), marks it interrupted and exits 143. The same command
  then resumes: the dry run says `resume at step N` (the newest committed step) for that run and
  `start` for the run that never began; the rerun ends both `done`, the resumed run's log says
  it resumed from step N, and its events hold every step once (no step trained twice, the
  evaluation at step 0 not redone)."""
  root, steps = tmp_path / "s", 20
  longer = (
    TINY[0].replace("num_steps=2", f"num_steps={steps}").replace("eval_every=2", "eval_every=999")
  )
  args = [CONFIG, f"--root={root}", GRID, "--seeds=0", longer, *TINY[1:]]
  args += ["--set=train.checkpoint_every=2"]
  first, second = (root / n for n in _names())
  code, err = _interrupt_when_committed(args, first)
  assert code == 143, err[-3000:]  # 128 + SIGTERM, as the trainer and a packed sweep
  assert "interrupted; stopping runs (rerun the same command to resume)" in err
  record = json.loads((root / "sweep.json").read_text())
  assert [(r["status"], r["returncode"]) for r in record["runs"]] == [
    ("interrupted", 143),
    ("pending", None),
  ]
  at = max(sweep.committed_steps(str(first)))
  assert 2 <= at < steps, f"the run was not stopped early: newest step {at}"
  assert (
    f"stopped by SIGTERM after step {at}: checkpoint {at} is saved"
    in (first / "run.log").read_text()
  )
  assert sweep.committed_steps(str(second)) == []

  assert sweep.main([*args, "--dry_run"]) == 0
  plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
  assert plan == [f"[1/2] resume at step {at}: {first.name}", f"[2/2] start: {second.name}"]

  proc, _ = _tool("sweep", *args)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert f"[1/2] resuming at step {at}: {first.name}" in proc.stdout
  assert f"[2/2] starting: {second.name}" in proc.stdout
  record = json.loads((root / "sweep.json").read_text())
  assert [(r["status"], r["returncode"], r["start_step"]) for r in record["runs"]] == [
    ("done", 0, at),
    ("done", 0, None),
  ]
  launches = (first / "run.log").read_text().split("\n### ")[1:]  # one section per launch
  assert len(launches) == 2 and "resumed from" not in launches[0]
  assert f"resumed from {first} at step {at}" in launches[1]
  for workdir in (first, second):
    assert max(sweep.committed_steps(str(workdir))) == steps
    scalars = metrics.read_scalars(str(workdir))
    assert [s for s, _ in scalars["rollout/reward_mean"]] == list(range(1, steps + 1))
    assert [s for s, _ in scalars["eval/accuracy"]] == [0, steps]


def test_compare_table_fits_the_width_in_blocks():
  header = ["run", "step"] + [f"some/long_metric_name_{i} final" for i in range(12)]
  rows = [[f"objective.clip_high=0.{i}", 100] + [0.123456 * j for j in range(12)] for i in range(3)]
  text = compare.format_blocks(header, rows, width=120)
  lines = text.splitlines()
  assert max(map(len, lines)) <= 120 and text.count("run ") > 1  # several blocks
  for h in header[2:]:
    assert text.count(h) == 1  # every column shown exactly once
  assert compare.format_blocks(header, rows, width=0) == compare.format_table(header, rows)


def test_compare_summaries():
  series = [(0, 0.1), (5, 0.7), (10, float("nan")), (15, 0.5)]
  assert compare.summarize(series) == {"final": 0.5, "final_step": 15, "best": 0.7, "best_step": 5}
  assert compare.summarize(series, minimize=True)["best"] == 0.1
  assert compare.summarize([]) is None
  assert compare.summarize(series, best=False)["best"] is None
  # A best only where the metric declares a direction: accuracy up, SFT loss, KL and skips
  # down; entropy, clip fraction, length and the policy-gradient loss have none.
  assert compare.direction("eval/accuracy") == compare.direction("eval/pass@4") == "max"
  assert compare.direction("sft/loss") == compare.direction("kl/ref_kl") == "min"
  assert compare.direction("optim/skipped_updates") == "min"
  for tag in ("policy/entropy", "policy/clip_frac", "rollout/length_mean", "policy/loss"):
    assert compare.direction(tag) is None
  assert compare.direction("policy/entropy", maximize=["policy/*"]) == "max"  # user override
  tags = ["eval/accuracy", "eval/pass@4", "policy/loss"]
  assert compare.expand_tags(["eval/*", "x/y"], tags) == ["eval/accuracy", "eval/pass@4", "x/y"]
  # k in number order, as the summary lines write them too (pass@16 came before pass@2)
  tags = ["eval/pass@16", "eval/pass@2", "eval/accuracy", "eval/pass@4"]
  want = ["eval/accuracy", "eval/pass@2", "eval/pass@4", "eval/pass@16"]
  assert compare.expand_tags(["eval/*"], tags) == want
  assert sorted(tags, key=metric_info.tag_order) == want


def test_same_behaviour_compares_every_step_but_wall_clock_tags(capsys):
  nan = float("nan")
  before = {".:eval/accuracy": {0: [0.5], 5: [0.6]}, "sft:sft/loss": {1: [1.0], 2: [nan]}}
  before[".:perf/step_time_s"] = {1: [0.1]}
  after = {k: dict(v) for k, v in before.items()} | {".:perf/step_time_s": {1: [0.3]}}
  assert same_behaviour.report("r", before, after)  # NaN equals NaN; timings are not compared
  assert "equal: 4 values of 2 tags" in capsys.readouterr().out
  after["sft:sft/loss"] = {1: [1.0], 2: [0.9]}
  after[".:eval/accuracy"] = {0: [0.5], 5: [0.6, 0.6]}  # a step logged twice differs
  assert not same_behaviour.report("r", before, after)
  out = capsys.readouterr().out
  assert ".: step 5, tag eval/accuracy: before=0.6 after=0.6, 0.6" in out
  assert "sft: step 2, tag sft/loss: before=nan after=0.9" in out
  assert same_behaviour.excluded("perf/generated_tokens_per_s")
  assert not same_behaviour.excluded("perf/generated_tokens")


@pytest.mark.extended
def test_a_packed_sweep_trains_every_grid_point_in_one_program(tmp_path):
  root = tmp_path / "packed"
  args = [CONFIG, f"--root={root}", GRID, "--seeds=0,1", *TINY, "--packed"]
  proc, _ = _tool("sweep", *args)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  names = [f"objective.clip_high={c},seed={s}" for c in CLIPS for s in (0, 1)]
  assert sorted(p.name for p in root.iterdir()) == sorted(
    [*names, "checkpoints", "log.txt", "sweep.json"]
  )
  assert sweep.committed_steps(str(root)) == [2]  # the pack checkpoints as a whole
  record = json.loads((root / "sweep.json").read_text())
  assert record["packed"] and [r["status"] for r in record["runs"]] == ["done"] * 4
  assert {r["log"] for r in record["runs"]} == {str(root / "log.txt")}  # no run.log of its own
  banner = next(x for x in proc.stderr.splitlines() if "objective ppo_clip (" in x)
  assert "clip_high by run" in banner and "clip_low 0.2" in banner, banner  # not one run's 0.2
  for name in names:
    assert [s for s, _ in metrics.read_scalars(str(root / name))["eval/accuracy"]] == [0, 2]
    hparams = metrics.read_hparams(str(root / name))["hparams"]
    assert f"objective.clip_high={hparams['objective.clip_high']:g}" in name
    trial = f"ch{hparams['objective.clip_high']:g} s{hparams['seed']:g}"
    assert f"[{trial}] step 2: " in proc.stderr  # its own progress lines, under its trial id
  again, _ = _tool("sweep", *args)  # finished: nothing to train, the same table
  assert again.returncode == 0 and "nothing to train" in again.stderr
  _check_the_seed_table_reads_the_pack(root, names)


@pytest.mark.extended
def test_a_pack_resumes_from_its_grid_in_another_order_and_refuses_other_runs(tmp_path):
  """A pack's runs are fixed when it starts: the same grid values in another order resume it
  (they were refused as another pack, every run marked failed, exit 1), and a grid with a run
  more is one line, exit 2, before anything is written."""
  root = tmp_path / "p"
  every = "--set=train.checkpoint_every=1"
  first = [CONFIG, f"--root={root}", GRID, "--seeds=0", *TINY, every, "--packed"]
  proc, _ = _tool("sweep", *first, "--set=train.stop_after_steps=1")
  assert proc.returncode == 0 and sweep.committed_steps(str(root)) == [1], proc.stderr[-3000:]
  names = sweep.saved_pack_names(str(root))
  assert names == [f"objective.clip_high={c},seed=0" for c in CLIPS]
  reordered = f"--grid=objective.clip_high={','.join(reversed(CLIPS))}"
  proc, _ = _tool(
    "sweep", CONFIG, f"--root={root}", reordered, "--seeds=0", *TINY, every, "--packed"
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads((root / "sweep.json").read_text())
  assert [(r["name"], r["status"], r["last_step"]) for r in record["runs"]] == [
    (name, "done", 2) for name in names
  ]
  more = f"--grid=objective.clip_high={','.join(CLIPS)},0.25"
  before = sorted(p.name for p in root.iterdir())
  proc, _ = _tool("sweep", CONFIG, f"--root={root}", more, "--seeds=0", *TINY, every, "--packed")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [
    f"error: --root={root} holds a pack of 2 runs at step 2, and this grid adds "
    "['objective.clip_high=0.25,seed=0']: a pack's runs are fixed when it starts; give its "
    "grid again to resume it, or another --root for these runs"
  ]
  assert sorted(p.name for p in root.iterdir()) == before
  # The same points with the --grid flags swapped: other folder names, said so (not "adds").
  swapped = [CONFIG, f"--root={root}", "--grid=seed=0", GRID, *TINY, every, "--packed"]
  proc, _ = _tool("sweep", *swapped)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [
    f"error: --root={root} holds a pack of these 2 runs at step 2, with its fields in another "
    f"order (a run's folder is named by them: {names[0]!r}): give the --grid flags in the order "
    "it started with to resume it"
  ]
  assert sorted(p.name for p in root.iterdir()) == before


@pytest.mark.extended
# SIGTERM only: a pack and a run stop in one loop (run/loop.py), whose Ctrl-C test_faults.py sends.
@pytest.mark.parametrize("signum", [signal.SIGTERM], ids=["SIGTERM"])
def test_a_packed_sweep_stopped_by_a_signal_says_so_in_one_line_and_resumes(tmp_path, signum):
  """SIGTERM (a preemption notice): the pack saves the step it has just finished, prints one
  line and exits 143; Ctrl-C: one line, exit 130, the committed checkpoints intact. Either
  way sweep.json marks the runs interrupted and the same command resumes the pack."""
  root = tmp_path / "p"
  longer = TINY[0].replace("num_steps=2", "num_steps=400").replace("eval_every=2", "eval_every=999")
  args = [CONFIG, f"--root={root}", GRID, "--seeds=0", longer, *TINY[1:], "--packed"]
  args += ["--set=train.checkpoint_every=2"]
  cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), *args]
  proc = subprocess.Popen(
    cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    preexec_fn=default_sigint,
  )  # fmt: skip
  seen = []
  for line in proc.stderr:
    seen.append(line)
    if re.search(r"\] step 6: ", line):
      break
  proc.send_signal(signum)
  err = "".join(seen) + proc.communicate(timeout=300)[1]
  last = err.strip().splitlines()[-1]
  committed = sweep.committed_steps(str(root))
  if signum == signal.SIGTERM:
    assert proc.returncode == 143, err[-3000:]
    match = re.match(r"stopped by SIGTERM after step (\d+): checkpoint \1 is saved in ", last)
    assert match and 6 <= int(match.group(1)) < 400 and max(committed) == int(match.group(1))
  else:
    assert proc.returncode == 130, err[-3000:]
    assert last.startswith("stopped by SIGINT (Ctrl-C): the pack's checkpoints committed"), last
  record = json.loads((root / "sweep.json").read_text())
  assert [r["status"] for r in record["runs"]] == ["interrupted"] * 2
  again, _ = _tool("sweep", *args, "--set=train.stop_after_steps=2")
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from {root} at step {max(committed)}" in again.stderr
  assert max(sweep.committed_steps(str(root))) == max(committed) + 2


def _check_the_seed_table_reads_the_pack(root, names):
  """experiments/seed_table.py over the pack's run folders: an arm per clip width with both
  seeds, each run's own final accuracy, and the paired difference to the baseline arm."""
  cmd = [sys.executable, str(REPO / "experiments" / "seed_table.py")]
  cmd += ["--group_by=objective.clip_high", "--cols=eval/accuracy@final", "--per_seed"]
  cmd += [f"--baseline={CLIPS[0]}", "--expect=eval/accuracy@final:+"]
  table = lambda *roots: subprocess.run(  # noqa: E731
    [*cmd, *[f"--root={r}" for r in roots]], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  proc = table(root)
  assert proc.returncode == 0, proc.stderr[-2000:]
  tables = _markdown_tables(proc.stdout)
  arms, diffs, runs = tables
  # A study's extra seeds under a second root join their arms: the same tables from two roots.
  by_seed = [root / n for s in (0, 1) for n in names if n.endswith(f"seed={s}")]
  split = table(*by_seed)
  assert split.returncode == 0, split.stderr[-2000:]
  assert sorted(_markdown_tables(split.stdout)[0]) == sorted(arms)
  twice = table(root, root / names[0])  # a seed of an arm twice: refused, naming it
  assert twice.returncode != 0 and "seed 0 twice" in twice.stderr, twice.stderr[-2000:]
  assert sorted(r[0] for r in arms) == sorted(CLIPS) and all(r[1] == "2" for r in arms)
  for name in names:
    (run,) = [r for r in runs if r[0] == name]
    want = metrics.read_scalars(str(root / name))["eval/accuracy"][-1][1]
    assert float(run[2]) == pytest.approx(want, abs=1e-3)
  ((clip, diff),) = diffs
  assert clip == CLIPS[1]
  # 2 seeds are fewer than study_stats.MIN_SEEDS: no interval and no verdict
  assert "(n=2: too few seeds for an interval)" in diff and diff.endswith("too few seeds"), diff


def _markdown_tables(text: str) -> list[list[list[str]]]:
  """The rows (cells split) of each Markdown table in `text`, header and rule left out."""
  return [[line.strip("| ").split(" | ") for line in block.splitlines()[2:]]
          for block in text.split("\n\n") if block.startswith("| ")]  # fmt: skip


@pytest.mark.extended
def test_a_packed_dry_run_plans_the_pack_or_names_the_packable_fields(tmp_path):
  args = [CONFIG, f"--root={tmp_path / 'p'}", GRID, "--seeds=0,1", *TINY, "--packed", "--dry_run"]
  proc, _ = _tool("sweep", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "a pack of 4 runs varying seed, objective.clip_high" in proc.stdout
  assert "dry run: the packed step of 4 runs needs" in proc.stdout
  assert "dry run: the held-out evaluation of 4 runs (" in proc.stdout
  bad, _ = _tool("sweep", *args, "--grid=rl.num_epochs=1,2")
  assert bad.returncode == 2 and not (tmp_path / "p").exists()
  (line,) = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
  assert "rl.num_epochs" in line and "packable fields: seed" in line
  trained, _ = _tool("sweep", *args[:-1], "--grid=rl.num_epochs=1,2")  # not a dry run: the
  assert trained.returncode == 2  # same line, once (it was printed twice)
  assert [x for x in trained.stderr.splitlines() if x.startswith("error:")] == [line]
