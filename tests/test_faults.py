"""Faults and bad numbers: a non-finite update is skipped, never applied or saved, and a run
that keeps producing them stops with a clear message (objectives.md §5 applies finite updates
only); numeric config fields with a range are validated before anything compiles."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO, cli_env, default_sigint, tiny_config
from conftest import TINY_CLI as TINY_MODEL
from parsed import build, train_and_evaluate

from jaxrl_llm import checkpoint, metrics, optim, paths
from jaxrl_llm.config import ConfigError, check, parse
from jaxrl_llm.run import NonFiniteError


def _tx():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


GUARDED = jax.jit(optim.guarded_update, static_argnums=0, static_argnames="recompute")


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("bad", ["grad_nan", "grad_inf", "loss_nan", "finite"])
def test_guarded_update_skips_non_finite_steps(bad, recompute):
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  tx = _tx()
  state = tx.init(params)
  grads = {"w": jnp.full((3, 2), 0.5), "b": jnp.ones(2)}
  loss = jnp.asarray(1.0)
  if bad == "grad_nan":
    grads["w"] = grads["w"].at[1, 1].set(jnp.nan)
  elif bad == "grad_inf":
    grads["b"] = grads["b"].at[0].set(jnp.inf)
  elif bad == "loss_nan":
    loss = jnp.asarray(jnp.nan)
  new_params, new_state, skipped = GUARDED(tx, grads, state, params, loss, recompute=recompute)
  same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), (new_params, new_state), (params, state))
  if bad == "finite":
    assert int(skipped) == 0 and not all(jax.tree.leaves(same))
  else:
    assert int(skipped) == 1 and all(jax.tree.leaves(same))  # nothing moved, Adam's count too


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("lr", [jnp.inf, 1e30])
def test_a_non_finite_or_overflowing_update_of_finite_gradients_is_skipped(lr, recompute):
  """Finite gradients whose update is inf (lr inf) or whose update's norm overflows float32
  (lr 1e30) are not applied: parameters and optimiser state stay as they were."""
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  tx = optax.sgd(lr, momentum=0.9)
  state = tx.init(params)
  grads = {"w": jnp.full((3, 2), 0.5), "b": jnp.ones(2)}
  new_params, new_state, skipped = GUARDED(
    tx, grads, state, params, jnp.asarray(1.0), recompute=recompute
  )
  assert int(skipped) == 1
  same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), (new_params, new_state), (params, state))
  assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("recompute", [False, True])
def test_an_overflowing_update_is_skipped_too(recompute):
  """Finite gradients whose update overflows the parameters (lr 1e38) are not applied."""
  params = {"w": jnp.full((2,), 3e38)}
  tx = optax.sgd(1e38)
  grads = {"w": -jnp.ones(2)}
  _, _, skipped = optim.guarded_update(tx, grads, tx.init(params), params, recompute=recompute)
  assert int(skipped) == 1


def test_the_guards_two_forms_update_alike():
  """Holding the update and computing it twice give the same parameters and Adam state, bit
  for bit, over a few steps of a jitted guard."""
  tx = _tx()
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
  out = {}
  for recompute in (False, True):
    p, st = params, tx.init(params)
    for i in range(3):
      grads = jax.tree.map(lambda x, i=i: jnp.sin(x + i) + 0.1, p)
      p, st, skipped = GUARDED(tx, grads, st, p, jnp.asarray(1.0), recompute=recompute)
      assert int(skipped) == 0
    out[recompute] = (p, st)
  same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), out[False], out[True])
  assert all(jax.tree.leaves(same))


def _guard_temp(device, recompute=None, platform_mesh=None) -> tuple[int, int]:
  """(temp bytes, bytes of one copy of the parameters) of a guarded AdamW update of 4 x 16 MiB
  of float32 parameters compiled for `device` (nothing runs), traced under the activation
  rules of a mesh of `platform_mesh` when given."""
  from jax.sharding import Mesh

  from jaxrl_llm import sharding

  on = jax.sharding.SingleDeviceSharding(device)
  params = {f"w{i}": jax.ShapeDtypeStruct((256, 16384), jnp.float32, sharding=on) for i in range(4)}
  tx = _tx()
  state = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), jax.eval_shape(tx.init, params)
  )
  loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=on)

  def guard(g, s, p, lo):
    mesh = None if platform_mesh is None else Mesh(np.array(platform_mesh), ("fsdp",))
    with contextlib.nullcontext() if mesh is None else sharding.activation_rules(mesh, ()):
      return optim.guarded_update(tx, g, s, p, lo, recompute=recompute)

  step = jax.jit(guard, donate_argnums=(1, 2))
  compiled = step.lower(params, state, params, loss).compile()
  return compiled.memory_analysis().temp_size_in_bytes, 4 * 256 * 16384 * 4


# The persistent cache holds the TPU program from an earlier run; with no TPU client here jax
# cannot load it, says so and compiles it again.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache:UserWarning")
def test_the_guard_holds_no_whole_update_on_a_tpu(monkeypatch):
  """Compiled for a TPU chip (through libtpu, nothing runs), the guarded update takes under two
  copies of the parameters of temp in the form the guard picks for a TPU (the update computed
  twice, its first computation reduced leaf by leaf); held for its check, the update takes
  three."""
  pytest.importorskip("libtpu", reason="compiling for a TPU needs libtpu: pip install -e '.[tpu]'")
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jaxrl_llm import plan

  chip = plan.tpu_slice_devices("v5e:2x2")[0]
  picked, copy = _guard_temp(chip, platform_mesh=[chip])
  held, _ = _guard_temp(chip, recompute=False)
  assert 0 < picked < 2 * copy <= held, (picked, held, copy)


def test_the_guard_holds_the_update_on_the_cpu_backend():
  """On the CPU backend (and where no mesh names a platform) the guard holds the update: its
  program is the held form's, not the twice-computed one's. (At Qwen2.5-7B the CPU backend plans
  114.9 GiB of temp for the twice-computed form against 113.5 GiB held.)"""
  from jax.sharding import Mesh

  from jaxrl_llm import sharding

  tx = _tx()
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  args = (params, tx.init(params), params, jnp.asarray(1.0))

  def text(recompute=None, mesh=None):
    def guard(*a):
      with contextlib.nullcontext() if mesh is None else sharding.activation_rules(mesh, ()):
        return optim.guarded_update(tx, *a, recompute=recompute)

    return str(jax.make_jaxpr(guard)(*args))

  held, twice = text(recompute=False), text(recompute=True)
  assert held != twice
  assert text() == held
  assert text(mesh=Mesh(np.array(jax.devices("cpu")[:1]), ("fsdp",))) == held


def test_a_vmapped_guard_skips_its_bad_runs_alone_and_compiles_in_linear_size():
  """In a pack the guard is vmapped (its `lax.cond` becomes a select in every leaf): a run whose
  gradient holds a NaN keeps its parameters and Adam state while the others update, and the
  compiled program grows linearly with the number of leaves. (With the leaves' squares added
  in one chain, XLA fused the chain into every leaf's select: 138k HLO lines at 100 leaves
  against 12k at 25.)"""
  tx = _tx()
  params = {"w": jnp.ones((2, 3, 2)), "b": jnp.zeros((2, 2))}
  grads = {"w": jnp.full((2, 3, 2), 0.5).at[0, 1, 1].set(jnp.nan), "b": jnp.ones((2, 2))}
  state = jax.vmap(tx.init)(params)
  step = jax.jit(jax.vmap(lambda g, s, p, loss: optim.guarded_update(tx, g, s, p, loss)))
  new_params, new_state, skipped = step(grads, state, params, jnp.ones(2))
  assert skipped.tolist() == [1, 0]
  for run, moved in ((0, False), (1, True)):
    same = jax.tree.map(
      lambda a, b, r=run: bool(jnp.all(a[r] == b[r])), (new_params, new_state), (params, state)
    )
    assert all(jax.tree.leaves(same)) != moved
  lines = []
  for n in (25, 100):
    tree = {f"w{i}": jax.ShapeDtypeStruct((2, 8, 8), jnp.float32) for i in range(n)}
    opt = jax.eval_shape(jax.vmap(tx.init), tree)
    loss = jax.ShapeDtypeStruct((2,), jnp.float32)
    lines.append(len(step.lower(tree, opt, tree, loss).compile().as_text().splitlines()))
  assert lines[1] < 6 * lines[0], lines  # 4x the leaves: about 4x the program, not 16x


@pytest.mark.extended
def test_a_run_that_keeps_diverging_stops_and_saves_only_finite_state(tmp_path):
  """lr 1e38 without clipping (an entropy bonus gives a gradient before any reward): every
  update's norm overflows float32 (Adam's steps of about 1e38 each), so each is skipped; after
  train.max_skipped_updates in a row the run stops, naming the step, and every checkpoint on
  disk is finite."""
  config = tiny_config(
    **{
      "optim.learning_rate": 1e38,
      "optim.grad_clip": 0.0,
      "optim.warmup_steps": 0,
      "rl.entropy_coef": 0.01,
      "train.max_skipped_updates": 4,
      "train.checkpoint_every": 1,
      "train.num_steps": 8,
    }
  )
  with pytest.raises(NonFiniteError, match=r"rl step 2: 4 consecutive optimiser updates"):
    train_and_evaluate(config, str(tmp_path))
  logged = metrics.read_scalars(str(tmp_path))
  assert max(v for _, v in logged["optim/skipped_updates"]) == 2  # both updates of a step
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    steps = ckpt.all_steps()
    assert steps
    exp = build(config, abstract=True)
    for step in steps:
      state, _ = ckpt.restore(step, exp.state)
      assert not checkpoint.non_finite_paths(state)


@pytest.mark.extended
def test_a_run_whose_every_update_was_skipped_does_not_end_as_if_it_had_learned(tmp_path):
  """Fewer skipped updates than train.max_skipped_updates, but all of them: the run stops with
  one line naming the steps instead of exiting as a finished run; its checkpoints are kept."""
  config = tiny_config(
    **{
      "optim.learning_rate": 1e38,
      "optim.grad_clip": 0.0,
      "optim.warmup_steps": 0,
      "rl.entropy_coef": 0.01,
      "train.num_steps": 2,
    }
  )
  with pytest.raises(NonFiniteError, match=r"rl steps 1\.\.2: all 4 optimiser updates") as err:
    train_and_evaluate(config, str(tmp_path))
  assert len(str(err.value).splitlines()) == 1
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    assert ckpt.all_steps()[-1] == 2  # the last finite state, kept


def test_a_non_finite_state_is_never_saved(tmp_path):
  state = {"w": jnp.ones(4), "step": jnp.asarray(3)}
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    assert ckpt.save(1, state)
    ckpt.wait()
    bad = {"w": jnp.ones(4).at[2].set(jnp.nan), "step": jnp.asarray(4)}
    with pytest.raises(checkpoint.NonFiniteStateError, match=r"refusing to save step 2.*\['w'\]"):
      ckpt.save(2, bad)
    ckpt.wait()
    assert ckpt.all_steps() == [1]
    np.testing.assert_array_equal(ckpt.restore(1, state)[0]["w"], np.ones(4))


BAD_NUMBERS = {
  "optim.b1": (-1.0, r"optim\.b1=-1\.0 must be in \[0, 1\)"),
  "optim.b2": (1.5, r"optim\.b2=1\.5 must be in \[0, 1\)"),
  "optim.warmup_steps": (-10, r"optim\.warmup_steps=-10 must be >= 0"),
  "optim.weight_decay": (-1.0, r"optim\.weight_decay=-1\.0 must be >= 0"),
  "sft.learning_rate": (-1.0, r"sft\.learning_rate=-1\.0 must be > 0"),
  "data.verifier_timeout_s": (-1.0, r"data\.verifier_timeout_s=-1\.0 must be > 0"),
  "train.max_to_keep": (0, r"train\.max_to_keep=0 must be >= 1"),
  "train.max_skipped_updates": (0, r"train\.max_skipped_updates=0 must be >= 1"),
  "model.param_dtype": ("float16", r"model\.param_dtype='float16' is refused"),
}


@pytest.mark.parametrize("field", list(BAD_NUMBERS))
def test_out_of_range_numbers_stop_at_start_up_naming_the_field(field):
  value, message = BAD_NUMBERS[field]
  with pytest.raises(ConfigError, match=message):
    check(parse(tiny_config(**{field: value})), num_devices=8)


# Every section: each value stops `build` (before anything compiles) with a ConfigError
# naming the field.
BAD_CONFIGS = [
  ("task.name", "nope"), ("task.digits", 0), ("task.min_len", 0), ("task.max_len", 1),
  ("task.eval_size", 0), ("data.eval_fraction", 1.5), ("data.template", "nope"),
  ("data.prompt_len", 0), ("data.correct_term", "math_corect"), ("model.d_model", 0),
  ("model.num_layers", 0), ("model.vocab_size", 0), ("model.dtype", "float8"),
  ("model.attention", "flash"), ("model.rope_theta", -1.0), ("model.moe_num_experts", -1),
  ("sampling.group_size", 1), ("sampling.temperature", 0.0), ("sampling.top_p", 1.5),
  ("sampling.top_k", -1), ("sampling.max_new_tokens", -1), ("sampling.param_dtype", "int2"),
  ("sampling.kv_block", -1),
  ("rl.num_prompts", 0), ("rl.num_epochs", 0), ("rl.num_minibatches", 3),
  ("rl.num_microbatches", -1), ("rl.remat", "some"), ("rl.old_pass", "never"),
  ("rl.share_prompt", "x"), ("rl.microbatch_tokens", 0), ("advantage.name", "nope"),
  ("advantage.gamma", 1.5), ("advantage.lam", -0.1), ("advantage.whiten_variance", "x"),
  ("objective.name", "nope"), ("objective.clip_low", -0.1), ("objective.clip_high", -1.0),
  ("objective.dual_clip", 0.5), ("aggregation.name", "nope"), ("correction.name", "nope"),
  ("correction.cap", 0.0), ("kl.name", "k9"), ("kl.beta", -1.0), ("kl.placement", "x"),
  ("kl.reference", "x"), ("kl.ema", 2.0), ("shaping.name", "x"), ("shaping.cache_len", -1),
  ("replay.name", "r9"), ("filtering.name", "x"), ("filtering.oversample", 0.5),
  ("optim.learning_rate", 0.0), ("optim.learning_rate", float("inf")),
  ("optim.learning_rate", float("nan")), ("objective.clip_high", float("inf")),
  ("sampling.temperature", float("-inf")), ("optim.decay_to", -0.5), ("optim.grad_clip", -1.0),
  ("sft.steps", -1), ("sft.batch_size", 0), ("train.num_steps", 0), ("train.eval_every", 0),
  ("train.pass_k", 0), ("train.text_samples", -1), ("train.stop_after_steps", -1),
  ("train.profile_steps", -1),
  ("mesh.data", 3), ("mesh.fsdp", 0), ("mesh.expert", 3), ("mesh.rules", ("notapair",)),
  ("mesh.model", 3), ("task.reward_weights.correct", float("nan")),
]  # fmt: skip


@pytest.mark.parametrize("field, value", BAD_CONFIGS, ids=[f for f, _ in BAD_CONFIGS])
def test_bad_config_values_stop_before_compiling_naming_the_field(field, value):
  with pytest.raises(ConfigError) as err:
    build(tiny_config(**{field: value}), abstract=True)
  assert field.split(".")[-1] in str(err.value), str(err.value)


REFUSED_COMBINATIONS = {
  "ppo_critic-without-a-value-head": (
    {"objective.name": "ppo_critic", "advantage.name": "gae"},
    r"objective\.name='ppo_critic' needs a value head: set model\.value_head=True",
  ),
  "gae-without-a-critic": ({"advantage.name": "gae"}, r"advantage\.name='gae' needs a critic"),
  "r2-on-a-dense-model": ({"replay.name": "r2"}, r"replay\.name='r2' replays MoE routing"),
  "r3-on-a-dense-model": ({"replay.name": "r3"}, r"replay\.name='r3' replays MoE routing"),
  "k3_is-in-the-reward": (
    {"kl.name": "k3_is", "kl.placement": "reward", "kl.beta": 0.1},
    r"kl\.name='k3_is' is a loss estimator .*use kl\.placement='loss'",
  ),
}


@pytest.mark.parametrize("case", list(REFUSED_COMBINATIONS))
def test_settings_that_do_not_go_together_are_refused_in_one_line(case):
  """The README's start-up refusals of settings that contradict each other: one line each,
  naming the fields and what to set instead."""
  overrides, message = REFUSED_COMBINATIONS[case]
  with pytest.raises(ConfigError, match=message) as err:
    build(tiny_config(**overrides), abstract=True)
  assert "\n" not in str(err.value)


def test_a_tensor_parallel_size_that_does_not_divide_the_model_is_named():
  """mesh.model splits the vocabulary, the heads and the feed-forward widths: a size that does
  not divide them is refused before anything is placed (it was an IndivisibleError traceback
  from the parameters' initialisation); one that divides them builds."""
  bad = tiny_config(**{"mesh.data": 2, "mesh.model": 3, "model.vocab_size": 36})
  with pytest.raises(ConfigError) as err:
    build(bad, abstract=True)
  line = str(err.value)
  assert "mesh.model=3 does not divide" in line and "model.num_heads=2" in line, line
  assert "model.mlp_dim=64" in line and "vocab_size" not in line, line  # 36 = 3 x 12 divides
  build(tiny_config(**{"mesh.data": 4, "mesh.model": 2}), abstract=True)


# ---- Process-level faults: the real command line, real files. ------------------------------


TINY_CLI = (
  *TINY_MODEL,
  "--config.train.eval_every=100",
  "--config.train.log_every=1",
  "--config.mesh.data=1",
)


def _cli(workdir, *args, timeout=300):
  env = cli_env()
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  cmd += [f"--workdir={workdir}", *TINY_CLI, *args]
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
  "case, field",
  [("missing-file", "data.train_files"), ("glob-matches-nothing", "data.train_files"),
   ("missing-tokenizer", "data.tokenizer"), ("empty-file", "data.train_files"),
   ("malformed-line", "data.train_files"), ("too-few-to-split", "data.eval_fraction")],
)  # fmt: skip
def test_a_bad_data_file_or_tokenizer_is_one_error_line(tmp_path, case, field):
  """A missing, unmatched, empty or malformed prompt file, a missing tokenizer, or too few
  records for the held-out split, from the command line: the last line names the `data.*` field
  (and a malformed file's line), exit 2."""
  data, empty, bad = tmp_path / "ok.jsonl", tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
  data.write_text('{"prompt": "1+1", "answer": "2"}\n')
  empty.write_text("")
  bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer"\n')
  args = {
    "missing-file": [f"--config.data.train_files={tmp_path / 'nope.jsonl'}"],
    "glob-matches-nothing": [f"--config.data.train_files={tmp_path / 'nope*.jsonl'}"],
    "missing-tokenizer": [f"--config.data.train_files={data}", "--config.data.tokenizer=/nope"],
    "empty-file": [f"--config.data.train_files={empty}", "--config.data.tokenizer=/nope"],
    "malformed-line": [f"--config.data.train_files={bad}", "--config.data.tokenizer=/nope"],
    "too-few-to-split": [f"--config.data.train_files={data}", "--config.data.tokenizer=TOK"],
  }[case]  # the files are read before the tokenizer is looked for
  if case == "too-few-to-split":  # one record: the 5% held-out split leaves a side empty
    from text_fixtures import build_bpe_tokenizer

    args[1] = f"--config.data.tokenizer={build_bpe_tokenizer(tmp_path / 'tok')}"
  proc = _cli(tmp_path / "w", *args, "--config.sft.steps=0", timeout=200)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {field}=") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  if case == "malformed-line":
    assert "bad.jsonl:2: not valid JSON" in last, last
  if case == "too-few-to-split":
    assert "split 1 records into" in last and "data.eval_files" in last, last


