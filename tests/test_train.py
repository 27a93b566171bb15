"""End-to-end trainer: TensorBoard tags, resume determinism, compile-once, sharded == single device."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, cli_env, lowerings, run_steps, tiny_config
from parsed import build, train_and_evaluate

from jaxrl_llm import metric_info, metrics
from jaxrl_llm.config import parse
from jaxrl_llm.data import pipeline
from jaxrl_llm.run import hparam_columns, to_global_batch


def _run(config, workdir):
  return train_and_evaluate(config, str(workdir))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """One short real run (KL on, so the reference-KL tags exist) shared by several tests."""
  workdir = tmp_path_factory.mktemp("run")
  config = tiny_config(**{"kl.beta": 0.04, "sft.steps": 3, "sft.batch_size": 8})
  result = _run(config, workdir)
  return workdir, result


def test_tensorboard_has_the_required_tags(tiny_run):
  workdir, result = tiny_run
  tags = metrics.read_tags(str(workdir))
  scalars = set(tags["scalars"])
  required = {
    "rollout/reward_mean",
    "rollout/accuracy",
    "rollout/length_mean",
    "policy/entropy",
    "policy/clip_frac_low",
    "policy/clip_frac_high",
    "policy/approx_kl",
    "kl/ref_kl",
    "optim/grad_norm",
    "optim/learning_rate",
    "perf/generated_tokens_per_s",
    "perf/learner_tokens_per_s",
    "perf/step_time_s",
    "eval/accuracy",
    "eval/pass@2",
    "policy/clip_frac",
  }
  assert required <= scalars, sorted(required - scalars)
  # The warm start is its own TensorBoard run with its own step axis; the RL run has no sft/.
  assert not any(t.startswith("sft/") for t in scalars)
  assert [t for t in scalars if metric_info.info(t) is None] == []  # every tag is declared
  sft = metrics.read_scalars(str(workdir / "sft"))
  assert [s for s, _ in sft["sft/loss"]] == [1, 2, 3]
  assert min(s for series in metrics.read_scalars(str(workdir)).values() for s, _ in series) == 0
  plugins = tags["plugins"]
  assert {"reward", "length", "advantage"} <= set(plugins["histograms"])
  assert "samples" in plugins["text"]
  text = metrics.read_text(str(workdir))["samples"][-1][1]
  assert "prompt" in text and "reward" in text
  # text_samples 8 of rl.num_prompts 4: every prompt's first completion, one row each.
  assert all(t.count("\n| `") == 4 for _, t in metrics.read_text(str(workdir))["samples"])
  # Eval ran at the start, every eval_every steps and at the end.
  evals = metrics.read_scalars(str(workdir))["eval/accuracy"]
  assert [s for s, _ in evals] == [0, 2, 4]
  assert result["eval/accuracy"] == evals[-1][1]


def test_a_run_exports_to_raw_files_read_back_from_its_events(tiny_run, tmp_path):
  """tools/export_runs.py writes a run's config, every scalar and every logged sample from its
  own TensorBoard events, and its terminal log (or else the trainer's log.txt); a second export into the same folder is one error line and changes
  nothing."""
  import json
  import shutil

  workdir, _ = tiny_run
  root = tmp_path / "study"
  shutil.copytree(workdir, root / "run_a", ignore=shutil.ignore_patterns("checkpoints"))
  (root / "run_a.log").write_text("the terminal's lines\n")
  shutil.copytree(workdir, root / "run_b", ignore=shutil.ignore_patterns("checkpoints"))
  (root / "run_b" / "log.txt").write_text("the trainer's own log\n")  # no terminal log beside
  tool = str(REPO / "tools" / "export_runs.py")
  cmd = [sys.executable, tool, f"--root={root}", f"--out={tmp_path / 'out'}"]
  subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
  out = tmp_path / "out" / "run_a"
  scalars = json.loads((out / "scalars.json").read_text())
  want = metrics.read_scalars(str(workdir))
  assert scalars == {k: [[s, v] for s, v in vs] for k, vs in want.items()} and scalars
  rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
  logged = metrics.read_text(str(workdir))["samples"]
  assert len(rows) == sum(text.count("\n| `") for _, text in logged) > 0
  assert {r["step"] for r in rows} == {s for s, _ in logged}
  assert all(r["prompt"] and isinstance(r["reward"], float) for r in rows)
  assert (out / "run.log").read_text() == "the terminal's lines\n"
  assert (tmp_path / "out" / "run_b" / "run.log").read_text() == "the trainer's own log\n"
  assert (out / "config.json").read_text() == (workdir / "config.json").read_text()
  before = (out / "scalars.json").stat().st_mtime_ns
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert again.returncode == 2 and again.stderr.strip().startswith("error: --out=")
  assert len(again.stderr.strip().splitlines()) == 1
  assert (out / "scalars.json").stat().st_mtime_ns == before


@pytest.mark.extended  # CI's time (2026-12-06)
def test_text_samples_above_eight_are_all_shown(tmp_path):
  """train.text_samples=10 of 12 prompts: the `samples` table (and export_runs.py's rows) holds
  the first completion of each of the first 10 prompts; it was silently capped at 8 rows."""
  over = {"rl.num_prompts": 12, "train.text_samples": 10, "train.num_steps": 1}
  _run(tiny_config(**over, **{"train.eval_every": 1, "train.checkpoint_every": 1}), tmp_path)
  (step, text), *more = metrics.read_text(str(tmp_path))["samples"]
  assert (step, more) == (1, [])
  assert text.count("\n| `") == 10, text  # one row per prompt (export_runs.py's rows)


@pytest.mark.slow
def test_a_committed_export_tabulates_as_its_run_did(tiny_run, tmp_path):
  """experiments/seed_table.py over tools/export_runs.py's folder (no events, a scalars.json)
  prints the per-seed table the run's own events give, and a scalars.json that does not read is
  one error line naming it."""
  import shutil

  workdir, _ = tiny_run
  shutil.copytree(workdir, tmp_path / "study" / "run", ignore=shutil.ignore_patterns("checkpoints"))
  export = [sys.executable, str(REPO / "tools" / "export_runs.py"), f"--root={tmp_path / 'study'}"]
  subprocess.run(
    [*export, f"--out={tmp_path / 'out'}"], check=True, capture_output=True, timeout=300
  )
  table = [sys.executable, str(REPO / "experiments" / "seed_table.py"), "--group_by=seed",
           "--per_seed", "--cols=eval/accuracy@0,eval/accuracy@final,policy/entropy@avg"]  # fmt: skip
  rows = {}
  for name in ("study", "out"):
    out = subprocess.run([*table, f"--root={tmp_path / name}"], capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    rows[name] = [line for line in out.splitlines() if line.startswith("|")]
  assert rows["out"] == rows["study"] and "| run | 0 | " in "\n".join(rows["out"]), rows
  (tmp_path / "out" / "run" / "scalars.json").write_text('{"eval/accuracy": [[0]]}')
  bad = subprocess.run([*table, f"--root={tmp_path / 'out'}"], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
  assert bad.returncode != 0 and bad.stderr.strip().startswith("error: "), bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1 and "scalars.json" in bad.stderr


def test_first_minibatch_is_on_policy(tiny_run):
  workdir, _ = tiny_run
  s = metrics.read_scalars(str(workdir))
  assert all(v == 0.0 for _, v in s["policy/clip_frac_first_minibatch"])
  # Sampler ℓ^μ and learner ℓ^old of the same float32 params agree (spec §3 mismatch ~ 0).
  assert max(v for _, v in s["behaviour/mismatch_max"]) < 1e-5
  assert all(abs(v - 1) < 1e-5 for _, v in s["behaviour/rho_max"])


@pytest.mark.extended
def test_moe_run_resumes_under_another_expert_implementation(tmp_path):
  """`model.moe_impl` picks how, not what: a run saved under `ragged` resumes under `portable`
  (the default `auto` on CPU) and continues as the uninterrupted run, to float32 rounding."""
  moe = {
    "model.moe_num_experts": 4,
    "model.moe_top_k": 2,
    "model.moe_expert_mlp_dim": 32,
    "train.checkpoint_every": 2,
  }
  _run(tiny_config(**moe, **{"model.moe_impl": "ragged"}), tmp_path / "straight")
  stop = {"train.stop_after_steps": 2, "model.moe_impl": "ragged"}
  _run(tiny_config(**moe, **stop), tmp_path / "resumed")
  _run(tiny_config(**moe, **{"model.moe_impl": "portable"}), tmp_path / "resumed")
  a = metrics.read_scalars(str(tmp_path / "straight"))
  b = metrics.read_scalars(str(tmp_path / "resumed"))
  for tag in ("policy/loss", "optim/grad_norm", "moe/aux_loss"):
    want, got = dict(a[tag]), dict(b[tag])
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(
  "mesh",
  [
    pytest.param({}, id="one"),
    pytest.param(
      {"mesh.data": 1, "mesh.fsdp": 8, "rl.num_prompts": 8}, id="fsdp8", marks=pytest.mark.extended
    ),
    pytest.param({"model.lora_rank": 4}, id="adapters", marks=pytest.mark.extended),
    pytest.param(
      {"task.name": "countdown", "sampling.tool": "countdown", "sampling.max_turns": 3},
      id="multi-turn",
    ),
  ],
)
def test_rl_step_compiles_once(mesh):
  config = tiny_config(**mesh)
  exp = build(config)
  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), config.rl.num_prompts, seed=0)
  state = exp.state
  for i in range(3):
    with lowerings() as lowered:
      batch = to_global_batch(next(it), exp.batch_sharding)
      state, _ = exp.rl_step(state, batch, jax.random.fold_in(state.rng, i))
    assert i == 0 or not lowered, (i, lowered)  # no program compiles after the first step


def _steps(mesh_data: int, n: int = 2):
  states, metrics = run_steps(tiny_config(**{"mesh.data": mesh_data, "rl.num_prompts": 8}), n)
  return states[-1].params, metrics


@pytest.mark.slow  # CI's mesh equality (FSDP 4x2 == one device: extended tier, tests/test_fsdp.py)
def test_eight_device_mesh_matches_single_device():
  assert jax.device_count() == 8
  p1, m1 = _steps(1)
  p8, m8 = _steps(8)
  for a, b in zip(m1, m8):
    np.testing.assert_array_equal(a["samples/tokens"], b["samples/tokens"])
    np.testing.assert_array_equal(a["hist/reward"], b["hist/reward"])
    # Each device computes its own rows (other matmul shapes, other float32 rounding); Adam's
    # first update ~ lr * sign(g) turns that into O(lr) parameter differences where g ~ 0,
    # which every metric after the first minibatch sees: the parameters' tolerance.
    rtol = 1e-3
    for key in ("policy/loss", "optim/grad_norm", "policy/entropy", "adv/std"):
      np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=1e-6, err_msg=key)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-5), p1, p8)


def test_cli_runs_and_writes_checkpoint(tmp_path):
  cmd = [
    sys.executable,
    "-m",
    "jaxrl_llm.main",
    "--config=configs/default.py",
    f"--workdir={tmp_path}",
    "--config.train.num_steps=2",
    "--config.sft.steps=2",
    "--config.train.eval_every=2",
    "--config.task.eval_size=8",
    "--config.rl.num_prompts=4",
    "--config.train.log_every=1",
  ]
  # One CPU device and no platform chosen, as a user runs it (conftest picks the CPU for tests),
  # with train.compilation_cache=auto's own directory (no JAX_COMPILATION_CACHE_DIR).
  env = {**cli_env("JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR"), "XDG_CACHE_HOME": str(tmp_path)}
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "step 2/2" in proc.stderr
  assert (tmp_path / "checkpoints" / "2").is_dir()
  kept = {p.name.split("-")[0] for p in (tmp_path / "jaxrl_llm" / "xla").iterdir()}
  assert "jit_fused_step" in kept, kept  # the RL step, for the next launch of this program
  lines = proc.stderr.splitlines()
  # The backend is JAX's pick: a fall-back to the CPU is one line, a failed plugin's native
  # start-up chatter (libtpu's where the tpu extra is installed) stays off the terminal.
  on_cpu = any(" | cpu (" in line and " | JAX " in line for line in lines)  # the banner
  assert sum("running on the CPU: " in line for line in lines) == int(on_cpu), lines[:4]
  assert not [line for line in lines if "InitGoogle" in line or "TPU_WORKER" in line], lines[:5]
  assert "jaxrl_llm" in next(line for line in lines if "record.py" in line and "|" in line)
  assert "last eval: eval/accuracy=" in lines[-1] and "wall time" in lines[-1]
  # The terminal's order: the banner first, the parameter count once, every compilation
  # announced before it runs, the RL loop's time apart from the whole wall time.
  logged = [line for line in lines if line[:1] in "IWE" and "] " in line]
  assert "jaxrl_llm" in logged[0] and "JAX" in logged[0], logged[:3]
  assert sum("M parameters" in line for line in lines) == 1
  for phase in ("warm start", "held-out evaluation", "RL step"):
    assert any(phase in line and "compilation" in line for line in lines), phase
  summary = next(line for line in lines if "trained RL steps" in line)
  assert "(the RL loop, of which " in summary and "compiling and the first step" in summary
  assert "wall time from the model's building on)" in summary
  assert not [line for line in lines if "polynomial schedule" in line]


@pytest.mark.slow
def test_host_reward_path_matches_fused_step():
  """sample → rewards on the host → learn gives the fused step's update for the same rewards."""
  config = tiny_config()
  exp = build(config)
  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), config.rl.num_prompts, seed=0)
  batch = to_global_batch(next(it), exp.batch_sharding)
  rng = jax.random.fold_in(exp.state.rng, 0)
  g = config.sampling.group_size

  rollout = exp.program.sample(exp.state, batch, rng)
  host = jax.device_get(rollout)
  # A host-side verifier: exact match of the decoded completion with the decoded answer.
  tok = exp.task.tokenizer
  answers = [tok.decode(a) for a in np.repeat(np.asarray(batch.answer), g, axis=0)]
  correct = np.array([float(tok.decode(c) == a) for c, a in zip(host.tokens, answers)], np.float32)
  terms = {"correct": correct, "format": np.zeros_like(correct)}
  state_h, m_h = exp.program.learn(exp.state, rollout, terms, rng)
  m_h, params_h = jax.device_get(m_h), jax.device_get(state_h.params)

  exp2 = build(config)
  state_f, m_f = exp2.rl_step(exp2.state, batch, rng)
  m_f = jax.device_get(m_f)
  np.testing.assert_array_equal(m_h["hist/reward"], m_f["hist/reward"])
  for key in ("policy/loss", "optim/grad_norm", "rollout/accuracy", "adv/std"):
    np.testing.assert_allclose(m_h[key], m_f[key], rtol=1e-6, err_msg=key)
  jax.tree.map(np.testing.assert_array_equal, params_h, jax.device_get(state_f.params))


