"""What the README says the terminal shows, read from real command-line runs: the banner's
versions, backend, devices, processes, mesh and parameter count (a MoE model's active ones too),
its workdir and TensorBoard command, the RL step's compilation lines, the progress line's values
against the scalars in TensorBoard and its rate and ETA, the closing summary's rates, evaluation
and paths, what a relaunch of a finished workdir prints, and the lines bare on a terminal (a
pseudo-terminal) but with absl's prefix when redirected or under --debug, the libraries' log
lines (orbax, ...) in the log file and off the terminal unless --debug, for a run and for a
packed sweep (tools/sweep.py --packed). (tests/test_train.py: the warm start's compilation line,
and the banner first in a redirected run.) And the tools' command lines (ArgParser): an
option that stores one value given twice is one `error:` line, in any form or spelling, in a
sub-command too, where append and count options may repeat and what follows `--` is no option."""

import argparse
import json
import os
import pty
import re
import select
import subprocess
import sys

import jax
import pytest
from conftest import REPO, TINY_CLI, cli_env

import jaxrl_llm
from jaxrl_llm import metrics
from jaxrl_llm.config.learner import AUTO_REMAT_PARAMS
from jaxrl_llm.terminal import ArgParser

TINY = (*TINY_CLI, "--config.sft.steps=0")
MOE = (
  "--config.model.moe_num_experts=4",
  "--config.model.moe_top_k=2",
  "--config.model.moe_expert_mlp_dim=32",
  "--config.model.num_layers=2",
  "--config.model.moe_every=2",
)
PROGRESS = re.compile(r"step (\d+)/(\d+) (\d+)% \S+ steps/s ETA \S+ \| (.*)$")
# absl's prefix: level, month and day, time, thread id, source file and line.
PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ (\S+):\d+\] ")
BANNER = re.compile(
  r"jaxrl_llm (\S+) \| JAX (\S+) \| (\w+) \((.+)\) x (\d+) devices, (\d+) process\(es\) "
  r"\| mesh (.+) \| ([\d.]+)M parameters"
)
DURATION = re.compile(r"(\d+):(\d\d):(\d\d)")
# The RL step's notice after its first update: compiled, or loaded from the persistent
# compilation cache (the tests share one: another test may have compiled the same program).
BUILT = r"RL step (?:compiled|loaded from the compilation cache); "
# A line of a log file: absl's prefix (level letter, source file) and the message.
LOGGED = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ (\S+):\d+\] (.*)$")
# Source files of this project: a logged line from any other file is a library's.
OURS = {p.name for p in (REPO / "jaxrl_llm").rglob("*.py")} | {"sweep.py", "compare.py"}
CLIPS = ("0.2", "0.28")
SWEEP = (
  f"--config={REPO / 'configs' / 'default.py'}",
  f"--grid=objective.clip_high={','.join(CLIPS)}",
  "--set=" + ",".join(x.removeprefix("--config.") for x in TINY),
  "--set=train.num_steps=2,train.eval_every=2,train.log_every=1",
  "--packed",
)


def _command(workdir, *args) -> list[str]:
  """The command line of a tiny run in `workdir` with `args`."""
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  return [*cmd, f"--workdir={workdir}", *TINY, *args]