@pytest.mark.parametrize(
  "case, says",
  [("no-directory", "is not a directory"), ("no-config", "has no config.json"),
   ("no-weights", "neither model.safetensors nor")],
)  # fmt: skip
def test_a_bad_hugging_face_checkpoint_is_one_error_line(tmp_path, case, says):
  """`model.checkpoint`: a path that is no directory (with prompt files, whose tokenizer it
  would give: it was blamed on data.tokenizer), a directory without config.json (a traceback)
  or without weights: one line naming the checkpoint, exit 2, no workdir left."""
  ckpt, data = tmp_path / "ckpt", tmp_path / "ok.jsonl"
  data.write_text('{"prompt": "1+1", "answer": "2"}\n')
  args = [f"--config.model.checkpoint={ckpt}"]
  if case != "no-directory":
    ckpt.mkdir()
  if case == "no-weights":  # a valid config.json; the built-in task (no tokenizer needed)
    shutil.copy(REPO / "tests" / "fixtures" / "hf" / "qwen2" / "config.json", ckpt)
  else:
    args.append(f"--config.data.train_files={data}")
  proc = _cli(tmp_path / "w", *args, "--config.sft.steps=0", timeout=200)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and str(ckpt) in last and says in last, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and "data.tokenizer" not in proc.stderr
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
  "override",
  [
    "train.num_steps=abc",  # wrong types
    "train.num_steps=2.5",
    "sampling.top_p=[0.5]",
    "advantage.whiten=maybe",
    "sampling.temperature=-1",  # out of its range (the section's check)
    "rl.num_minibatches=7",  # not a divisor of the batch (a check across sections, at build)
  ],
)
def test_a_bad_override_is_one_error_line_and_exit_2(tmp_path, override):
  """A wrong-typed or out-of-range value: one line naming the field, exit 2, no workdir."""
  field = override.split("=")[0]
  proc = _cli(tmp_path / "w", f"--config.{override}", timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:") and field in lines[0], lines
  assert not (tmp_path / "w").exists()  # nothing started


def _tmpfs(mount, options: str):
  """A tmpfs mounted at `mount` with `options` for the test's duration (skipped where this user
  may not mount one)."""
  mount.mkdir()
  proc = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True
  )
  if proc.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
  yield mount
  subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path):
  """A 3 MiB tmpfs."""
  yield from _tmpfs(tmp_path / "disk", "size=3m")