@pytest.mark.extended
def test_the_run_records_its_config_once(tmp_path):
  """config.json holds every resolved field and the provenance; TensorBoard gets the table;
  a relaunch of a finished run reports its last evaluation and writes nothing (no empty event
  file); one with a changed config adds its own record, one that changes only
  train.stop_after_steps none."""
  import json

  profile = {"train.profile_steps": 1}  # a jax.profiler trace of step 2 (Profile tab)
  config = tiny_config(**{"train.num_steps": 2, "objective.clip_high": 0.28, **profile})
  first = train_and_evaluate(config, str(tmp_path))
  traces = list((tmp_path / "plugins" / "profile").glob("*/*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0
  record = json.loads((tmp_path / "config.json").read_text())
  assert record["config"]["objective"]["clip_high"] == 0.28
  assert record["config"]["objective"]["clip_low"] is None  # unset in the config: ...
  assert record["resolved"]["objective.clip_low"] == 0.2  # ... the objective's default, used
  assert record["resolved"]["objective.clip_high"] == 0.28
  assert record["resolved"] == {
    f"objective.{k}": v for k, v in parse(config).objective.hyperparameters.items()
  }
  assert record["config"]["train"]["num_steps"] == 2
  assert record["jax"] == jax.__version__ and record["devices"] == jax.device_count()
  assert "config" in metrics.read_tags(str(tmp_path))["tensors"]
  hp = metrics.read_hparams(str(tmp_path))  # the HParams session, as TensorBoard reads it
  assert set(hparam_columns(parse(config))) <= set(hp["hparams"]) and hp["status"] == "success"
  assert hp["hparams"]["objective.clip_high"] == pytest.approx(0.28)
  assert hp["hparams"]["objective.clip_low"] == pytest.approx(0.2)  # the objective's default
  assert hp["hparams"]["params"] > 0 and "eval/accuracy" in hp["metrics"]
  events = sorted(p.name for p in tmp_path.glob("events.*"))
  again = train_and_evaluate(config, str(tmp_path))  # finished: nothing to train
  assert again == first and "eval/accuracy" in again  # the last evaluation, read back
  assert sorted(p.name for p in tmp_path.glob("events.*")) == events  # no empty event file
  assert sorted(p.name for p in tmp_path.glob("config*.json")) == ["config.json"]
  longer = tiny_config(**{"train.num_steps": 4, "objective.clip_high": 0.28, **profile})
  stopped = {"train.num_steps": 4, "objective.clip_high": 0.28, "train.stop_after_steps": 1}
  train_and_evaluate(tiny_config(**stopped, **profile), str(tmp_path))  # steps 2..3
  final = train_and_evaluate(longer, str(tmp_path))  # only stop_after_steps differs: no record
  resumed = json.loads((tmp_path / "config.resume-2.json").read_text())
  assert resumed["config"]["train"]["num_steps"] == 4 and resumed["step"] == 2
  assert json.loads((tmp_path / "config.json").read_text()) == record  # the first is kept
  assert metrics.read_hparams(str(tmp_path))["sessions"] == 1  # a resume adds no session
  table = metrics.hparams_table(str(tmp_path))  # what TensorBoard's HParams tab shows
  assert len(table) == 1 and table[0]["status"] == "success"
  assert table[0]["metrics"]["eval/accuracy"] == pytest.approx(final["eval/accuracy"])
  events = sorted(p.name for p in tmp_path.glob("events.*"))
  assert train_and_evaluate(longer, str(tmp_path)) == final  # finished under the resumed config
  assert sorted(p.name for p in tmp_path.glob("events.*")) == events  # nothing written
  assert sorted(p.name for p in tmp_path.glob("config*.json")) == [
    "config.json",
    "config.resume-2.json",
  ]