def _raw(workdir, *args) -> list[str]:
  """The lines a command-line run prints to its redirected stderr, after checking it ended well."""
  proc = subprocess.run(
    _command(workdir, *args), cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stderr.splitlines()


def _bare(lines: list[str]) -> list[str]:
  """`lines` with absl's prefix removed."""
  return [PREFIX.sub("", x) for x in lines]


def _run(workdir, *args) -> list[str]:
  """The lines a command-line run prints (absl's prefix removed), after checking it ended well."""
  return _bare(_raw(workdir, *args))


def _on_a_terminal(workdir, *args) -> list[str]:
  """The non-blank lines a command-line run prints to a pseudo-terminal (its stdout and
  stderr), after checking it ended well."""
  return _pty(_command(workdir, *args))


def _pty(cmd: list[str]) -> list[str]:
  """The non-blank lines `cmd` prints to a pseudo-terminal (its stdout and stderr), after
  checking it ended well."""
  master, slave = pty.openpty()
  proc = subprocess.Popen(cmd, stdout=slave, stderr=slave, cwd=REPO, env=cli_env())
  os.close(slave)
  out = b""
  try:
    while select.select([master], [], [], 300)[0]:
      try:
        chunk = os.read(master, 4096)
      except OSError:  # the terminal closed: the process ended
        break
      if not chunk:
        break
      out += chunk
    assert proc.wait(timeout=60) == 0, out.decode()[-3000:]
  finally:
    if proc.poll() is None:
      proc.kill()
    os.close(master)
  return [x for x in out.decode(errors="replace").splitlines() if x.strip()]


def _seconds(duration: str) -> int:
  """`h:mm:ss` (metrics.format_duration) in seconds."""
  h, m, s = DURATION.fullmatch(duration).groups()
  return 3600 * int(h) + 60 * int(m) + int(s)


@pytest.fixture(scope="module")
def dense_raw(tmp_path_factory):
  """(workdir, redirected lines of a 4-step run logging every 2 and evaluating every 2, those of
  its relaunch once finished)."""
  workdir = tmp_path_factory.mktemp("dense") / "run"
  args = ("--config.train.num_steps=4", "--config.train.log_every=2", "--config.train.eval_every=2")
  return workdir, _raw(workdir, *args), _raw(workdir, *args)


@pytest.fixture(scope="module")
def dense(dense_raw):
  """`dense_raw` with absl's prefix removed."""
  workdir, lines, again = dense_raw
  return workdir, _bare(lines), _bare(again)


@pytest.fixture(scope="module")
def terminal(tmp_path_factory):
  """(workdir, the lines on a pseudo-terminal of the first 3 of 1000 steps (a time-limited
  slot: train.stop_after_steps), logging every update and evaluating at step 3; those of a
  relaunch for 3 steps, then finished, on a pseudo-terminal too, with --debug)."""
  workdir = tmp_path_factory.mktemp("terminal") / "run"
  args = ("--config.train.log_every=1", "--config.train.eval_every=3")
  first = _on_a_terminal(
    workdir, *args, "--config.train.num_steps=1000", "--config.train.stop_after_steps=3"
  )
  return workdir, first, _on_a_terminal(workdir, *args, "--config.train.num_steps=3", "--debug")


def test_the_banner_names_the_workdir_and_the_tensorboard_command(dense):
  """After the banner: the workdir and `tensorboard --logdir <workdir>`; the dense model's count
  has no active-per-token part."""
  workdir, lines, _ = dense
  assert f"workdir {workdir} | watch it: tensorboard --logdir {workdir}" in lines
  banner = next(x for x in lines if x.startswith("jaxrl_llm "))
  assert "M parameters" in banner and "active per token" not in banner


def test_the_progress_lines_show_the_scalars_written_to_tensorboard(dense):
  """A progress line every `train.log_every` updates: step, total, percent, and the short names
  (reward, acc, ent, len, clip) with the values TensorBoard holds at that step, to 3 digits."""
  workdir, lines, _ = dense
  scalars = {k: dict(v) for k, v in metrics.read_scalars(str(workdir)).items()}
  progress = [PROGRESS.search(x) for x in lines]
  progress = [m for m in progress if m]
  assert [(int(m[1]), int(m[2]), int(m[3])) for m in progress] == [(2, 4, 50), (4, 4, 100)]
  for m in progress:
    shown = dict(zip(*[iter(m[4].split())] * 2))  # "reward 0.5 acc 0.25 ..." → {name: value}
    assert list(shown) == ["reward", "acc", "ent", "len", "clip"], m[0]
    for short, tag in {v: k for k, v in metrics.SHORT_NAMES.items()}.items():
      if short in shown:
        assert shown[short] == f"{scalars[tag][int(m[1])]:.3g}", (m[0], tag)


def test_the_summary_gives_rates_evaluations_and_where_things_are(dense):
  """The closing lines: steps 0..4 with steps/s and generated tokens/s, each evaluation tag from
  the first evaluation (step 0) to the last (step 4) as TensorBoard has them, the checkpoints'
  and events' places, then `last eval: ...; wall time ...; workdir ...`."""
  workdir, lines, _ = dense
  trained = next(x for x in lines if x.startswith("trained RL steps 0..4 in "))
  rates = re.search(r"\| (\S+) steps/s, (\S+) generated tokens/s after the first", trained)
  assert rates and float(rates[1]) > 0 and float(rates[2]) > 0, trained
  evals = next(x for x in lines if x.startswith("eval from step 0 to 4: "))
  scalars = metrics.read_scalars(str(workdir))
  pairs = {k: (a, b) for k, a, b in re.findall(r"(\S+) (\S+) -> ([^,\s]+)", evals)}
  eval_tags = {k for k in scalars if k.startswith("eval/")}
  assert {f"eval/{k}" for k in pairs} == eval_tags and len(eval_tags) >= 4
  for tag in eval_tags:
    first, last = scalars[tag][0], scalars[tag][-1]
    assert (first[0], last[0]) == (0, 4)
    assert pairs[tag[5:]] == (f"{first[1]:.3g}", f"{last[1]:.3g}"), tag
  ckpts = workdir / "checkpoints"
  place = f"checkpoints in {ckpts} | events in {workdir}: tensorboard --logdir {workdir}"
  assert place in lines and (ckpts / "4").is_dir()
  final = lines[-1]
  assert final.startswith("last eval: ") and final.endswith(f"; workdir {workdir}"), final
  assert f"accuracy={scalars['eval/accuracy'][-1][1]:.4g}" in final and "; wall time " in final


def test_a_relaunched_finished_workdir_says_so_and_prints_its_final_evaluation(dense):
  """Relaunched once finished: a line naming the step it holds and train.num_steps, no
  training, and the same recorded final evaluation as the run's own last line."""
  workdir, lines, again = dense
  assert f"{workdir} already holds step 4 of train.num_steps=4: nothing to train" in again
  assert not [x for x in again if PROGRESS.search(x) or x.startswith("trained RL steps")]
  strip = lambda line: line.split("; wall time")[0]  # noqa: E731
  assert strip(again[-1]) == strip(lines[-1]) and again[-1].startswith("last eval: eval/")


@pytest.mark.extended
def test_a_moe_banner_gives_the_parameters_active_per_token(tmp_path):
  """A mixture-of-experts model (4 experts, top 2): the banner gives the total, the run's
  HParams count, and, fewer, the parameters one token uses: the total less the routed experts'
  gate, up and down weights ([E, D, F] each) a token skips, (E - top_k) / E of them."""
  workdir = tmp_path / "moe"
  lines = _run(workdir, *MOE, "--config.train.num_steps=1", "--config.train.eval_every=1")
  banner = next(x for x in lines if x.startswith("jaxrl_llm "))
  got = re.search(r"([\d.]+)M parameters \(([\d.]+)M active per token\)", banner)
  assert got and 0 < float(got[2]) < float(got[1]), banner
  total = metrics.read_hparams(str(workdir))["hparams"]["params"]
  assert got[1] == f"{total / 1e6:.3g}", (banner, total)
  mc = json.loads((workdir / "config.json").read_text())["config"]["model"]
  e, k, d, f = (mc[x] for x in ("moe_num_experts", "moe_top_k", "d_model", "moe_expert_mlp_dim"))
  moe_layers = mc["num_layers"] // mc["moe_every"]  # every moe_every-th layer is MoE
  skipped = moe_layers * 3 * e * d * f * (e - k) // e
  assert got[2] == f"{(total - skipped) / 1e6:.3g}", (banner, total, skipped)


def test_the_banner_gives_versions_backend_devices_processes_mesh_and_parameters(dense):
  """The banner's values are the run's: this package's and JAX's versions, the backend, device
  and process counts config.json records, one device's mesh, and the parameter count of the
  run's HParams session (3 significant digits, in millions)."""
  workdir, lines, again = dense
  record = json.loads((workdir / "config.json").read_text())
  params = metrics.read_hparams(str(workdir))["hparams"]["params"]
  for shown in (lines, again):  # a relaunch shows the same banner
    banners = [m for m in map(BANNER.fullmatch, shown) if m]
    assert len(banners) == 1, shown[:3]
    version, jax_version, platform, _, devices, processes, mesh, millions = banners[0].groups()
    assert (version, jax_version) == (jaxrl_llm.__version__, jax.__version__)
    assert (version, jax_version) == (record["jaxrl_llm"], record["jax"])
    assert (platform, int(devices), int(processes)) == (
      record["backend"],
      record["devices"],
      record["processes"],
    )
    assert int(devices) == 1 and mesh == "one device"
    assert millions == f"{params / 1e6:.3g}" and params > 0


def test_redirected_every_line_keeps_absls_prefix_naming_its_source(dense_raw):
  """Redirected, each line of a run and of its relaunch keeps absl's prefix (level, time,
  thread, source line): the banner and summary from record.py, progress lines from step_log.py, a
  finished run's notice from held_out.py, the final evaluation from main.py."""
  _, lines, again = dense_raw
  for raw in (lines, again):
    assert raw and all(PREFIX.match(x) for x in raw if x.strip()), raw[:5]
  source = {PREFIX.sub("", x): PREFIX.match(x)[1] for x in lines + again}
  expected = {
    "jaxrl_llm ": "record.py",
    "step 2/4 ": "step_log.py",
    "trained RL steps ": "record.py",
  }
  expected |= {"already holds step 4": "held_out.py", "last eval: ": "main.py"}
  for start, file in expected.items():
    files = {f for line, f in source.items() if start in line}
    assert files == {file}, (start, files)


@pytest.mark.extended
def test_on_a_terminal_the_lines_are_bare_in_the_readmes_order(terminal):
  """On a pseudo-terminal, lines with no absl prefix, once each and in order: the banner, the
  objective and learner (the objective the run's HParams record, its resolved microbatches and
  remat), the workdir, each compilation as it starts, the evaluations, a progress line per
  update, and the summary with the RL loop's time apart from the (longer) whole wall time."""
  workdir, lines, _ = terminal
  order = [
    BANNER.pattern, r"objective (\S+) \((.*)\) \| learner: (\d+) microbatch\(es\) per minibatch, "
    r"remat (\S+)", r"workdir \S+ \| watch it: tensorboard --logdir \S+",
    r"compiling the held-out evaluation ", r"eval step 0: accuracy ", r"compiling the RL step ",
    BUILT, r"step 1/1000 ", r"step 2/1000 ", r"step 3/1000 ",
    r"eval step 3: accuracy ",
    r"trained RL steps 0\.\.3 in (\S+) \(the RL loop, of which (\S+) the first evaluation, "
    r"compiling and the first step; (\S+) wall time",
    r"eval from step 0 to 3: ", r"checkpoints in \S+ \| events in \S+: ", r"last eval: eval/",
  ]  # fmt: skip
  found = [(i, re.match(p, x)) for x in lines for i, p in enumerate(order) if re.match(p, x)]
  assert [i for i, _ in found] == list(range(len(order))), lines
  assert not [x for x in lines if PREFIX.match(x)]
  hparams = metrics.read_hparams(str(workdir))["hparams"]
  name, shown, microbatches, remat = found[1][1].groups()
  assert name == hparams["objective.name"]
  shown = dict(x.split(" ", 1) for x in shown.split(", "))
  for field in ("clip_low", "clip_high"):
    assert float(shown[field]) == pytest.approx(hparams[f"objective.{field}"])
  assert int(microbatches) == 1  # 8 rows of a few tokens fit rl.microbatch_tokens at once
  assert remat == ("full" if hparams["params"] >= AUTO_REMAT_PARAMS else "none")  # rl.remat=auto
  loop, compiling, wall = (_seconds(x) for x in found[11][1].groups())
  assert compiling <= loop <= wall


@pytest.mark.extended
def test_the_rl_step_compiling_and_its_first_update_are_announced_once(terminal):
  """`compiling the RL step` comes before the first update, then `RL step compiled; first update
  done in <s>s` (or `loaded from the compilation cache`) once, before the first progress line, counting from the first (not the
  evaluation before it); a finished workdir's relaunch compiles nothing and says neither."""
  workdir, lines, again = terminal
  compiling = [i for i, x in enumerate(lines) if x.startswith("compiling the RL step ")]
  done = [(i, x) for i, x in enumerate(lines) if re.match(BUILT, x)]
  first = next(i for i, x in enumerate(lines) if PROGRESS.match(x))
  assert len(compiling) == 1 and len(done) == 1 and compiling[0] < done[0][0] < first
  took = re.fullmatch(BUILT + r"first update done in (\d+\.\d)s", done[0][1])
  assert took, done
  loop = re.search(r"trained RL steps 0\.\.3 in (\S+) ", "\n".join(lines))
  assert float(took[1]) <= _seconds(loop[1]) + 0.5  # the loop's time is rounded to the second
  stamps = {}  # the two lines' times in the workdir's log.txt (absl's prefix: I1201 00:20:59.74)
  for line in (workdir / "log.txt").read_text().splitlines():
    for key in ("compiling the RL step", BUILT):
      if re.search(key, line) and key not in stamps:
        h, m, sec = line.split()[1].split(":")
        stamps[key] = 3600 * int(h) + 60 * int(m) + float(sec)
  between = stamps[BUILT] - stamps["compiling the RL step"]
  assert abs(float(took[1]) - between) < 0.3, (took[1], between)  # not the evaluation before
  assert not [x for x in again if "compiling the RL step" in x or re.match(BUILT, x)]


@pytest.mark.extended
def test_the_rate_and_eta_leave_the_compiling_update_out(terminal):
  """Logging every update: step 1's line has no rate or ETA (its only interval is the compiling
  one); later lines give a rate and the ETA of the 1000 steps' remainder at that rate (to the
  rounding of each), and the percentage done."""
  _, lines, _ = terminal
  head = re.compile(r"step (\d+)/1000 (\d+)% (\S+) steps/s ETA (\S+) \| ")
  shown = [m.groups() for m in map(head.match, lines) if m]
  assert [int(s) for s, *_ in shown] == [1, 2, 3], lines
  assert shown[0][2:] == ("?", "?"), shown[0]
  for step, pct, rate, eta in shown:
    assert int(pct) == round(100 * int(step) / 1000)
    if int(step) > 1:
      left = (1000 - int(step)) / float(rate)
      assert float(rate) > 0 and abs(_seconds(eta) - left) <= 0.5 + 0.01 * left, (step, rate, eta)


@pytest.mark.extended
def test_the_summary_rates_count_what_the_updates_after_the_first_generated(terminal):
  """The summary's generated tokens/s over its steps/s is the mean number of tokens generated
  per update after the first (compiling) one, as TensorBoard holds them; it trained steps 0..3,
  the last step TensorBoard has."""
  workdir, lines, _ = terminal
  scalars = metrics.read_scalars(str(workdir))
  trained = next(x for x in lines if x.startswith("trained RL steps "))
  rates = re.search(
    r"steps (\d+)\.\.(\d+) in .*\| (\S+) steps/s, (\S+) generated tokens/s ", trained
  )
  assert rates, trained
  start, end, steps_s, tokens_s = rates.groups()
  assert (int(start), int(end)) == (0, scalars["rollout/reward_mean"][-1][0]) == (0, 3)
  tokens = dict(scalars["perf/generated_tokens"])
  assert sorted(tokens) == [1, 2, 3]
  mean = (tokens[2] + tokens[3]) / 2  # the first update's tokens are not in the rate
  assert float(tokens_s) / float(steps_s) == pytest.approx(mean, rel=0.015), (trained, tokens)


def test_a_resume_loads_the_rl_step_its_first_invocation_compiled(tmp_path):
  """`train.compilation_cache=DIR`: the first invocation (1 of 2 steps) compiles the fused step
  and keeps it in DIR; the resume's invocation loads it from there and says so, and so does a
  run of another seed, clip range, temperature and learning rate in another workdir (the seed
  is in the state, and a single run takes those values as traced arguments of the program)."""
  workdir, cache = tmp_path / "run", tmp_path / "cache"
  args = ("--config.train.num_steps=2", "--config.train.eval_every=2")
  args += (f"--config.train.compilation_cache={cache}",)
  first = _run(workdir, *args, "--config.train.stop_after_steps=1")
  assert [x for x in first if x.startswith("RL step compiled; first update done in ")], first
  assert [p.name for p in cache.iterdir() if p.name.startswith("jit_fused_step-")]
  second = _run(workdir, *args)
  loaded = [x for x in second if re.match(BUILT, x)]
  assert loaded and loaded[0].startswith("RL step loaded from the compilation cache; "), second
  assert "step 2/2 " in "\n".join(second)
  point = (
    "--config.seed=1",
    "--config.objective.clip_high=0.28",
    "--config.sampling.temperature=0.9",
  )
  point += ("--config.optim.learning_rate=0.001", "--config.train.stop_after_steps=1")
  other = _run(tmp_path / "point", *args, *point)
  assert [x for x in other if x.startswith("RL step loaded from the compilation cache; ")], other
  kept = {p.name.rsplit("-", 1)[0] for p in cache.iterdir() if p.name.startswith("jit_fused_step-")}
  assert len(kept) == 1, kept  # one program, not one per point
  evals = {p.name.rsplit("-", 1)[0] for p in cache.iterdir() if p.name.startswith("jit_eval_fn-")}
  assert len(evals) == 1, evals  # the held-out evaluation's too, at either temperature


@pytest.mark.extended
def test_an_invocation_that_stop_after_steps_ends_says_so_and_its_resume_rates_leave_compiling_out(
  tmp_path,
):
  """`train.stop_after_steps=2` of 6 steps: the summary, then a line naming the step it stopped
  after, the step of its last evaluation (0) and that the same command resumes, then `last eval`.
  The second invocation (steps 2..4) evaluates nothing: its lines name the evaluation a launch
  before recorded. The third (4..6) compiles the held-out evaluation inside the RL loop (step
  5): its summary says the rates leave that compilation out, its evaluations run from the
  recorded one (step 0) to step 6, and it has no stop line."""
  workdir = tmp_path / "run"
  args = ("--config.train.num_steps=6", "--config.train.eval_every=5")
  first = _run(workdir, *args, "--config.train.stop_after_steps=2")
  stop = "stopped after step 2 of train.num_steps=6 (train.stop_after_steps=2); the last "
  stop += "evaluation was at step 0; the same command resumes from step 2"
  assert first[-2] == stop and first[-1].startswith("last eval: eval/accuracy="), first[-4:]
  assert "and the evaluation's compilation" not in next(x for x in first if "steps/s, " in x)
  second = _run(workdir, *args, "--config.train.stop_after_steps=2")
  stop = stop.replace("step 2 of", "step 4 of").replace("from step 2", "from step 4")
  assert second[-2] == stop and second[-1] == first[-1].replace(
    first[-1].split("; wall time")[1], second[-1].split("; wall time")[1]
  ), second[-4:]
  third = _run(workdir, *args, "--config.train.stop_after_steps=2")
  trained = next(x for x in third if x.startswith("trained RL steps 4..6 in "))
  assert trained.endswith(
    "after the first (compiling) step and the evaluation's compilation, evaluations and the "
    "last save in the time"
  )
  assert "of which 0:" in trained and "the first evaluation" not in trained  # resumed at 4
  assert not [x for x in third if x.startswith("stopped after step")], third[-4:]
  assert [x for x in third if x.startswith("eval from step 0 to 6: accuracy ")], third[-6:]
  evals = metrics.read_scalars(str(workdir))["eval/accuracy"]
  assert [s for s, _ in evals] == [0, 5, 6]


@pytest.mark.extended
def test_with_debug_a_terminal_keeps_absls_prefix(terminal):
  """With --debug, even on a (pseudo-)terminal each line keeps absl's prefix: the relaunch's
  banner and workdir lines from record.py, its `already holds` line from held_out.py, its final
  evaluation from main.py, with the step it holds and each evaluation tag's last value."""
  workdir, _, again = terminal
  assert all(PREFIX.match(x) for x in again), again[:5]
  source = {PREFIX.sub("", x): PREFIX.match(x)[1] for x in again}
  expected = {"jaxrl_llm ": "record.py", f"workdir {workdir} | watch it: ": "record.py"}
  expected |= {f"{workdir} already holds step 3 ": "held_out.py", "last eval: eval/": "main.py"}
  for start, file in expected.items():
    assert [f for line, f in source.items() if line.startswith(start)] == [file], (start, again)
  final = next(x for x in source if x.startswith("last eval: "))
  evals = {k: v for k, v in metrics.read_scalars(str(workdir)).items() if k.startswith("eval/")}
  assert evals and {v[-1][0] for v in evals.values()} == {3}
  shown = dict(x.split("=") for x in final.split(";")[0].removeprefix("last eval: ").split())
  assert shown == {k: f"{v[-1][1]:.4g}" for k, v in evals.items()}, final


def _launches(log_file) -> list[list[tuple[str, str, str]]]:
  """The (level letter, source file, message) of each prefixed line of a log file, a list per
  launch (each launch's lines follow its `### <time> <command>` line)."""
  sections = log_file.read_text().split("\n### ")[1:]
  return [[m.groups() for m in map(LOGGED.match, x.splitlines()) if m] for x in sections]


def _libraries(logged) -> set[str]:
  """The messages of the logged lines that a library's source file wrote."""
  return {message for _, file, message in logged if file not in OURS}


def _level_off(line: str) -> str:
  """A terminal line without the `warning: ` / `error: ` the terminal puts before its level."""
  return re.sub(r"^(warning|error|critical): ", "", line)


@pytest.mark.extended
def test_the_log_file_keeps_every_line_the_libraries_lines_only_there_unless_debug(terminal):
  """`<workdir>/log.txt` holds both launches, each line with absl's prefix: every line the
  terminal showed and the libraries' INFO lines (orbax's checkpoint manager among them), which
  the terminal left out; the --debug relaunch showed them on the terminal as well."""
  workdir, first, again = terminal
  launches = _launches(workdir / "log.txt")
  assert len(launches) == 2, launches
  for logged, shown in zip(launches, (first, _bare(again))):
    library = _libraries(logged)
    assert "checkpoint_manager.py" in {file for _, file, _ in logged}, logged[:20]
    assert library and {message for *_, message in logged} >= {_level_off(x) for x in shown}
  assert not _libraries(launches[0]) & set(first)
  assert not [x for x in first + again if x.startswith("INFO:absl:")]
  assert _libraries(launches[1]) <= set(_bare(again))


@pytest.fixture(scope="module")
def packed_sweep(tmp_path_factory):
  """(root, the lines a packed sweep of 2 runs x 2 steps prints to a pseudo-terminal, those of
  its relaunch once finished, with --debug)."""
  root = tmp_path_factory.mktemp("packed") / "sweep"
  cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), *SWEEP, f"--root={root}"]
  return root, _pty(cmd), _pty([*cmd, "--debug"])