@pytest.fixture
def read_only_dir(tmp_path):
  """A read-only tmpfs."""
  yield from _tmpfs(tmp_path / "ro", "ro")


@pytest.mark.parametrize("kind", ["file", "under-a-file", "read-only"])
def test_a_workdir_that_cannot_hold_a_run_is_one_error_line_at_start_up(tmp_path, kind, request):
  a_file = tmp_path / "a_file"
  a_file.write_text("not a directory")
  workdir = {
    "file": a_file,
    "under-a-file": a_file / "run",
    "read-only": request.getfixturevalue("read_only_dir") / "run" if kind == "read-only" else None,
  }[kind]
  proc = _cli(workdir, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: --workdir={workdir}: "), lines
  assert a_file.read_text() == "not a directory"


def test_a_read_only_checkpoints_folder_in_a_writable_workdir_is_one_line_at_once(tmp_path):
  """`W/checkpoints` read-only inside a writable W: refused at start-up in one line naming it
  (it hung for minutes in orbax's retries, then printed a traceback)."""
  workdir = tmp_path / "w"
  workdir.mkdir()
  mount = _tmpfs(workdir / "checkpoints", "ro")
  mounted = next(mount)
  try:
    proc = _cli(workdir, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: --workdir={workdir}: "), lines
    assert f"cannot write in {mounted} " in lines[0], lines
  finally:
    next(mount, None)  # unmounts


def test_a_record_written_on_a_full_disk_keeps_the_old_one_and_leaves_no_temporary_file(
  small_disk,
):
  """`paths.write_text` (run records, sweep.json) on a disk with no room: the OS's error, the
  file's earlier text intact, and no partial `.NAME.tmp-PID` beside it."""
  record = small_disk / "config.json"
  paths.write_text(record, "old")
  with open(small_disk / "filler", "wb", buffering=0) as f:
    with pytest.raises(OSError, match="No space left"):
      while True:  # the disk filled to its last block
        f.write(b"x" * 4096)
  with pytest.raises(OSError, match="No space left"):
    paths.write_text(record, "new " * 100_000)
  assert record.read_text() == "old"
  assert sorted(p.name for p in small_disk.iterdir()) == ["config.json", "filler"]


@pytest.mark.extended
def test_a_packed_sweep_on_a_full_disk_ends_in_its_one_line_without_a_traceback(small_disk):
  """A pack's checkpoints fill the disk: the pack's disk-full line is the last, and writing
  sweep.json on the full disk adds no traceback (nor a second line)."""
  root = small_disk / "sweep"
  tiny = ",".join(x.removeprefix("--config.") for x in TINY_CLI)
  cmd = [sys.executable, "tools/sweep.py", "--config=configs/default.py", f"--root={root}"]
  cmd += ["--packed", "--grid=objective.clip_high=0.2,0.28", f"--set={tiny}"]
  cmd += ["--set=sft.steps=0,train.num_steps=40,train.checkpoint_every=1,train.max_to_keep=100"]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 1, proc.stderr[-3000:]  # the sweep's status for a failed pack
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert lines[-1].startswith("error: disk full"), lines[-5:]


@pytest.mark.extended
def test_a_full_disk_ends_in_one_clear_line_and_keeps_the_last_checkpoint(small_disk):
  """Each checkpoint of the tiny model takes ~0.9 MiB: the fourth save cannot fit in 3 MiB."""
  workdir = small_disk / "run"
  proc = _cli(
    workdir,
    "--config.sft.steps=0",
    "--config.train.num_steps=40",
    "--config.train.checkpoint_every=1",
    "--config.train.max_to_keep=100",
  )
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert lines[-1].startswith("error: disk full"), lines[-5:]
  assert "No space left on device. The checkpoints" in lines[-1]  # the OS's words, not cut
  assert "relaunch to resume" in lines[-1]
  # Library background threads may report the same failure first, as single log lines (the
  # hooks are tested below); the full tracebacks (370-990 lines before) need --debug.
  assert len(lines) < 120, proc.stderr[-4000:]
  with checkpoint.Checkpointer(workdir, save_every=1) as ckpt:
    steps = ckpt.all_steps()
    assert steps, "no checkpoint committed before the disk filled"
    state = build(tiny_config()).state
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    step, _, _ = ckpt.restore_latest(abstract)
  assert step == steps[-1]


def _evaluated(workdir) -> list[int]:
  """The steps of `workdir`'s recorded held-out evaluations."""
  return [s for s, _ in metrics.read_scalars(str(workdir))["eval/accuracy"]]


def test_running_out_of_memory_ends_in_one_line_and_keeps_the_checkpoints(tmp_path):
  """An evaluation too large for memory (16 prompts x train.pass_k=2**22 samples: hundreds of
  GiB, below the int32 bound the config checks) ended in a 60-line traceback of XLA's
  RESOURCE_EXHAUSTED. Now one line says so and what to shrink, and no step is lost: the step
  whose evaluation failed is saved (before, the steps since the last checkpoint were lost), and
  the last step is saved before its evaluation; a relaunch with the old setting evaluates the
  saved step first, a finished run's last one included. (An allocation past the host's memory
  fails at once under Linux's default overcommit.)"""
  workdir, flags = tmp_path / "run", ("--config.sft.steps=0", "--config.train.eval_every=3")
  first = _cli(workdir, *flags, "--config.train.num_steps=2", "--config.train.checkpoint_every=1")
  assert first.returncode == 0, first.stderr[-3000:]
  big = _cli(workdir, *flags, "--config.train.num_steps=6", f"--config.train.pass_k={2**22}")
  lines = big.stderr.strip().splitlines()
  assert big.returncode == 2, big.stderr[-3000:]
  assert "Traceback" not in big.stderr, big.stderr[-3000:]
  assert lines[-1].startswith("error: out of memory: RESOURCE_EXHAUSTED"), lines[-5:]
  assert "task.eval_size x train.pass_k" in lines[-1] and "--dry_run" in lines[-1]
  with checkpoint.Checkpointer(workdir, save_every=1) as ckpt:
    assert ckpt.all_steps()[-1] == 3  # its evaluation failed; checkpoint_every is 250
  assert _evaluated(workdir) == [0, 2]
  again = _cli(workdir, *flags, "--config.train.num_steps=4")
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"{workdir} holds step 3 without its evaluation" in again.stderr, again.stderr[-3000:]
  assert _evaluated(workdir) == [0, 2, 3, 4]
  last = _cli(workdir, *flags, "--config.train.num_steps=5", f"--config.train.pass_k={2**22}")
  assert last.returncode == 2 and "error: out of memory" in last.stderr, last.stderr[-3000:]
  with checkpoint.Checkpointer(workdir, save_every=1) as ckpt:
    assert ckpt.all_steps()[-1] == 5
  again = _cli(workdir, *flags, "--config.train.num_steps=5")
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"{workdir} holds step 5 without its evaluation" in again.stderr, again.stderr[-3000:]
  assert "RL step" not in again.stderr, again.stderr[-3000:]  # no update: only the evaluation
  assert _evaluated(workdir) == [0, 2, 3, 4, 5]
  done = _cli(workdir, *flags, "--config.train.num_steps=5")
  assert done.returncode == 0 and "nothing to train" in done.stderr, done.stderr[-3000:]


def test_only_memory_errors_are_said_as_out_of_memory():
  """The host's MemoryError (numpy's, from a held-out draw too large) and XLA's
  RESOURCE_EXHAUSTED about memory, also as the cause of another error, are the out-of-memory
  line; a RESOURCE_EXHAUSTED about something else (a gRPC quota) stays an unexpected error."""
  from jaxrl_llm import launch

  with pytest.raises(MemoryError) as host:
    np.empty(2**62, np.int8)
  assert launch.explain(host.value).startswith("error: out of memory: Unable to allocate")
  xla = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 99 bytes.")
  try:
    raise RuntimeError("the evaluation failed") from xla
  except RuntimeError as chained:
    line = launch.explain(chained)
  assert line.startswith("error: out of memory: RESOURCE_EXHAUSTED: Out of memory allocating 99 "
                         "bytes. The checkpoints committed before it are intact"), line  # fmt: skip
  quota = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: grpc: received message larger than max")
  assert launch.explain(quota) is None


def test_a_step_folder_holding_another_steps_state_is_refused(tmp_path):
  """`checkpoints/5` holding the state of step 2 (a folder renamed, or copied in): the run
  resumed from it at step 2, saved steps 3-4 below 5, and the next launch took 5 again and let
  the newest-first order delete step 4. Now one line names the folder and the step it holds;
  nothing is changed."""
  workdir = tmp_path / "run"
  config = {"sft.steps": 0, "train.num_steps": 2, "train.checkpoint_every": 1}
  train_and_evaluate(tiny_config(**config), str(workdir))
  root = workdir / "checkpoints"
  (root / "2").rename(root / "5")
  before = sorted(p.name for p in root.iterdir())
  with pytest.raises(checkpoint.CheckpointMismatchError) as err:
    train_and_evaluate(tiny_config(**{**config, "train.num_steps": 4}), str(workdir))
  assert str(err.value).startswith(f"{root / '5'} holds the state of step 2, not 5"), err.value
  assert "\n" not in str(err.value) and sorted(p.name for p in root.iterdir()) == before


@pytest.mark.extended  # ~1 min: three launches of the command line
def test_a_corrupted_latest_checkpoint_is_set_aside_and_the_run_resumes(tmp_path):
  workdir = tmp_path / "run"
  stop = ("--config.sft.steps=0", "--config.train.num_steps=6", "--config.train.checkpoint_every=2")
  first = _cli(workdir, *stop, "--config.train.stop_after_steps=4")
  assert first.returncode == 0, first.stderr[-3000:]
  root = workdir / "checkpoints"
  data = max((p for p in (root / "4" / "state").rglob("*") if p.is_file()), key=os.path.getsize)
  blob = bytearray(data.read_bytes())
  blob[len(blob) // 2] ^= 0xFF
  data.write_bytes(bytes(blob))
  second = _cli(workdir, *stop)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "checkpoint step 4" in second.stderr and "does not match its checksum" in second.stderr
  assert "resumed from" in second.stderr and "at step 2" in second.stderr
  names = sorted(p.name for p in root.iterdir())
  assert any(n.startswith("4.corrupt-") for n in names) and "6" in names
  # Every remaining step corrupted: the relaunch stops with one line and moves nothing.
  for step in ("2", "4", "6"):
    if (root / step).exists():
      f = max((p for p in (root / step / "state").rglob("*") if p.is_file()), key=os.path.getsize)
      f.write_bytes(b"")
  before = sorted(p.name for p in root.iterdir())
  third = _cli(workdir, *stop)
  assert third.returncode == 2
  assert third.stderr.strip().splitlines()[-1].startswith("error: no checkpoint in")
  assert sorted(p.name for p in root.iterdir()) == before


@pytest.mark.extended
def test_the_sft_warm_start_is_checkpointed_and_not_redone(tmp_path):
  """The warm start is saved as step 0: a run killed before its first RL checkpoint resumes
  from it (no second warm start) and ends where an uninterrupted run ends."""
  config = tiny_config(**{"sft.steps": 3, "train.num_steps": 2, "train.max_to_keep": 5})
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  train_and_evaluate(config, str(straight))
  shutil.copytree(straight, killed)
  shutil.rmtree(killed / "checkpoints" / "2")  # as if killed before the first RL save
  train_and_evaluate(config, str(killed))
  sft_logged = [s for s, _ in metrics.read_scalars(str(killed / "sft"))["sft/loss"]]
  assert sft_logged == [1, 2, 3]  # logged once: the relaunch did not redo the warm start
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), build(config).state)
  states = []
  for workdir in (straight, killed):
    with checkpoint.Checkpointer(workdir, save_every=1) as ckpt:
      assert ckpt.all_steps() == [0, 2]
      states.append(ckpt.restore(2, abstract)[0])
  for a, b in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _parquet(path, table):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table(table), path)
  return path


