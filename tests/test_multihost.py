"""Several processes, one global mesh (`tools/launch_local.py`): 2 processes x 4 fake CPU
devices give the metrics and parameters of 1 process x 8 devices; checkpoints written by all
processes together resume after every process is killed; the host-reward path scores each
process's rows; a pack's runs axis split over the processes equals the pack on one process;
mismatched configs and an unreachable coordinator stop with one clear line; a
process interrupted mid-run ends the job at once, its peer naming it and why; a program's first
run waits for a process that arrives late (past gloo's 30 s rendezvous)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from conftest import REPO, cli_env, default_sigint, tiny_config
from parsed import build, take_out
from text_fixtures import build_bpe_tokenizer, write_math_jsonl

from jaxrl_llm import checkpoint, checkpoint_manifest, metrics

TINY = {
  "model.d_model": 32,
  "model.mlp_dim": 64,
  "model.num_heads": 2,
  "model.num_kv_heads": 1,
  "rl.num_prompts": 8,
  "sampling.group_size": 4,
  "rl.num_minibatches": 2,
  "task.eval_size": 16,
  "train.eval_every": 100,
  "train.log_every": 1,
  "train.pass_k": 2,
  "sft.steps": 0,
  "mesh.data": -1,
}
COMPARED = ("policy/loss", "optim/grad_norm", "rollout/reward_mean", "policy/entropy")


def _config_file(tmp_path, extra: dict, name="cfg.py", body: str = "") -> str:
  """A config file: configs/default.py with `TINY`, `extra` and `body` applied."""
  path = tmp_path / name
  sets = "\n".join(f"  c.{k} = {v!r}" for k, v in {**TINY, **extra}.items())
  path.write_text(
    textwrap.dedent(
      f"""\
      import importlib.util
      import ml_collections

      def get_config():
        spec = importlib.util.spec_from_file_location("d", {str(REPO / "configs" / "default.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        c = module.get_config()
      """
    )
    + sets
    + "\n"
    + textwrap.indent(textwrap.dedent(body), "  ")
    + "\n  return c\n"
  )
  return str(path)


def _why(out: str, limit: int = 8000) -> str:
  """What a failed launch printed that says why: absl error and fatal lines, Python tracebacks
  (and a fatal error's thread stacks) with their exception lines, and the last lines, without
  the C++ stack frames a fatal error dumps (they used to fill the whole message)."""
  keep, in_traceback = [], False
  for line in out.splitlines():
    body = re.sub(r"^\[\d+\] ", "", line)
    if body.lstrip().startswith("@ ") or body.startswith("Extension modules"):
      continue
    in_traceback = in_traceback or body.startswith("Traceback") or "most recent call" in body
    if in_traceback or re.match(r"[EF]\d{4} ", body) or "rror" in body:
      keep.append(line)
    if in_traceback and (not body.strip() or re.match(r"[\w.]*(Error|Exception)\b", body)):
      in_traceback = False
  tail = [ln for ln in out.splitlines()[-15:] if "     @ " not in ln]
  text = "\n".join([*keep, "--- last lines:", *tail])
  return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2 :]


def _launch(processes, config, workdir, *args, wait=True):
  env = cli_env()
  cmd = [
    sys.executable,
    str(REPO / "tools" / "launch_local.py"),
    f"--processes={processes}",
    f"--devices_per_process={8 // processes}",
    "--",
    sys.executable,
    "-m",
    "jaxrl_llm.main",
    f"--config={config}",
    f"--workdir={workdir}",
    "--distributed",
    *args,
  ]
  proc = subprocess.Popen(
    cmd,
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  if not wait:
    return proc
  out = proc.communicate(timeout=900)[0]
  return proc.returncode, out


def _final_params(workdir, step, config):
  abstract = build(config, abstract=True).state  # shardings over this process's devices
  with checkpoint.Checkpointer(workdir, save_every=1) as ckpt:
    return ckpt.restore(step, abstract)[0].params


def _assert_same_runs(a, b, steps, config, keys=COMPARED):
  sa, sb = metrics.read_scalars(str(a)), metrics.read_scalars(str(b))
  for key in keys:
    va, vb = [v for s, v in sa[key]], [v for s, v in sb[key]]
    assert len(va) == len(vb) == steps, key
    np.testing.assert_allclose(va, vb, rtol=2e-5, atol=1e-6, err_msg=key)
  pa, pb = _final_params(a, steps, config), _final_params(b, steps, config)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def _tiny_config(**extra):
  return tiny_config(**{**TINY, **extra})


@pytest.mark.slow
def test_several_processes_equal_one_process_and_resume_after_a_kill(tmp_path):
  # 2 processes; 4 (a run's rows over processes of a group) in the runs-axis pack test below.
  processes = 2
  run = {"train.num_steps": 6, "train.checkpoint_every": 2}
  config = _config_file(tmp_path, run)
  one, two, killed = tmp_path / "one", tmp_path / "many", tmp_path / "killed"
  rc, out = _launch(1, config, one)
  assert rc == 0, _why(out)
  rc, out = _launch(processes, config, two)
  assert rc == 0, _why(out)
  assert all(f"[{i}]" in out for i in range(processes))
  _assert_same_runs(one, two, 6, _tiny_config(**run))
  # TensorBoard events come from process 0 only: one event file per run.
  assert len([p for p in two.iterdir() if p.name.startswith("events.")]) == 1

  # Kill every process once step 4 is committed, relaunch, and end where `two` ended.
  proc = _launch(2, config, killed, wait=False)
  root = killed / "checkpoints"
  deadline = time.monotonic() + 600
  while not (root / "4" / "commit_success.txt").exists() and time.monotonic() < deadline:
    assert proc.poll() is None, _why(proc.stdout.read())
    time.sleep(0.05)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  rc, out = _launch(2, config, killed)
  assert rc == 0, _why(out)
  assert "resumed from" in out
  pa, pb = _final_params(two, 6, _tiny_config(**run)), _final_params(killed, 6, _tiny_config(**run))
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.extended
def test_two_processes_train_in_a_bucket_and_resume_from_it_as_in_a_local_workdir(tmp_path):
  """`gs://` and `--distributed` together (an emulated bucket): 2 processes x 4 devices write
  config.json, one event file per launch (process 0's) and checksummed checkpoints there; the
  relaunch resumes from the bucket's step 2, and its updates 3-4 are those of the same run
  uninterrupted in a local workdir (which they can only be if step 2 was restored exactly)."""
  pytest.importorskip("gcsfs")
  pytest.importorskip("gcp_storage_emulator")
  from gcs_emulator import GcsEmulator

  from jaxrl_llm import paths

  run = {"train.num_steps": 4, "train.checkpoint_every": 2}
  config = _config_file(tmp_path, run)
  rc, out = _launch(2, config, tmp_path / "local")
  assert rc == 0, _why(out)
  with GcsEmulator("bucket") as gcs:
    workdir = gcs.url("run")
    rc, out = _launch(2, config, workdir, "--config.train.stop_after_steps=2")
    assert rc == 0, _why(out)
    rc, out = _launch(2, config, workdir)
    assert rc == 0 and "resumed from" in out, _why(out)
    names = {p.name for p in paths.listdir(workdir)}
    steps = sorted(int(p.name) for p in paths.listdir(paths.join(workdir, "checkpoints")))
    for step in steps:
      step_dir = paths.join(workdir, "checkpoints", str(step))
      assert paths.exists(paths.join(step_dir, "checksums.json"))
      assert checkpoint_manifest.verify_manifest(step_dir) is None
    bucket = metrics.read_scalars(workdir)
  assert steps == [2, 4] and "config.json" in names
  assert len([n for n in names if n.startswith("events.")]) == 2  # one per launch
  local = metrics.read_scalars(str(tmp_path / "local"))
  for key in COMPARED:
    assert [s for s, _ in bucket[key]] == [1, 2, 3, 4], key
    np.testing.assert_allclose(
      [v for _, v in bucket[key]], [v for _, v in local[key]], rtol=1e-6, err_msg=key
    )


SKEWED = """
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxrl_llm import distributed

distributed.initialize()
mesh = jax.make_mesh((jax.device_count(),), ("data",))
local = np.full((jax.local_device_count(),), jax.process_index() + 1.0, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
if sys.argv[1] == "lockstep":
  total = distributed.program(total, "total", "the total")
if jax.process_index() == 1:
  time.sleep(float(sys.argv[2]))  # a process that compiles while process 0 loads from a cache
try:
  print("sums", float(total(x)), float(total(x * 2)), flush=True)
except Exception as err:
  print("failed:", str(err).splitlines()[0], flush=True)
  os._exit(3)
"""


@pytest.mark.extended
@pytest.mark.parametrize("program", ["lockstep", "bare"])
def test_a_programs_first_run_waits_for_a_process_that_arrives_late(tmp_path, program):
  # After a relaunch process 0 loads the step from the compilation cache (only it writes one)
  # while its peers compile: they reach the first collective tens of seconds apart, past
  # gloo's 30 s rendezvous. A `Program` compiles, then waits in a barrier of the
  # coordination service; a bare jitted one fails (the control: the skew is past the limit).
  script = tmp_path / "skewed.py"
  script.write_text(SKEWED)
  cmd = [sys.executable, str(REPO / "tools" / "launch_local.py"), "--processes=2"]
  cmd += ["--devices_per_process=2", "--", sys.executable, str(script), program, "40"]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
  out = proc.stdout + proc.stderr
  if program == "lockstep":
    assert proc.returncode == 0, _why(out)
    assert out.count("sums 6.0 12.0") == 2, _why(out)  # 2 x 1 + 2 x 2; the rerun: no barrier
  else:
    assert proc.returncode != 0 and "failed:" in out, _why(out)
    assert "Gloo context initialization failed" in out, _why(out)


def _math_file_config(tmp_path, steps: int, more: dict | None = None) -> str:
  """A config file of a tiny run on a JSONL math file (host verifiers) of `steps` RL steps,
  evaluated and checkpointed at the last (`more`: further fields)."""
  tok = build_bpe_tokenizer(tmp_path / "tok")
  write_math_jsonl(tmp_path / "math.jsonl", n=48)
  extra = {
    "data.train_files": str(tmp_path / "math.jsonl"),
    "data.tokenizer": str(tok),
    "data.template": "qwen_math_chat",
    "data.prompt_len": 128,
    "data.eval_fraction": 0.25,
    "sampling.max_new_tokens": 12,
    "model.vocab_size": 512,
    "task.eval_size": 8,
    "train.num_steps": steps,
    "train.eval_every": steps,
    "train.checkpoint_every": steps,
    **(more or {}),
  }
  body = 'c.task.reward_weights = ml_collections.ConfigDict({"math_correct": 1.0, "math_format_boxed": 0.5})'
  return _config_file(tmp_path, extra, body=body)


def _start_direct(index, port, config, workdir, *args, **popen):
  """Process `index` of a 2-process job (4 fake devices each) started without the launcher,
  which would stop the other process itself when one fails."""
  cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={config}"]
  return _start_process(
    index, port, [*cmd, f"--workdir={workdir}", "--distributed", *args], **popen
  )


def _start_process(index, port, cmd, **popen):
  """Process `index` of a 2-process job (4 fake devices each) running `cmd`."""
  env = cli_env()
  env.update(
    JAXRL_LLM_COORDINATOR=f"localhost:{port}",
    JAXRL_LLM_NUM_PROCESSES="2",
    JAXRL_LLM_PROCESS_ID=str(index),
    XLA_FLAGS=f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count=4".strip(),
    JAX_PLATFORMS="cpu",
  )
  return subprocess.Popen(cmd, cwd=REPO, env=env, text=True, **popen)


@pytest.mark.slow
def test_processes_started_with_different_configs_stop_with_a_clear_line(tmp_path):
  config = _config_file(tmp_path, {"train.num_steps": 2})
  port = 20000 + os.getpid() % 20000
  procs = [
    _start_direct(
      i, port, config, tmp_path / "run", f"--config.seed={seed}", stderr=subprocess.PIPE
    )
    for i, seed in enumerate((0, 1))
  ]
  errs = [p.communicate(timeout=300)[1] for p in procs]
  for p, err in zip(procs, errs):
    assert p.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: processes [1] were started with a config that differs"), last


@pytest.mark.extended
@pytest.mark.parametrize("stopped", [1, 0])  # 0 also hosts the coordination service
def test_one_interrupted_process_ends_the_job_with_its_reason_on_every_process(tmp_path, stopped):
  """Ctrl-C on one host of a running job: that process says so in one line and exits 130 at
  once (not after JAX's 5-minute shutdown barrier, which waits for peers that wait for it),
  and its peer, waiting in a collective for it, stops with one line naming it and why."""
  config = _config_file(tmp_path, {"train.num_steps": 500, "train.checkpoint_every": 1000})
  port = 20000 + (os.getpid() + 7919 * (stopped + 1)) % 20000
  logs = [tmp_path / f"{i}.log" for i in (0, 1)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, "w") as f:
      procs.append(
        _start_direct(
          i, port, config, tmp_path / "run", stdout=f, stderr=f, preexec_fn=default_sigint
        )
      )
  peer = 1 - stopped
  try:
    deadline = time.monotonic() + 600
    while "step 2/500" not in logs[stopped].read_text():
      assert all(p.poll() is None for p in procs), _why(logs[0].read_text() + logs[1].read_text())
      assert time.monotonic() < deadline, _why(logs[stopped].read_text())
      time.sleep(0.1)
    procs[stopped].send_signal(signal.SIGINT)
    assert procs[stopped].wait(timeout=60) == 130, _why(logs[stopped].read_text())
    last = logs[stopped].read_text().strip().splitlines()[-1]
    assert last.startswith("stopped by SIGINT (Ctrl-C)") and "on every process" in last, last
    assert procs[peer].wait(timeout=60) == 1, _why(logs[peer].read_text())
    last = logs[peer].read_text().strip().splitlines()[-1]
    assert last.startswith(f"error: process {stopped} of 2 stopped (stopped by SIGINT"), last
    assert last.endswith(
      "this process stops too: relaunch the same command on every process to resume"
    )
  finally:
    for p in procs:
      p.kill()


SIGTERM_RUN = {"train.num_steps": 500, "train.checkpoint_every": 1000, "train.eval_every": 1000}


def _sigterm_one_of_two(tmp_path, commands, progress: str) -> int:
  """Starts the 2 processes of `commands` (one command line each), sends SIGTERM to process 1
  alone once its log shows `progress`, and asserts that both stop after the same step, each
  with the one line and exit status 143; returns that step."""
  port = 20000 + (os.getpid() * 31 + len(progress)) % 20000
  logs = [tmp_path / f"term{i}.log" for i in (0, 1)]
  procs = []
  try:
    for i, log in enumerate(logs):
      with open(log, "w") as f:
        procs.append(_start_process(i, port, commands[i], stdout=f, stderr=f))
    deadline = time.monotonic() + 600
    while progress not in logs[1].read_text():
      assert all(p.poll() is None for p in procs), _why(logs[0].read_text() + logs[1].read_text())
      assert time.monotonic() < deadline, _why(logs[1].read_text())
      time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    steps = []
    for p, log in zip(procs, logs):
      assert p.wait(timeout=300) == 143, _why(log.read_text())
      stops = [ln for ln in log.read_text().splitlines() if ln.startswith("stopped by SIGTERM")]
      match = re.match(
        r"stopped by SIGTERM after step (\d+): checkpoint \1 is saved in ", stops[-1]
      )
      steps.append(int(match.group(1)))
  finally:
    for p in procs:
      p.kill()
  assert steps[0] == steps[1] and 3 <= steps[0] < 500, steps
  return steps[0]


@pytest.mark.extended
def test_sigterm_to_one_process_stops_every_process_after_the_same_saved_step(tmp_path):
  """A preemption notice that reaches one host of a job (JAX's preemption service tells the
  others): both processes stop after the same step, saved, and the job resumes from it."""
  config = _config_file(tmp_path, SIGTERM_RUN)
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={config}", f"--workdir={workdir}"]
  step = _sigterm_one_of_two(tmp_path, [[*cmd, "--distributed"]] * 2, "step 3/500")
  assert _committed(workdir / "checkpoints") == [step]
  rc, out = _launch(2, config, workdir, "--config.train.stop_after_steps=2")
  assert rc == 0 and f"at step {step}" in out, _why(out)
  assert max(_committed(workdir / "checkpoints")) == step + 2


@pytest.mark.extended
def test_sigterm_to_one_process_of_a_packed_sweep_stops_the_pack_after_a_saved_step(tmp_path):
  """The same for a pack whose runs axis spans the two processes: each process saves its own
  runs after the same step, exits 143, and the same command resumes the pack."""
  config = _config_file(tmp_path, {**SIGTERM_RUN, "mesh.runs": 2})
  root = tmp_path / "pack"
  cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), f"--config={config}", f"--root={root}"]
  cmd += ["--packed", "--distributed", *(f"--grid={g}" for g in GRID)]
  step = _sigterm_one_of_two(tmp_path, [cmd] * 2, "step 3/500 ")  # the pack's clock line
  assert _committed(root / "checkpoints") == [step]
  longer = _config_file(tmp_path, {**SIGTERM_RUN, "mesh.runs": 2, "train.stop_after_steps": 2})
  rc, out = _launch_pack(2, longer, root, *GRID)
  assert rc == 0 and f"resumed from {root} at step {step}" in out, _why(out)
  assert max(_committed(root / "checkpoints")) == step + 2


def _committed(directory) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_a_mesh_that_does_not_divide_the_devices_stops_every_process(tmp_path):
  config = _config_file(tmp_path, {"train.num_steps": 2, "mesh.data": 3})
  rc, out = _launch(2, config, tmp_path / "run")
  assert rc == 2, out[-3000:]
  for i in (0, 1):
    mine = [line for line in out.splitlines() if line.startswith(f"[{i}] ")]
    assert "mesh" in mine[-1] and "8" in mine[-1], mine[-3:]


@pytest.mark.slow
def test_an_unreachable_coordinator_stops_with_a_clear_line(tmp_path):
  config = _config_file(tmp_path, {"train.num_steps": 2})
  env = cli_env()
  env.update(
    JAXRL_LLM_COORDINATOR="localhost:9",  # process 1 of 2: waits for a process 0 that never runs
    JAXRL_LLM_NUM_PROCESSES="2",
    JAXRL_LLM_PROCESS_ID="1",
    JAX_PLATFORMS="cpu",
  )
  cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={config}"]
  cmd += [f"--workdir={tmp_path / 'run'}", "--distributed", "--join_timeout_s=5"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: could not join the multi-process job through the coordinator")
  assert "localhost:9" in last and "within 5 s" in last


def _launch_pack(processes, config, root, *grid):
  """`tools/sweep.py --packed --distributed` over `grid` on `processes` processes (8 fake
  devices in all); (exit status, output)."""
  cmd = [sys.executable, str(REPO / "tools" / "launch_local.py"), f"--processes={processes}"]
  cmd += [f"--devices_per_process={8 // processes}", "--", sys.executable]
  cmd += [str(REPO / "tools" / "sweep.py"), f"--config={config}", f"--root={root}"]
  cmd += ["--packed", "--distributed", *(f"--grid={g}" for g in grid)]
  try:
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
  except subprocess.TimeoutExpired as e:  # what it printed says where it stood
    return 124, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {e.timeout} s"
  return proc.returncode, proc.stdout + proc.stderr


def test_a_pack_refused_on_two_processes_leaves_no_run_records(tmp_path):
  """A pack refused before it trains (sampling.tool varied) on two processes: process 0 left the
  job at once, keeping the run.json it had just written in each run's folder, so a corrected
  command was refused for settings no run trained with. The root keeps only its logs."""
  config = _config_file(tmp_path, {"train.num_steps": 2, "mesh.runs": 2})
  root = tmp_path / "pack"
  rc, out = _launch_pack(2, config, root, "sampling.tool=none,calculator")
  assert rc == 2 and "a pack cannot vary sampling.tool" in out, _why(out)
  assert sorted(p.name for p in root.iterdir()) == ["log.1.txt", "log.txt"], _why(out)


GRID = ("objective.clip_high=0.2,0.28", "sampling.temperature=0.7,1.0")
NAMES = [
  f"objective.clip_high={c},sampling.temperature={t}" for c in (0.2, 0.28) for t in (0.7, 1.0)
]


def _launch_packs(config, roots: dict, grid=GRID, expect: str = "") -> None:
  """The packed sweep `grid` of `config` on n processes into `roots[n]`, for each n; each
  launch must exit 0 and print `expect`."""
  for n, root in roots.items():
    rc, out = _launch_pack(n, config, root, *grid)
    assert rc == 0 and expect in out, _why(out)


def _assert_same_packs(a, b, names, keys, steps):
  for name in names:
    sa, sb = metrics.read_scalars(str(a / name)), metrics.read_scalars(str(b / name))
    for key in keys:
      va, vb = [v for _, v in sa[key]], [v for _, v in sb[key]]
      assert len(va) == len(vb) == steps, (name, key)
      np.testing.assert_allclose(va, vb, rtol=2e-5, atol=1e-6, err_msg=f"{name} {key}")
    assert sa["eval/accuracy"] == sb["eval/accuracy"], name


@pytest.mark.extended
def test_a_prompt_file_pack_on_two_processes_scores_each_process_rows_as_one_process(tmp_path):
  names = [f"sampling.temperature={t}" for t in (0.7, 1.0)]
  roots = {1: tmp_path / "one", 2: tmp_path / "two"}
  _launch_packs(_math_file_config(tmp_path, 2), roots, grid=("sampling.temperature=0.7,1.0",))
  keys = ("policy/loss", "rollout/reward_mean", "reward/math_format_boxed", "verifier/errors")
  _assert_same_packs(roots[1], roots[2], names, keys, 2)


@pytest.mark.extended
def test_a_pack_whose_runs_axis_spans_the_processes_equals_it_on_one_and_resumes(tmp_path):
  # 4 runs over mesh.runs=2 device groups of 4 devices: on 2 processes each process holds one
  # group (2 runs, all their rows), on 4 each group spans 2 processes (each feeds half of the
  # rows of its group's runs); the supervised warm start runs on the same mesh first.
  # Each launch stops after 4 steps of 6: the relaunch runs the program the first compiled.
  run = {"train.num_steps": 6, "train.stop_after_steps": 4, "train.checkpoint_every": 2}
  run.update({"train.eval_every": 2, "mesh.runs": 2, "sft.steps": 2})
  config = _config_file(tmp_path, run)
  roots = {n: tmp_path / f"p{n}" for n in (1, 2, 4)}
  _launch_packs(config, roots)
  _assert_same_packs(roots[1], roots[2], NAMES, COMPARED, 4)
  _assert_same_packs(roots[1], roots[4], NAMES, COMPARED, 4)
  # Events come from process 0 only: one event file per run.
  assert all(
    len([p for p in (roots[2] / n).iterdir() if p.name.startswith("events.")]) == 1 for n in NAMES
  )
  # Two more steps from each one's step-4 checkpoint (every process restores its runs' state
  # and data positions).
  _launch_packs(config, {n: roots[n] for n in (1, 2)}, expect="resumed from")
  _assert_same_packs(roots[1], roots[2], NAMES, COMPARED, 6)
  # One process cannot take a run out of it: each process saved only its own runs' positions.
  configs = [
    _tiny_config(
      **{**run, "train.num_steps": 6, "objective.clip_high": c, "sampling.temperature": t}
    )
    for c in (0.2, 0.28)
    for t in (0.7, 1.0)
  ]
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"process_0-of-1\.json"):
    take_out(configs, str(roots[2]), NAMES[0], str(tmp_path / "out"), names=NAMES)
  assert not (tmp_path / "out").exists()
  # Nor can the two processes that trained it: each refuses in one line before reading.
  script = tmp_path / "take_out.py"
  script.write_text(TAKE_OUT)
  cmd = [sys.executable, str(REPO / "tools" / "launch_local.py"), "--processes=2"]
  cmd += ["--devices_per_process=4", "--", sys.executable, str(script), config, str(roots[2])]
  cmd += [str(tmp_path / "out"), *NAMES]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
  refusals = [ln for ln in proc.stdout.splitlines() if "error: take_out needs every run's" in ln]
  assert proc.returncode == 0 and len(refusals) == 2, _why(proc.stdout + proc.stderr)
  assert not (tmp_path / "out").exists()


TAKE_OUT = """
import importlib.util, sys
from jaxrl_llm import distributed
from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.run.packed import take_out

distributed.initialize(120)
config, root, out, *names = sys.argv[1:]
spec = importlib.util.spec_from_file_location("config", config)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
configs = []
for clip in (0.2, 0.28):
  for temperature in (0.7, 1.0):
    cfg = module.get_config()
    cfg.objective.clip_high, cfg.sampling.temperature = clip, temperature
    configs.append(parse(cfg))
try:
  take_out(configs, root, names[0], out, names=names)
except ConfigError as e:
  print(f"error: {e}", flush=True)
"""


@pytest.mark.extended
def test_a_prompt_file_pack_with_two_device_groups_on_each_process_scores_as_one_process(
  tmp_path,
):
  # mesh.runs=4 on 2 processes: each process holds 2 groups (2 runs), scores those runs'
  # completions alone and reports 0 verifier counts for the others.
  roots = {1: tmp_path / "one", 2: tmp_path / "two"}
  _launch_packs(_math_file_config(tmp_path, 2, {"mesh.runs": 4}), roots)
  keys = ("policy/loss", "rollout/reward_mean", "reward/math_correct", "verifier/errors")
  _assert_same_packs(roots[1], roots[2], NAMES, keys, 2)