@pytest.mark.extended
def test_a_packed_sweep_on_a_terminal_prints_plain_lines_and_logs_the_rest(packed_sweep):
  """A packed sweep on a terminal prints as a run does: no `INFO:absl:` or absl prefix, no
  library line; the pack's clock line, then each run's lines under its trial id, all within 80
  columns; one compile notice per program. `ROOT/log.txt` holds every logged line the
  terminal showed, with absl's prefix, and the libraries' INFO lines (orbax's)."""
  root, lines, _ = packed_sweep
  assert not [x for x in lines if x.startswith("INFO:absl:") or PREFIX.match(x)], lines
  for clip in CLIPS:
    assert f"[ch{clip} s0] step 2: reward " in "\n".join(lines)
  logged = _launches(root / "log.txt")[0]
  library = _libraries(logged)
  assert library and "checkpoint_manager.py" in {file for _, file, _ in logged}
  assert not library & set(lines), library & set(lines)
  messages = {message for *_, message in logged}
  assert [x for x in lines if x.startswith("[ch")]
  assert {x for x in lines if x.startswith("[ch")} <= messages
  # The progress and evaluation lines, a run's under its trial id, fit 80 columns (the closing
  # summary's lines are a run's own, as long as a run alone prints them).
  own = [(x, x.split("] ", 1)[-1] if x.startswith("[ch") else x) for x in lines]
  assert all(len(x) <= 80 for x, y in own if y.startswith(("step ", "eval step"))), lines
  # One compile notice per program (the RL step, the evaluation), not one per run.
  for notice in ("compiling the RL step", BUILT, "compiling the held-out evaluation"):
    assert len([x for x in lines if re.match(notice, x)]) == 1, (notice, lines)