BAD_FILES = {
  "non-utf8": (
    lambda p: p.with_suffix(".jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n'),
    r"bad\.jsonl:1: not UTF-8 text \(byte 0xe9 at column 16\); save the file as UTF-8",
  ),
  "deep-nesting": (
    lambda p: p.with_suffix(".jsonl").write_text(
      '{"prompt": "q", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    ),
    r"bad\.jsonl:1: JSON nested too deeply",
  ),
  "lone-surrogate": (
    lambda p: p.with_suffix(".jsonl").write_text('{"prompt": "q \\udc80", "answer": "1"}\n'),
    r"bad\.jsonl:1: field 'prompt' holds '\\\\udc80'",
  ),
  "10MB-line": (
    lambda p: p.with_suffix(".jsonl").write_text('{"prompt": "' + "x" * 10_000_000 + '"\n'),
    r"bad\.jsonl:1: not valid JSON",
  ),
  "parquet-wrong-schema": (
    lambda p: _parquet(p.with_suffix(".parquet"), {"question": ["q"], "answer": ["1"]}),
    r"bad\.parquet.*'prompt'",
  ),
  "parquet-prompt-not-text": (
    lambda p: _parquet(p.with_suffix(".parquet"), {"prompt": [1, 2], "answer": ["1", "2"]}),
    r"bad\.parquet.*prompt field 'prompt' holds a int",
  ),
  "all-answers-null": (
    lambda p: p.with_suffix(".jsonl").write_text('{"prompt": "q", "answer": null}\n'),
    r"bad\.jsonl.*null, NaN or empty answer",
  ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_data_files_stop_with_the_file_named(tmp_path, case):
  from jaxrl_llm.data import records

  write, message = BAD_FILES[case]
  write(tmp_path / "bad")
  (path,) = list(tmp_path.iterdir())
  with pytest.raises(records.DataError, match=message):
    records.load_records([str(path)])


def _committed(root):
  if not root.exists():
    return set()
  return {
    int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists()
  }


def _launch(workdir, *args, env=None):
  env = {**cli_env(), **(env or {})}
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  cmd += [f"--workdir={workdir}", *TINY_CLI, *args]
  return subprocess.Popen(
    cmd,
    cwd=REPO,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
    preexec_fn=default_sigint,
  )


def _wait_for_a_save(proc, root, timeout: float = 120) -> int:
  """Polls until a save's temporary directory appears under `root` (1) or `proc` ends (0)."""
  deadline = time.monotonic() + timeout
  while proc.poll() is None and time.monotonic() < deadline:
    if root.exists() and any(".orbax-checkpoint-tmp" in p.name for p in root.iterdir()):
      return 1
    time.sleep(0.001)
  return 0


def _wait_for_commits(proc, root, start: set, new: int, rng, timeout: float = 120):
  """Waits for `new` commits beyond `start` (none: a random time in start-up), then a random
  fraction of a second more, so the kill lands anywhere in a step or a save."""
  if new == 0:
    time.sleep(rng.uniform(0.5, 4))
    return
  deadline = time.monotonic() + timeout
  while proc.poll() is None and time.monotonic() < deadline:
    if len(_committed(root) - start) >= new:
      break
    time.sleep(0.005)
  time.sleep(rng.uniform(0, 0.3))


@pytest.mark.slow  # ~4 min: a dozen launches of the command line
def test_kill_9_at_random_points_and_mid_save_resumes_to_the_uninterrupted_result(tmp_path):
  """SIGKILL ten times (half the kills the moment a save's temporary directory appears, half
  at a random point of the run: during start-up, or a random time after its first or second
  new commit), relaunching each time: every relaunch resumes from the newest step committed
  before the kill (at most one checkpoint interval lost), and the final parameters equal an
  uninterrupted run's bit for bit. The random kills wait on the run's progress, not the clock,
  so a fast machine does not finish the run before the kills are done."""
  run = ("--config.sft.steps=0", "--config.train.num_steps=40", "--config.train.checkpoint_every=1")
  straight = tmp_path / "straight"
  proc = _launch(straight, *run)
  assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
  killed = tmp_path / "killed"
  root = killed / "checkpoints"
  rng = np.random.default_rng(0)
  mid_save = 0
  for i in range(10):
    start = _committed(root)
    proc = _launch(killed, *run)
    if i % 2 == 0:
      mid_save += _wait_for_a_save(proc, root)
    else:
      _wait_for_commits(proc, root, start, int(rng.integers(0, 3)), rng)
    before = _committed(root)
    proc.kill()
    proc.wait()
    if before and max(before) == 40:
      break  # finished before the kill
    relaunch = _launch(killed, *run, "--config.train.stop_after_steps=1")
    err = relaunch.communicate(timeout=600)[1]
    assert relaunch.returncode == 0, err[-3000:]
    if before:
      resumed = int(err.split("at step ")[1].split()[0]) if "resumed from" in err else 0
      assert resumed >= max(before), (resumed, sorted(before))
  assert mid_save >= 3, mid_save
  final = _launch(killed, *run)
  assert final.wait(timeout=600) == 0, final.stderr.read()[-3000:]
  config = tiny_config()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), build(config).state)
  states = []
  for workdir in (straight, killed):
    with checkpoint.Checkpointer(workdir, save_every=1) as ckpt:
      states.append(ckpt.restore(40, abstract)[0])
  for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The curves too: each step once, as the uninterrupted run logged it (a kill after a step's
  # events but before its save left them twice, the relaunch logging the step again).
  curves = [metrics.read_scalars(str(w))["rollout/reward_mean"] for w in (straight, killed)]
  assert [s for s, _ in curves[1]] == list(range(1, 41))
  assert curves[1] == curves[0]


def _wait_for(proc, pattern: str, timeout: float = 300) -> str:
  """Reads `proc`'s stderr until a line matches `pattern`; returns what it read."""
  seen, deadline = [], time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = proc.stderr.readline()
    if not line:
      break
    seen.append(line)
    if re.search(pattern, line):
      return "".join(seen)
  raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(seen)[-3000:])


@pytest.mark.parametrize(
  "when",
  [
    pytest.param("mid-run", marks=pytest.mark.slow),
    pytest.param("mid-save", marks=pytest.mark.extended),
  ],
)
def test_sigterm_saves_the_step_it_finished_and_the_relaunch_resumes_from_it(tmp_path, when):
  """A scheduler's SIGTERM (preemption): the run saves the step it has just finished, prints
  one line and exits 143; relaunching the same command resumes from that step and finishes.
  `mid-save` sends it the moment a periodic save's temporary directory appears."""
  run = ("--config.sft.steps=0", "--config.train.num_steps=400")
  run += ("--config.train.checkpoint_every=" + ("1" if when == "mid-save" else "1000"),)
  workdir = tmp_path / "w"
  root = workdir / "checkpoints"
  proc = _launch(workdir, *run)
  _wait_for(proc, r"step \d+/400")
  if when == "mid-save":
    assert _wait_for_a_save(proc, root), "no save began"
  proc.send_signal(signal.SIGTERM)
  err = proc.communicate(timeout=300)[1]
  assert proc.returncode == 143, err[-3000:]
  last = err.strip().splitlines()[-1]
  match = re.match(r"stopped by SIGTERM after step (\d+): checkpoint \1 is saved in ", last)
  assert match, err[-3000:]
  step = int(match.group(1))
  assert 0 < step < 400 and max(_committed(root)) == step
  relaunch = _launch(workdir, *run, "--config.train.stop_after_steps=2")
  err = relaunch.communicate(timeout=300)[1]
  assert relaunch.returncode == 0, err[-3000:]
  assert "resumed from" in err and f"at step {step}" in err, err[-3000:]
  assert max(_committed(root)) == step + 2


@pytest.mark.extended
def test_sigterm_while_xla_compiles_stops_at_once(tmp_path):
  """SIGTERM (or Ctrl-C) while XLA compiles (Python runs no handler inside that call): a fresh
  run stops at once with one line naming the program, exit 143 (130), nothing saved; so does a
  resumed run compiling its RL step, its checkpoint kept and resumed; and a run whose warm
  start just ended, its checkpoint 0 (the warm start) kept. (That run once went on to save
  step 1 first, counting the saved warm start as unsaved.)"""
  workdir, wide = tmp_path / "w", ("--config.model.d_model=128", "--config.model.mlp_dim=256")
  root = workdir / "checkpoints"

  def stopped(pattern, *args, sig=signal.SIGTERM):  # no compilation cache: each compiles
    for wait_s in (1.0, 2.0, 0.5):  # a loaded machine may reach the compile sooner or later
      before = _committed(root)
      proc = _launch(workdir, *wide, *args, env={"JAX_COMPILATION_CACHE_DIR": ""})
      _wait_for(proc, pattern)
      time.sleep(wait_s)  # inside the program's first call: tracing, then XLA
      proc.send_signal(sig)
      err = proc.communicate(timeout=300)[1]
      assert proc.returncode == 128 + sig, err[-3000:]
      assert err.count("stopped by ") == 1, err[-3000:]  # one line, though two threads may stop
      last = err.strip().splitlines()[-1]
      if " while compiling " in last or _committed(root) != before:
        return last  # the signal came inside the compilation (or a step was saved: checked)
    return last  # the signal missed the compilation three times: the caller's check fails

  fresh = ("--config.sft.steps=0", "--config.train.num_steps=2")
  last = stopped(r"compiling the held-out evaluation", *fresh, sig=signal.SIGINT)
  assert last == (  # nothing saved yet (it said "the checkpoints committed before it are intact")
    f"stopped by SIGINT (Ctrl-C) while compiling the held-out evaluation: no checkpoint was saved "
    f"yet in {workdir}; relaunch the same command to start"
  )
  last = stopped(r"compiling the held-out evaluation", *fresh)
  assert last == (  # nothing saved yet, and the line says so (it said "checkpoints ... kept")
    f"stopped by SIGTERM while compiling the held-out evaluation: no checkpoint was saved yet "
    f"in {workdir}; relaunch the same command to start"
  )
  assert _committed(root) == set()
  done = _launch(workdir, *wide, *fresh)
  assert done.wait(timeout=300) == 0 and max(_committed(root)) == 2
  more = ("--config.sft.steps=0", "--config.train.num_steps=4")
  last = stopped(r"compiling the RL step", *more)
  assert last.startswith("stopped by SIGTERM while compiling the RL step: "), last
  assert max(_committed(root)) == 2
  resumed = _launch(workdir, *wide, *more)
  err = resumed.communicate(timeout=300)[1]
  assert resumed.returncode == 0 and "at step 2" in err and max(_committed(root)) == 4, err[-3000:]

  workdir, root = tmp_path / "warm", tmp_path / "warm" / "checkpoints"
  last = stopped(r"compiling the held-out evaluation", "--config.sft.steps=20")
  assert last == (  # checkpoint 0 holds the warm start: nothing unsaved, cut at once
    f"stopped by SIGTERM while compiling the held-out evaluation: the checkpoints in {workdir} "
    "are kept; relaunch the same command to resume"
  )
  assert _committed(root) == {0}


def _until(path, proc, timeout: float = 300) -> None:
  """Polls until `path` exists; fails when `proc` ended first or the time ran out."""
  deadline = time.monotonic() + timeout
  while not path.exists():
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.monotonic() < deadline, f"{path} never appeared"
    time.sleep(0.05)


def _terminated(proc, within_s: float = 120) -> str:
  """Sends SIGTERM; `proc`'s stderr once it ended (killed, and the test failed, when it is
  still running after `within_s`)."""
  proc.send_signal(signal.SIGTERM)
  try:
    return proc.communicate(timeout=within_s)[1]
  except subprocess.TimeoutExpired as e:
    proc.kill()
    raise AssertionError(
      f"still running {within_s} s after SIGTERM:\n{proc.communicate()[1][-3000:]}"
    ) from e


def _hanging_tool(tmp_path, sft_steps: int):
  """(the file whose presence makes tests/host_tools.py's tool hang, the environment, the
  trainer's flags): countdown with that host tool under a 600 s limit per call."""
  tell = tmp_path / "hang"
  tests = os.path.join(REPO, "tests")
  env = {"PYTHONPATH": f"{tests}:{cli_env().get('PYTHONPATH', '')}", "HANG_WHEN": str(tell)}
  args = (
    "--config.task.name=countdown", "--config.sampling.tool=host:host_tools:hang_when_told",
    "--config.sampling.max_turns=2", f"--config.sft.steps={sft_steps}",
    "--config.train.num_steps=50", "--config.data.verifier_timeout_s=600",
  )  # fmt: skip
  return tell, env, args


@pytest.mark.extended
def test_sigterm_in_the_first_evaluation_after_a_warm_start_stops_there(tmp_path):
  """The warm start is saved as checkpoint 0, but the run still counted it as progress no
  checkpoint held: a SIGTERM during the first evaluation (a host tool's calls cut) compiled
  and trained a whole RL step on the error tokens the signal wrote, to save what was saved.
  Now the run stops after that evaluation (unrecorded), checkpoint 0 kept, exit 143."""
  tell, env, args = _hanging_tool(tmp_path, sft_steps=2)
  tell.touch()  # hangs from the first call: the evaluation at step 0, after the warm start
  proc = _launch(tmp_path / "run", *args, env=env)
  _until(tmp_path / "hang.hung", proc)
  err = _terminated(proc)
  assert proc.returncode == 143, err[-3000:]
  assert "eval step 0 not recorded: SIGTERM cut " in err and "compiling the RL step" not in err
  last = err.strip().splitlines()[-1]
  assert last == (  # checkpoint 0's save waited for: the line says it is kept, not "none saved"
    "stopped by SIGTERM during the first evaluation (checkpoint 0 holds the warm start): the "
    f"checkpoints in {tmp_path / 'run'} are kept; relaunch the same command to resume"
  ), err[-3000:]
  assert _committed(tmp_path / "run" / "checkpoints") == {0}


@pytest.mark.extended
def test_sigterm_while_the_evaluation_compiles_after_a_resume_saves_the_step_before_it(tmp_path):
  """A run resumed at step 1 trains step 2, then compiles its evaluation: the run still said
  it held no unsaved progress (step 1 was saved), so a SIGTERM cut that compilation at once
  and step 2 was lost. Now the compilation finishes, the evaluation runs, step 2 is saved and
  the run stops (exit 143)."""
  workdir = tmp_path / "run"
  args = ("--config.train.num_steps=4", "--config.train.eval_every=2")
  nocache = {"JAX_COMPILATION_CACHE_DIR": ""}  # the evaluation's compilation is not loaded
  first = _launch(workdir, *args, "--config.train.stop_after_steps=1", env=nocache)
  out = first.communicate(timeout=300)[1]
  assert first.returncode == 0, out[-3000:]
  assert _committed(workdir / "checkpoints") == {0, 1}
  proc = _launch(workdir, *args, env=nocache)
  _wait_for(proc, r"compiling the held-out evaluation")
  err = _terminated(proc)
  assert proc.returncode == 143, err[-3000:]
  assert "while compiling the held-out evaluation" not in err, err[-3000:]
  assert max(_committed(workdir / "checkpoints")) == 2, err[-3000:]
  assert 2 in [s for s, _ in metrics.read_scalars(str(workdir))["eval/accuracy"]]


@pytest.mark.extended
def test_sigterm_while_the_last_evaluation_compiles_stops_at_once_with_the_last_step_saved(
  tmp_path,
):
  """The last step is saved before its evaluation: a SIGTERM while that evaluation compiles (a
  resumed run's first) stops the run at once, nothing unsaved (before, the run waited for the
  compilation and the evaluation, then saved); a relaunch evaluates the saved last step."""
  workdir = tmp_path / "run"
  nocache = {"JAX_COMPILATION_CACHE_DIR": ""}  # the evaluation's compilation is not loaded
  first = _launch(workdir, "--config.train.num_steps=1", env=nocache)
  out = first.communicate(timeout=300)[1]
  assert first.returncode == 0, out[-3000:]
  proc = _launch(workdir, "--config.train.num_steps=2", env=nocache)
  _wait_for(proc, r"compiling the held-out evaluation")
  err = _terminated(proc)
  assert proc.returncode == 143, err[-3000:]
  assert "while compiling the held-out evaluation" in err.strip().splitlines()[-1], err[-3000:]
  assert max(_committed(workdir / "checkpoints")) == 2, err[-3000:]
  assert 2 not in _evaluated(workdir)
  again = _cli(workdir, "--config.train.num_steps=2")
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"{workdir} holds step 2 without its evaluation" in again.stderr, again.stderr[-3000:]
  assert 2 in _evaluated(workdir)


@pytest.mark.extended
def test_sigterm_while_a_host_tool_hangs_cuts_its_calls_and_the_run_stops_saved(tmp_path):
  """A host tool whose calls hang, under a 600 s limit per call: a SIGTERM waited for every
  decode step's calls in turn (the main thread waits inside the program; tens of minutes).
  Now the signal cuts the calls in flight and later ones (answered with the error token).
  During the first evaluation the run stops at once, that evaluation unrecorded and nothing
  saved; during an RL step the step ends, is saved, and the run stops (exit 143 both)."""
  tell, env, args = _hanging_tool(tmp_path, sft_steps=0)
  hung = tmp_path / "hang.hung"
  said = "SIGTERM: host tool 'host_tools.hang_when_told' calls are answered with the error token"

  tell.touch()  # hangs from the first call: the evaluation at step 0
  first = tmp_path / "first"
  proc = _launch(first, *args, env=env)
  _until(hung, proc)
  err = _terminated(proc)
  assert proc.returncode == 143, err[-3000:]
  assert said in err and "eval step 0 not recorded: SIGTERM cut " in err, err[-3000:]
  assert (
    err.strip()
    .splitlines()[-1]
    .startswith("stopped by SIGTERM during the first evaluation (nothing saved): ")
  ), err[-3000:]
  assert _committed(first / "checkpoints") == set()
  assert "eval/accuracy" not in metrics.read_scalars(str(first))

  tell.unlink()
  hung.unlink()
  second = tmp_path / "second"
  proc = _launch(second, *args, env=env)
  _wait_for(proc, r"step 1/50")  # one update done, its calls answered
  tell.touch()
  _until(hung, proc)
  err = _terminated(proc)
  assert proc.returncode == 143, err[-3000:]
  assert said in err, err[-3000:]
  last = re.fullmatch(
    r"stopped by SIGTERM after step (\d+): checkpoint \1 is saved in .*",
    err.strip().splitlines()[-1],
  )
  assert last, err[-3000:]
  assert max(_committed(second / "checkpoints")) == int(last.group(1)) >= 2


@pytest.mark.extended
def test_sigterm_during_start_up_or_the_warm_start_is_one_line_and_keeps_the_warm_start(tmp_path):
  """SIGTERM a moment after launch (imports, build): exit 143 and one line, nothing lost. SIGTERM
  during a 400-step warm start: its progress is saved and the relaunch resumes it there (each
  warm-start step logged once), then trains."""
  workdir = tmp_path / "w"
  early = _launch(workdir, "--config.train.num_steps=2")
  time.sleep(1.0)  # the interpreter is importing
  early.send_signal(signal.SIGTERM)
  err = early.communicate(timeout=300)[1]
  assert early.returncode == 143, err[-3000:]
  assert err.strip().splitlines()[-1].startswith("stopped by SIGTERM while "), err[-3000:]
  run = ("--config.sft.steps=400", "--config.train.log_every=1", "--config.train.num_steps=2")
  proc = _launch(workdir, *run)
  _wait_for(proc, r"sft [1-9]\d*/400")
  proc.send_signal(signal.SIGTERM)
  err = proc.communicate(timeout=300)[1]
  assert proc.returncode == 143, err[-3000:]
  last = err.strip().splitlines()[-1]
  match = re.match(r"stopped by SIGTERM during the warm start after sft step (\d+): ", last)
  assert match and "relaunch the same command to resume" in last, err[-3000:]
  done = int(match.group(1))
  assert 0 < done < 400
  relaunch = _launch(workdir, *run)
  err = relaunch.communicate(timeout=600)[1]
  assert relaunch.returncode == 0, err[-3000:]
  assert f"resuming the warm start after sft step {done}" in err, err[-3000:]
  losses = metrics.read_scalars(str(workdir / "sft"))["sft/loss"]
  assert [s for s, _ in losses] == list(range(1, 401))  # each warm-start step once


@pytest.mark.extended
def test_a_run_started_with_sigint_ignored_keeps_ignoring_it(tmp_path):
  """A background job of a shell starts with SIGINT ignored: a Ctrl-C meant for the shell's
  foreground job must not stop it (the loop installs its Ctrl-C handler only where SIGINT is
  not ignored). Sent after step 2 of 30, the run trains on to its last step and exits 0."""
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  cmd += [f"--workdir={tmp_path / 'w'}", *TINY_CLI, "--config.sft.steps=0"]
  cmd += ["--config.train.num_steps=30", "--config.train.checkpoint_every=1000"]
  proc = subprocess.Popen(
    cmd,
    cwd=REPO,
    env=cli_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
  )
  _wait_for(proc, r"step 2/30")
  proc.send_signal(signal.SIGINT)
  err = proc.communicate(timeout=300)[1]
  assert proc.returncode == 0 and "stopped by SIGINT" not in err, err[-3000:]
  assert max(_committed(tmp_path / "w" / "checkpoints")) == 30


def test_an_error_raised_while_ctrl_c_unwinds_still_counts_as_ctrl_c():
  """A save that Ctrl-C cut may fail again as the run closes its checkpointer: the command
  line reports the Ctrl-C (one line, exit 130), not that later error's traceback."""
  from jaxrl_llm import launch

  try:
    try:
      raise KeyboardInterrupt
    finally:
      raise RuntimeError("the save's thread was cut")
  except RuntimeError as e:
    assert launch.interrupted(e)
  assert not launch.interrupted(RuntimeError("a plain failure"))


@pytest.mark.extended
def test_ctrl_c_mid_save_is_one_line_and_the_relaunch_resumes_from_the_newest_commit(tmp_path):
  """Ctrl-C the moment a save's temporary directory appears (after step 5): the run
  prints one line (no traceback) and exits 130; the save it cut either committed or stays
  uncommitted, and the relaunch resumes from the newest committed step."""
  run = ("--config.sft.steps=0", "--config.train.num_steps=400")
  run += ("--config.train.checkpoint_every=1",)
  workdir = tmp_path / "w"
  root = workdir / "checkpoints"
  proc = _launch(workdir, *run)
  _wait_for(proc, r"step 5/400")
  while not any("tmp" in p.name for p in root.iterdir()):
    time.sleep(0.001)
  proc.send_signal(signal.SIGINT)
  err = proc.communicate(timeout=300)[1]
  assert proc.returncode == 130, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last == (
    "stopped by SIGINT (Ctrl-C): the checkpoints committed before it are intact in "
    f"{workdir}; relaunch the same command to resume"
  ), err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  step = max(_committed(root))
  assert 1 <= step < 400
  relaunch = _launch(workdir, *run, "--config.train.stop_after_steps=2")
  err = relaunch.communicate(timeout=300)[1]
  assert relaunch.returncode == 0, err[-3000:]
  assert "resumed from" in err and f"at step {step}" in err, err[-3000:]
  assert max(_committed(root)) == step + 2
  assert not [p.name for p in root.iterdir() if "tmp" in p.name]  # the cut save is cleared


def test_background_thread_failures_are_one_log_line_unless_debugging(tmp_path):
  """What a failing asynchronous save prints from its threads: an exception escaping a thread,
  one Python can only report as unraisable, and a library error logged with its traceback; a
  Ctrl-C landing in a garbage-collection callback is not shown (it printed after the run's
  `stopped by SIGINT` line, which then was not the last)."""
  script = tmp_path / "noisy.py"
  script.write_text(
    textwrap.dedent(
      """
      import gc, sys, threading
      from absl import logging
      from jaxrl_llm import terminal as cli

      class Dying:
        def __del__(self):
          raise RuntimeError("Event loop is closed")

      class Interrupted:  # a Ctrl-C landing in a garbage-collection callback (XLA's)
        def __del__(self):
          raise KeyboardInterrupt

      def run(argv):
        cli.quiet_library_logs(tracebacks="--debug" in sys.argv)
        t = threading.Thread(target=lambda: 1 / 0, name="saver")
        t.start()
        t.join()
        Dying()
        Interrupted()
        gc.collect()
        try:
          raise OSError(28, "No space left on device")
        except OSError:  # as orbax's save thread logs it: from a module under orbax/
          import logging as std

          where = "/site-packages/orbax/checkpoint/future.py"
          record = std.LogRecord("absl", std.ERROR, where, 1, "save failed", None, sys.exc_info())
          std.getLogger("absl").handle(record)

      logging.use_absl_handler()  # as app.run does for the command line
      run(sys.argv)
      """
    )
  )
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  run = [sys.executable, str(script)]
  quiet = subprocess.run(run, capture_output=True, text=True, cwd=REPO, env=env)
  loud = subprocess.run([*run, "--debug"], capture_output=True, text=True, cwd=REPO, env=env)
  assert quiet.returncode == loud.returncode == 0, quiet.stderr[-2000:]
  assert "Traceback" not in quiet.stderr, quiet.stderr
  assert "thread saver stopped: ZeroDivisionError" in quiet.stderr
  assert "save failed" in quiet.stderr
  # a callback after its event loop closed, and a Ctrl-C in one: the log file only (the full-disk
  # test's run printed three such lines after its `error: disk full` line; CI at d479cd0)
  assert "Event loop is closed" not in quiet.stderr, quiet.stderr
  assert "KeyboardInterrupt" not in quiet.stderr, quiet.stderr
  assert loud.stderr.count("Traceback") >= 2  # --debug keeps them


@pytest.mark.extended
def test_a_workdir_of_another_recipe_is_not_resumed_without_saying_so(tmp_path, caplog):
  """A finished (or interrupted) run's workdir, relaunched under other learner settings (here
  DAPO's clip-higher over GRPO's) or another task: refused with the changed fields named,
  nothing written; with train.resume_changed it resumes and says what changed; a memory knob
  or the eval set's size is no change."""
  workdir = str(tmp_path / "w")
  train_and_evaluate(tiny_config(**{"train.num_steps": 2}), workdir)
  before = sorted(p.name for p in (tmp_path / "w").iterdir())
  dapo = {"train.num_steps": 4, "objective.clip_high": 0.28, "aggregation.name": "token_mean"}
  with pytest.raises(ConfigError) as err:
    train_and_evaluate(tiny_config(**dapo), workdir)
  message = str(err.value)
  assert "objective.clip_high: 0.2 → 0.28" in message  # 0.2: the objective's default, used
  assert "aggregation.name: 'seq_mean_token_mean' → 'token_mean'" in message
  assert "--config.train.resume_changed=True" in message
  assert sorted(p.name for p in (tmp_path / "w").iterdir()) == before
  with caplog.at_level("WARNING"):
    train_and_evaluate(tiny_config(**dapo, **{"train.resume_changed": True}), workdir)
  assert any("changed settings" in r.getMessage() for r in caplog.records)
  # Against the newest record (the DAPO resume), a microbatching change alone is no change.
  more = {**dapo, "train.num_steps": 6, "rl.num_microbatches": 2}
  train_and_evaluate(tiny_config(**more), workdir)
  with checkpoint.Checkpointer(workdir, save_every=1) as ckpt:
    assert ckpt.all_steps()[-1] == 6
  # Another task is another experiment (it resumed silently); the eval set's size is not.
  with pytest.raises(ConfigError, match=r"task\.name: 'reverse' → 'sort'"):
    train_and_evaluate(tiny_config(**{**more, "train.num_steps": 8, "task.name": "sort"}), workdir)
  train_and_evaluate(tiny_config(**{**more, "train.num_steps": 8, "task.eval_size": 8}), workdir)
  with checkpoint.Checkpointer(workdir, save_every=1) as ckpt:
    assert ckpt.all_steps()[-1] == 8


@pytest.mark.slow
def test_a_run_record_of_the_wrong_shape_is_one_line_and_the_checkpoints_stay(tmp_path):
  """config.json (or config.resume-N.json) valid JSON but not a record, `[]` or
  `{"config": 5}`: an AttributeError / TypeError traceback; now one line like invalid JSON's."""
  workdir = tmp_path / "w"
  train_and_evaluate(tiny_config(**{"train.num_steps": 1}), str(workdir))
  good = (workdir / "config.json").read_text()
  for text in ("[]", '{"config": 5}'):
    (workdir / "config.json").write_text(text)
    with pytest.raises(ConfigError) as err:
      train_and_evaluate(tiny_config(**{"train.num_steps": 2}), str(workdir))
    assert str(err.value) == (
      f'{workdir / "config.json"}: the run record is not an object with a "config" object; '
      "restore it, or move it aside to resume (the run then records its config anew, and what "
      "changed since cannot be checked)"
    )
    with checkpoint.Checkpointer(str(workdir), save_every=1) as ckpt:
      assert ckpt.all_steps() == [1]
  (workdir / "config.json").write_text(good)
  train_and_evaluate(tiny_config(**{"train.num_steps": 2}), str(workdir))


def test_a_resume_without_a_run_record_says_nothing_can_be_checked(tmp_path, caplog):
  """Checkpoints without config.json (moved aside, as a refusal advises, or copied alone)
  resumed under any changed seed, template or prompt files without a word; now one warning
  says nothing could be checked, and the launch records its config anew."""
  import logging

  workdir = tmp_path / "w"
  train_and_evaluate(tiny_config(**{"train.num_steps": 1}), str(workdir))
  (workdir / "config.json").unlink()
  with caplog.at_level(logging.WARNING):
    train_and_evaluate(tiny_config(**{"train.num_steps": 2, "seed": 7}), str(workdir))
  said = [r.getMessage() for r in caplog.records if "without a run record" in r.getMessage()]
  assert said == [
    f"resuming {workdir} without a run record in {workdir} (config.json): the settings and "
    "prompt files of its checkpoints' run cannot be checked against these; this launch "
    "records them anew"
  ], said
  assert (workdir / "config.json").exists()


def test_a_workdir_of_another_model_names_the_model_first(tmp_path):
  """Relaunched as a mixture of experts over a dense run's workdir, with a learned setting
  changed too: the refusal names the model's change, which no setting lets a resume cross (it
  named only the learned setting and offered train.resume_changed, whose resume then failed on
  the model); nothing is written."""
  workdir = str(tmp_path / "w")
  train_and_evaluate(tiny_config(**{"train.num_steps": 1}), workdir)
  before = sorted(p.name for p in (tmp_path / "w").iterdir())
  moe = {"train.num_steps": 2, "model.moe_num_experts": 4, "objective.clip_high": 0.28}
  with pytest.raises(checkpoint.CheckpointMismatchError) as err:
    train_and_evaluate(tiny_config(**moe), workdir)
  assert "model.moe_num_experts=0" in str(err.value) and "resume_changed" not in str(err.value)
  assert sorted(p.name for p in (tmp_path / "w").iterdir()) == before


@pytest.mark.extended
def test_a_ctrl_c_that_python_drops_in_a_gc_callback_still_stops_the_run(tmp_path):
  """Python drops an exception raised in a finalizer or a gc callback (it prints "Exception
  ignored") and some libraries catch every exception: a Ctrl-C whose KeyboardInterrupt lands
  in one was lost, and the run went on to its last step and exited 0. Now the loop raises it
  again after the step, without the dropped one's traceback; the steps it committed stay and
  the run stops early."""
  import gc

  step_2, sent = tmp_path / "checkpoints" / "2", []

  def ctrl_c_inside(phase, info):  # once step 2 is saved, at the next collection
    if not sent and step_2.exists():
      sent.append(phase)
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(1000):  # the handler runs here: its KeyboardInterrupt is dropped
        pass

  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  unraisable, reported = sys.unraisablehook, []
  sys.unraisablehook = lambda u: reported.append(type(u.exc_value).__name__)  # its traceback
  gc.callbacks.append(ctrl_c_inside)
  config = tiny_config(**{"train.num_steps": 12, "train.checkpoint_every": 1})
  try:
    with pytest.raises(KeyboardInterrupt):
      train_and_evaluate(config, str(tmp_path))
  finally:
    gc.callbacks.remove(ctrl_c_inside)
    signal.signal(signal.SIGINT, previous)
    sys.unraisablehook = unraisable
  assert sent and "KeyboardInterrupt" not in reported, reported  # no "Exception ignored"
  with checkpoint.Checkpointer(tmp_path, save_every=1) as ckpt:
    steps = ckpt.all_steps()
  assert 2 <= max(steps) < 12, steps


def test_ctrl_c_entered_off_the_main_thread_leaves_python_s_hooks_as_they_were():
  """Off the main thread no signal handler can be installed; `CtrlC` then leaves
  `sys.unraisablehook` alone too (it replaced it and never put it back)."""
  import threading

  from jaxrl_llm.run.preempt import CtrlC

  before, seen = sys.unraisablehook, []

  def enter_and_leave():
    with CtrlC() as ctrl_c:
      seen.append(sys.unraisablehook is before)
      ctrl_c.check()  # nothing was signalled

  thread = threading.Thread(target=enter_and_leave)
  thread.start()
  thread.join()
  assert seen == [True] and sys.unraisablehook is before


def _group(pgid: int, *, parent: int | None = None) -> list[int]:
  """The live processes of process group `pgid` (zombies aside); with `parent`, those whose
  parent is not `parent` (the grandchildren: the fork server's workers)."""
  out = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:  # gone meanwhile
        continue
      if fields[0] != "Z" and int(fields[2]) == pgid:
        if parent is None or int(fields[1]) != parent:
          out.append(int(entry))
  return out


@pytest.mark.extended
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc")
def test_sigterm_leaves_no_verifier_worker_behind(tmp_path):
  """A run whose rewards are scored in host worker processes, stopped by SIGTERM (exit 143,
  which skips the interpreter's teardown), takes its workers with it: nothing of its process
  group outlives it, and a worker it started answers SIGTERM by stopping (the command line's
  SIGTERM flag is the trainer's own, not inherited by the workers through the fork server)."""
  from text_fixtures import math_file_run

  overrides, _ = math_file_run(tmp_path)
  overrides.update({"train.num_steps": 400, "train.eval_every": 1000, "train.log_every": 1})
  overrides["train.checkpoint_every"] = 1000
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  cmd += [f"--workdir={tmp_path / 'w'}", *TINY_MODEL, "--config.sft.steps=0"]
  cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
  proc = subprocess.Popen(
    cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    start_new_session=True,  # its own process group: the trainer's pid is the group's id
  )  # fmt: skip
  try:
    _wait_for(proc, r"step \d+/400")
    workers = [p for p in _group(proc.pid, parent=proc.pid) if p != proc.pid]
    assert workers, "no worker process: the rewards were not scored in processes"
    os.kill(workers[0], signal.SIGTERM)  # a worker stops when told
    deadline = time.monotonic() + 10
    while workers[0] in _group(proc.pid) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert workers[0] not in _group(proc.pid), "a worker ignored SIGTERM"
    _wait_for(proc, r"step \d+/400")  # the run goes on: a lost worker is replaced
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 143, err[-3000:]
    deadline = time.monotonic() + 10
    while _group(proc.pid) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not _group(proc.pid), "worker processes outlived the run"
  finally:
    for pid in _group(proc.pid):
      os.kill(pid, signal.SIGKILL)


def test_a_second_trainer_in_a_running_workdir_is_refused_and_a_kill_frees_it(tmp_path):
  """Nothing stopped a second trainer launched on a workdir in use: both trained, both wrote
  the same checkpoints, one moved the other's finished step aside, and the events held each
  step twice. The first launch holds a lock on the directory; the second is one line naming
  the first's launch (exit 2) and writes nothing; a kill -9 of the first frees the lock."""
  import fcntl

  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  cmd += [f"--workdir={workdir}", *TINY_CLI, "--config.train.num_steps=100000"]
  first = subprocess.Popen(
    cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  try:
    log = workdir / "log.txt"
    deadline = time.monotonic() + 120
    while not (log.exists() and "### " in log.read_text()) and time.monotonic() < deadline:
      assert first.poll() is None, "the first trainer ended"
      time.sleep(0.2)
    before = log.read_text()
    second = _cli(workdir, "--config.train.num_steps=2")
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
    assert lines[0].startswith(
      f"error: --workdir={workdir}: another trainer is running in it (the last launch in its "
      "log.txt: "
    )
    assert "--config.train.num_steps=100000); wait" in lines[0]  # the first's launch line
    assert lines[0].endswith("; wait for it to end or stop it, or give another --workdir")
    assert log.read_text().startswith(before) and "num_steps=2" not in log.read_text()
  finally:
    first.kill()  # SIGKILL: no handler runs
    first.wait(timeout=60)
  fd = os.open(workdir, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while anyone holds it
  finally:
    os.close(fd)


def test_a_changed_launch_that_saved_nothing_leaves_the_run_record_as_it_was(tmp_path):
  """A launch under changed settings (train.resume_changed) wrote config.resume-<step>.json
  before its first update; killed before it saved a step, it left the workdir refusing the
  original command (`other settings ... 0.9 → 0.7`), though every checkpoint ran at 0.7. The
  records of launches that saved nothing past the resumed step are not read, and the next
  launch moves them aside (kept, with a warning)."""
  workdir = tmp_path / "run"
  done = _cli(workdir, "--config.train.num_steps=2", "--config.train.checkpoint_every=2")
  assert done.returncode == 0, done.stderr[-2000:]
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  cmd += [f"--workdir={workdir}", *TINY_CLI, "--config.train.num_steps=100000"]
  cmd += ["--config.sampling.temperature=0.9", "--config.train.resume_changed=True"]
  changed = subprocess.Popen(
    cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  try:
    deadline = time.monotonic() + 120
    while not (workdir / "config.resume-2.json").exists() and time.monotonic() < deadline:
      assert changed.poll() is None, "the changed launch ended"
      time.sleep(0.2)
  finally:
    changed.kill()  # before its first checkpoint (every 1000 steps by default here)
    changed.wait(timeout=60)
  assert max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == 2
  again = _cli(workdir, "--config.train.num_steps=3", "--config.train.checkpoint_every=1")
  assert again.returncode == 0, again.stderr[-2000:]
  assert "saved no step after it, so no checkpoint ran under its settings" in again.stderr
  names = sorted(p.name for p in workdir.iterdir() if p.name.startswith("config"))
  assert names[:2] == ["config.json", "config.resume-2.json"] and len(names) == 3, names
  assert re.fullmatch(r"config\.resume-2\.unsaved-\d{8}T\d{6}\.json", names[2]), names
  first, now, aside = (json.loads((workdir / n).read_text())["config"] for n in names)
  assert aside["sampling"]["temperature"] == 0.9  # kept, as the killed launch wrote it
  assert now["sampling"]["temperature"] == first["sampling"]["temperature"] != 0.9