@pytest.mark.extended
def test_with_debug_a_packed_sweep_shows_the_library_lines(packed_sweep):
  """With --debug the relaunch's terminal shows the libraries' lines its log section holds
  (orbax restoring the pack), with absl's prefix; its own lines keep the prefix too."""
  root, _, again = packed_sweep
  logged = _launches(root / "log.txt")[1]
  assert _libraries(logged) and _libraries(logged) <= set(_bare(again))
  assert any(PREFIX.match(x) and "nothing to train" in x for x in again), again
  assert not [x for x in again if x.startswith("INFO:absl:")]


UNAWAITED_SCRIPT = """
import asyncio, gc, sys
from jaxrl_llm import terminal
terminal.setup(debug=sys.argv[2] == "debug", log_file=sys.argv[1])
async def write():
  raise OSError(28, "No space left on device")
async def fragment():
  pass
unstarted = fragment()  # a write never awaited: a RuntimeWarning as it is collected
async def save():  # background writes whose failures nobody awaits: a task and a gathering
  return loop.create_task(write()), asyncio.gather(write(), write())
loop = asyncio.new_event_loop()
pending = loop.run_until_complete(save())
loop.run_until_complete(asyncio.sleep(0.01))
loop.close()
print("error: disk full", file=sys.stderr, flush=True)
del pending, unstarted
gc.collect()  # asyncio reports each unawaited failure as its future is collected
"""


@pytest.mark.parametrize("mode", ["plain", "debug"])
def test_an_unawaited_background_failure_stays_in_the_log_file_unless_debug(tmp_path, mode):
  """asyncio's "Task exception was never retrieved" and a coroutine's "never awaited" warning (a
  failed save's sibling writes, collected as the process exits) never follow the run's one
  error line on the terminal; the log file keeps them, and --debug shows them."""
  log = tmp_path / "log.txt"
  cmd = [sys.executable, "-c", UNAWAITED_SCRIPT, str(log), mode]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  unawaited = ("Task exception was never retrieved", "_GatheringFuture exception was never")
  unawaited += ("coroutine 'fragment' was never awaited",)
  assert all(x in log.read_text() for x in unawaited)
  shown = [x in proc.stderr for x in unawaited]
  assert shown == [mode == "debug"] * 3, proc.stderr[-3000:]
  if mode == "plain":
    assert proc.stderr.strip().splitlines()[-1] == "error: disk full", proc.stderr[-3000:]


def test_a_summary_of_one_step_gives_no_rate_rather_than_nan(caplog):
  """A run (or a resumed one) that makes one update has no update after the compiling one to
  time: its summary said "nan steps/s, nan generated tokens/s"; it says so in words now."""
  import logging

  from jaxrl_llm.run import record

  with caplog.at_level(logging.INFO):
    record.log_summary("/w", "/w/checkpoints", (4, 5), (9.0, 1.0, 8.0, 8.5), 640.0, [])
  trained = next(r.getMessage() for r in caplog.records if "trained RL steps" in r.getMessage())
  assert "nan" not in trained and trained.endswith(
    "| 1 step: no rate after the first (compiling) one"
  )
  caplog.clear()
  with caplog.at_level(logging.INFO):
    record.log_summary("/w", "/w/checkpoints", (0, 3), (9.0, 1.0, 3.0, 7.0), 640.0, [])
  trained = next(r.getMessage() for r in caplog.records if "trained RL steps" in r.getMessage())
  assert trained.endswith(
    "| 0.5 steps/s, 160 generated tokens/s after the first (compiling) step, evaluations and "
    "the last save in the time"
  )
  assert "of which 0:00:02 the first evaluation, compiling and the first step" in trained


def _parser(**kwargs) -> ArgParser:
  """A command line with options of every kind: single-valued, appended, counted, in a group."""
  p = ArgParser(prog="tool", **kwargs)
  p.add_argument("-n", "--num", type=int)
  p.add_argument("--root")
  p.add_argument("--args", help="a value that may look like a flag")
  p.add_argument("--flag", action="store_true")
  p.add_argument("--mode", action="store_const", const="fast")
  p.add_argument("--color", action=argparse.BooleanOptionalAction)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--tag", action="append_const", const="t", dest="tags", default=[])
  p.add_argument("--more", action="extend", nargs="+", default=[])
  p.add_argument("-v", action="count", default=0)
  p.add_argument_group("group").add_argument("--grouped")
  p.add_argument("rest", nargs="*")
  return p


def _refused(capsys, argv: list[str], **kwargs) -> str:
  """`argv` parsed by `_parser` ends with exit status 2 and one `error:` line; the line."""
  with pytest.raises(SystemExit) as stop:
    _parser(**kwargs).parse_args(argv)
  assert stop.value.code == 2
  out, err = capsys.readouterr()
  assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
  return err.strip()


@pytest.mark.parametrize(
  "argv, says",
  [
    (["--root=/nonexistent", "--root=/tmp/x"], "--root is given twice (/nonexistent, /tmp/x)"),
    (["--root", "a", "--root", "b"], "--root is given twice (a, b)"),
    (["--root=a", "x", "--root", "b"], "--root is given twice (a, b)"),
    (["-n", "3", "--num=4"], "-n/--num is given twice (3, 4)"),
    (["-n3", "-n", "4"], "-n/--num is given twice (3, 4)"),
    (["--ro=a", "--root=b"], "--root is given twice (a, b)"),  # an abbreviation
    (["--nu", "3", "-n4"], "-n/--num is given twice (3, 4)"),
    (["--root=a b", "--root=c"], "--root is given twice ('a b', c)"),
    (["--flag", "--flag"], "--flag is given twice: give it once"),
    (["--mode", "--mode"], "--mode is given twice"),
    (["--color", "--no-color"], "--color/--no-color is given twice"),
    (["--grouped=1", "--grouped=2"], "--grouped is given twice (1, 2)"),
    (["--args=--root=x", "--args=-n"], "--args is given twice (--root=x, -n)"),
  ],
)
def test_an_option_of_one_value_given_twice_is_one_error_line_naming_it_and_both_values(
  capsys, argv, says
):
  line = _refused(capsys, argv)
  assert says in line and line.endswith(": give it once"), line


def test_a_repeated_option_is_the_tools_own_error_or_an_argument_error_as_asked():
  with pytest.raises(ValueError, match=r"^--root is given twice \(a, b\): give it once$"):
    _parser(raise_as=ValueError).parse_args(["--root=a", "--root=b"])
  with pytest.raises(argparse.ArgumentError, match=r"^--root is given twice"):
    _parser(exit_on_error=False).parse_args(["--root=a", "--root=b"])


def test_without_abbreviations_a_prefix_is_no_occurrence_of_the_option(capsys):
  line = _refused(capsys, ["--ro=a", "--root=b"], allow_abbrev=False)
  assert "unrecognized arguments: --ro=a" in line, line


def test_append_extend_and_count_options_may_repeat_and_a_value_like_a_flag_is_no_option():
  repeated = ["--set=a", "--set", "b", "--tag", "--tag", "--more", "x", "--more=y", "-vv", "-v"]
  after = ["--", "--root=z", "-n", "5", "--flag", "--flag"]
  args = _parser().parse_args([*repeated, "--args=--root=x", "--root=y", *after])
  assert args.set == ["a", "b"] and args.tags == ["t", "t"] and args.more == ["x", "y"]
  assert args.v == 3 and args.args == "--root=x" and args.root == "y" and args.num is None
  assert args.rest == ["--root=z", "-n", "5", "--flag", "--flag"] and not args.flag


class _Joined(argparse.Action):
  """A custom action that gathers its values itself, so says it may repeat."""

  repeatable = True

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, (getattr(namespace, self.dest) or "") + values)


def test_a_custom_action_repeats_only_when_its_class_says_so(capsys):
  p = ArgParser(prog="tool")
  p.add_argument("--joined", action=_Joined)
  assert p.parse_args(["--joined=a", "--joined", "b"]).joined == "ab"
  _Joined.repeatable = False
  try:
    with pytest.raises(SystemExit):
      p.parse_args(["--joined=a", "--joined", "b"])
  finally:
    _Joined.repeatable = True
  assert capsys.readouterr().err == "error: --joined is given twice (a, b): give it once\n"


def test_each_parse_counts_afresh():
  p = _parser()
  assert p.parse_args(["--root=a"]).root == "a"
  assert p.parse_args(["--root=b"]).root == "b"
  assert p.parse_intermixed_args(["x", "--root=c", "y"]).rest == ["x", "y"]


def test_a_sub_commands_option_given_twice_is_one_error_line(capsys):
  p = ArgParser(prog="tool")
  p.add_argument("--root")
  sub = p.add_subparsers(dest="command", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--debug", action="store_true")
  one = sub.add_parser("one", parents=[common])
  one.add_argument("--out")
  one.add_argument("--set", action="append", default=[])
  assert isinstance(one, ArgParser)
  args = p.parse_args(["--root=r", "one", "--out=o", "--set=a", "--set=b", "--debug"])
  assert (args.root, args.out, args.set, args.debug) == ("r", "o", ["a", "b"], True)
  for argv, says in [
    (["one", "--out=a", "--out", "b"], "--out is given twice (a, b)"),
    (["one", "--debug", "--debug"], "--debug is given twice"),
    (["--root=a", "--root=b", "one"], "--root is given twice (a, b)"),
  ]:
    with pytest.raises(SystemExit) as stop:
      p.parse_args(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {says}"), err


def test_a_tool_given_an_option_twice_says_so_in_one_line(tmp_path):
  """tools/compare.py, which read the last --root alone; tools/launch_local.py, whose command
  after `--` may repeat what it likes."""
  cmd = [sys.executable, "tools/compare.py", f"--root={tmp_path / 'a'}", f"--root={tmp_path}"]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
  assert proc.stderr.splitlines() == [
    f"error: --root is given twice ({tmp_path / 'a'}, {tmp_path}): give it once"
  ]
  launch = [sys.executable, "tools/launch_local.py", "--processes=1"]
  cmd = [*launch, "--", sys.executable, "-c", "import sys; print(sys.argv[1:])", "-n=1", "-n=2"]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "['-n=1', '-n=2']" in proc.stdout, proc.stdout + proc.stderr
  proc = subprocess.run(
    [*launch, "--processes=2", "--", "true"],
    cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
  assert len(proc.stderr.splitlines()) == 1, proc.stderr
  assert proc.stderr.startswith("error: --processes is given twice (1, 2): give it once")
