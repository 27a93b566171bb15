"""Packs: a sweep's runs trained as one vmapped program, each run equal to itself trained alone.

The oracle of every test here is the single run: the same config trained by
`train_and_evaluate`, its scalars read back from its TensorBoard events and its parameters from
its orbax checkpoint.
"""

import json
import logging
import pathlib
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import parsed
import pytest
from conftest import lowerings, tiny_config
from etils import epath
from parsed import build, build_pack, take_out, train_and_evaluate, train_pack

from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.models import hf
from jaxrl_llm.rl import init_reference
from jaxrl_llm.run import to_global_batch
from jaxrl_llm.run.loop import train_iterator
from jaxrl_llm.run.pack import (
  batch_to_device,
  pack_iterator,
  packable_fields,
  packed_keys,
  run_name,
  unstack,
  varied_fields,
)

# Two runs that differ in a clip width, the sampling temperature, the learning rate and the seed.
GRID = (
  {"objective.clip_high": 0.2, "sampling.temperature": 0.7, "optim.learning_rate": 3e-4, "seed": 0},
  {
    "objective.clip_high": 0.28,
    "sampling.temperature": 1.0,
    "optim.learning_rate": 1e-3,
    "seed": 1,
  },
)
STEPS = 4


def _configs(grid=GRID, **common):
  return [tiny_config(**{"train.num_steps": STEPS, **common, **point}) for point in grid]


def _names(configs):
  parsed = [parse(c) for c in configs]
  return [run_name(c, varied_fields(parsed)) for c in parsed]


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
  """Every logged scalar but the timings (wall-clock), by tag."""
  return {
    k: v for k, v in metrics_lib.read_scalars(str(logdir)).items() if not k.startswith("perf/")
  }


def _params(workdir, step: int, run: int | None = None):
  """The parameters of the checkpoint at `step` (run `run` of a pack's)."""
  state = ocp.StandardCheckpointer().restore(
    epath.Path(workdir) / "checkpoints" / str(step) / "state"
  )
  params = state["params"]
  return params if run is None else jax.tree.map(lambda x: x[run], params)


def _assert_same_scalars(got, want, steps=None):
  assert set(got) == set(want)
  for tag in want:
    w = [(s, v) for s, v in want[tag] if steps is None or s in steps]
    g = [(s, v) for s, v in got[tag] if steps is None or s in steps]
    assert [s for s, _ in g] == [s for s, _ in w], tag
    np.testing.assert_allclose(
      [v for _, v in g], [v for _, v in w], rtol=1e-5, atol=1e-5, err_msg=tag
    )


def _assert_same_params(got, want):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


@pytest.mark.extended
def test_packed_runs_equal_their_runs_alone_resume_and_come_out_whole(tmp_path, caplog):
  """One pack serves every check of the acceptance list (it is the costly part): each run
  equals the run trained alone (scalars at every step, final parameters, last evaluation), has
  its own TensorBoard folder and HParams session, a killed pack resumes to the uninterrupted
  result, a run taken out continues alone as in the pack, another grid is refused. Each run's
  closing summary lines carry its label, as its step and eval lines do."""
  configs, root = _configs(), tmp_path / "pack"
  with caplog.at_level(logging.INFO):
    names, final = _names(configs), train_pack(_configs(), str(root))
  for start in ("trained RL steps 0..", "eval from step 0 to ", "checkpoints in "):
    lines = [r.getMessage() for r in caplog.records if start in r.getMessage()]
    labels = {x.split("] ")[0] for x in lines if x.startswith("[") and "] " + start in x}
    assert len(lines) == len(configs) == len(labels), lines
  for r, (config, name) in enumerate(zip(configs, names, strict=True)):
    alone = tmp_path / "alone" / name
    final_alone = train_and_evaluate(config, str(alone))
    _assert_same_scalars(_scalars(root / name), _scalars(alone))
    _assert_same_params(_params(root, STEPS, r), _params(alone, STEPS))
    assert final[name] == pytest.approx(final_alone, abs=1e-5)
  _check_run_folders(root, configs, names)
  _check_another_grid_is_refused(root)
  _check_resume_and_take_out(tmp_path, root, names)


def _check_run_folders(root, configs, names):
  assert sorted(p.name for p in root.iterdir()) == sorted([*names, "checkpoints"])
  for config, name in zip(configs, names, strict=True):
    hparams = metrics_lib.read_hparams(str(root / name))["hparams"]
    for field, value in GRID[names.index(name)].items():
      assert hparams[field] == pytest.approx(value), (name, field)
    saved = json.loads((root / name / "config.json").read_text())
    assert saved["config"]["objective"]["clip_high"] == pytest.approx(config.objective.clip_high)
    assert "eval/accuracy" in _scalars(root / name)


def _check_another_grid_is_refused(root):
  before = sorted(p.name for p in (root / "checkpoints").iterdir())
  other = [dict(GRID[0]), {**GRID[1], "objective.clip_high": 0.3}]
  with pytest.raises(Exception, match=r"pack\.") as err:
    train_pack(_configs(other), str(root))
  assert len(str(err.value).splitlines()) == 1
  assert sorted(p.name for p in (root / "checkpoints").iterdir()) == before
  assert not any("0.3" in p.name for p in root.iterdir())  # nothing written for the other grid


def _check_resume_and_take_out(tmp_path, root, names):
  killed = tmp_path / "killed"
  configs = _configs(**{"train.stop_after_steps": 2})
  train_pack(configs, str(killed))
  assert max(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit()) == 2
  for c in configs:
    c.train.stop_after_steps = 0
  assert take_out(configs, str(killed), names[1], str(tmp_path / "out")) == 2
  train_pack(configs, str(killed))
  train_and_evaluate(configs[1], str(tmp_path / "out"))
  for r, name in enumerate(names):
    _assert_same_scalars(_scalars(killed / name), _scalars(root / name))
    _assert_same_params(_params(killed, STEPS, r), _params(root, STEPS, r))
  _assert_same_scalars(_scalars(tmp_path / "out"), _scalars(killed / names[1]))
  _assert_same_params(_params(tmp_path / "out", STEPS), _params(killed, STEPS, 1))
  _check_hugging_face_export(tmp_path / "out", tmp_path / "hf", _params(killed, STEPS, 1))


def _check_hugging_face_export(workdir, out, params):
  """The run taken out converts to a Hugging Face checkpoint that holds its parameters."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
  import hf_convert

  summary = hf_convert.main(["export", f"--workdir={workdir}", f"--out={out}"])
  assert summary["step"] == STEPS
  _, exported = hf.load_checkpoint(out)
  _assert_same_params(exported, params)


@pytest.mark.extended
@pytest.mark.parametrize("at_once", [0, 1])
def test_the_packed_step_compiles_once(at_once):
  pack = build_pack(_configs(**{"mesh.runs_at_once": at_once}))
  data = pack_iterator(pack)
  state = pack.state
  for step in range(3):
    with lowerings() as lowered:
      batch = batch_to_device(next(data), pack.exp.mesh)
      state, _ = pack.exp.program.step(state, batch, packed_keys(state.rng, step), pack.values)
    assert step == 0 or not lowered, (step, lowered)  # no program compiles after the first step


@pytest.mark.extended
def test_stacking_unstacking_and_the_reference_copy_each_run_as_one_program():
  # One small multi-device program per leaf is a burst of launches that, on XLA:CPU, can fill a
  # device's queue while an earlier program's collective waits for that device: the process
  # then stalls for good (a pack's warm start did, about one launch in five under load).
  pack = build_pack(_configs(**{"mesh.runs": 2, "kl.beta": 0.05}))
  shardings = pack.exp.state_shardings
  jax.clear_caches()  # every program below compiles here, once per distinct program
  with lowerings() as compiled:
    states = [unstack(pack.state, r, shardings) for r in range(pack.size)]
    state = init_reference(pack.stacked(states), 0.05)
  assert sorted(compiled.elements()) == ["jit(_copies)", "jit(_stack)", "jit(_unstack)"]
  assert jax.tree.structure(state.ref_params) == jax.tree.structure(pack.state.params)
  for ref, params in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(pack.state.params)):
    np.testing.assert_array_equal(jax.device_get(ref), jax.device_get(params))


def test_a_field_that_changes_the_program_is_refused_with_the_packable_ones():
  configs = _configs([{"sampling.group_size": 2}, {"sampling.group_size": 4}])
  with pytest.raises(ConfigError) as err:
    build_pack(configs)
  msg = str(err.value)
  assert len(msg.splitlines()) == 1
  assert "sampling.group_size" in msg and "objective.clip_high" in msg and "seed" in msg


def test_a_pack_may_not_mix_runs_with_and_without_a_kl_term():
  with pytest.raises(ConfigError, match=r"kl\.beta > 0 or all kl\.beta = 0"):
    build_pack(_configs([{"kl.beta": 0.0}, {"kl.beta": 0.01}]))


def test_a_runs_axis_that_does_not_divide_the_pack_is_refused():
  configs = _configs([{"seed": s} for s in range(3)], **{"mesh.runs": 2})
  with pytest.raises(ConfigError, match=r"mesh.runs=2 does not divide the pack's 3 runs"):
    build_pack(configs)


def test_a_single_run_with_a_runs_axis_is_refused():
  with pytest.raises(ConfigError, match=r"a single run needs mesh\.runs=1"):
    build(tiny_config(**{"mesh.runs": 2}))


def test_the_packable_fields_cover_the_sweep_fields():
  """The fields the sweeps of the studies vary (clip widths of every objective, sampling,
  learning rate, regularisers, seed) pack; those that change the program do not."""
  sections = {
    "sampling": ("temperature", "top_p", "top_k"),
    "objective": ("clip_low", "clip_high", "clip_log", "tau_pos", "tau_neg", "is_clip_high"),
    "optim": ("learning_rate",),
    "kl": ("beta",),
    "rl": ("entropy_coef",),
  }
  wanted = {"seed"} | {f"{s}.{f}" for s, names in sections.items() for f in names}
  fields = set(packable_fields())
  assert wanted <= fields
  assert not fields & {"objective.name", "objective.dual_clip", "sampling.group_size"}


def _single_steps(config, steps: int):
  """(metrics of each of `steps` fused steps, final params) of `config` trained alone."""
  exp = build(config)
  state, it = init_reference(exp.state, exp.config.kl.beta), train_iterator(exp)
  out = []
  for i in range(steps):
    batch = to_global_batch(next(it), exp.batch_sharding)
    state, m = exp.rl_step(state, batch, jax.random.fold_in(state.rng, i))
    out.append(jax.device_get(m))
  return out, jax.device_get(state.params)


def _packed_steps(configs, steps: int):
  """The metrics of `steps` packed steps of `configs`, per run."""
  pack = build_pack(configs)
  state = init_reference(pack.state, pack.configs[0].kl.beta)
  data = pack_iterator(pack)
  out = []
  for i in range(steps):
    batch = batch_to_device(next(data), pack.exp.mesh)
    state, m = pack.exp.program.step(state, batch, packed_keys(state.rng, i), pack.values)
    out.append(jax.device_get(m))
  own = [jax.device_get(unstack(state, r).params) for r in range(pack.size)]
  return [([unstack(m, r) for m in out], own[r]) for r in range(pack.size)]


def _assert_same_steps(packed, configs, steps: int):
  for config, (own, params) in zip(configs, packed, strict=True):
    alone, alone_params = _single_steps(config, steps)
    for got, want in zip(own, alone, strict=True):
      assert set(got) == set(want)
      for tag in want:
        np.testing.assert_allclose(got[tag], want[tag], rtol=1e-5, atol=1e-5, err_msg=tag)
    _assert_same_params(params, alone_params)


@pytest.mark.extended
def test_every_kind_of_packable_field_gives_each_run_its_own_value():
  """top-k / top-p (traced, on in one run and off in the other), the KL and entropy
  coefficients and the overlong shaping, packed, equal each run alone step by step."""
  common = {"kl.beta": 0.01, "shaping.name": "soft_overlong", "sampling.max_new_tokens": 8}
  grid = (
    {"sampling.top_k": 0, "sampling.top_p": 0.9, "kl.beta": 0.01, "rl.entropy_coef": 0.0,
     "shaping.weight": 1.0, "shaping.cache_len": 2},
    {"sampling.top_k": 5, "sampling.top_p": 1.0, "kl.beta": 0.05, "rl.entropy_coef": 0.01,
     "shaping.weight": 0.5, "shaping.cache_len": 4},
  )  # fmt: skip
  configs = [tiny_config(**{**common, **point}) for point in grid]
  _assert_same_steps(_packed_steps(configs, 2), configs, 2)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.8), (5, 0.8), (64, 0.5)])
def test_traced_top_k_and_top_p_restrict_as_the_static_ones(top_k, top_p):
  from jaxrl_llm.sampling import _restrict

  logp = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(0), (4, 64)) * 3)
  traced = jax.jit(lambda x, k, p: _restrict(x, k, p))(logp, top_k, top_p)
  np.testing.assert_array_equal(traced, _restrict(logp, top_k, top_p))


@pytest.mark.extended
def test_the_default_configs_2x2x2_grid_packed_equals_each_run_alone(tmp_path):
  """The acceptance grid on the default config itself (warm start included, 6 RL steps):
  clip_high x temperature x seed, every run of the pack against the run alone."""
  from jaxrl_llm.config import default_config

  def config(clip, temp, seed):
    c = default_config()
    c.objective.clip_high, c.sampling.temperature, c.seed = clip, temp, seed
    c.train.num_steps, c.train.eval_every, c.train.log_every, c.mesh.data = 6, 3, 1, 1
    return c

  configs = [config(c, t, s) for c in (0.2, 0.28) for t in (0.7, 1.0) for s in (0, 1)]
  names = _names(configs)
  train_pack(configs, str(tmp_path / "pack"))
  for r, (c, name) in enumerate(zip(configs, names, strict=True)):
    train_and_evaluate(c, str(tmp_path / name))
    _assert_same_scalars(_scalars(tmp_path / "pack" / name), _scalars(tmp_path / name))
    _assert_same_params(_params(tmp_path / "pack", 6, r), _params(tmp_path / name, 6))


@pytest.mark.extended
def test_a_pack_of_moe_runs_equals_each_run_alone():
  """The MoE default (routing recorded by the sampler, the old pass, grouped experts), packed
  over clip_high, step by step against the single runs."""
  configs = [tiny_config("moe_default", **{"objective.clip_high": c}) for c in (0.2, 0.28)]
  _assert_same_steps(_packed_steps(configs, 2), configs, 2)


def _parity(completion: str, reference: str) -> float:
  """A verifier whose value varies with the text (a random policy's math is never right)."""
  return float(len(completion) % 2)


@pytest.fixture
def file_configs(tmp_path, monkeypatch):
  """Two runs on a JSONL math file with host verifiers (BPE tokenizer, chat template), varying
  the clip width, the temperature and the seed."""
  from text_fixtures import math_file_run

  from jaxrl_llm.data import verifiers

  monkeypatch.setitem(verifiers.REWARD_FNS, "parity", _parity)
  overrides, _ = math_file_run(tmp_path)
  overrides["task.reward_weights"] = {"math_correct": 1.0, "parity": 0.5}
  return _configs(GRID, **overrides)


def _always_fails(completion: str, reference: str) -> float:
  """A verifier broken for every input."""
  raise ImportError("no module named 'the_checker'")


@pytest.mark.extended
def test_a_verifier_failing_every_call_stops_a_pack_keeping_its_checkpoints(
  file_configs, tmp_path, monkeypatch
):
  """In a pack every run has the verifier guard: a term failing on every call of a run's
  completions for train.max_failed_verifier_steps steps stops that run (its folder records
  why); when it fails in every run the pack stops with one line naming the last run, the term
  and the step; the pack's checkpoints before it are kept."""
  from jaxrl_llm.data import verifiers
  from jaxrl_llm.run import VerifierError

  monkeypatch.setitem(verifiers.REWARD_FNS, "parity", _always_fails)
  for config in file_configs:
    config.train.checkpoint_every, config.train.max_failed_verifier_steps = 1, 2
  root = tmp_path / "pack"
  with pytest.raises(VerifierError) as err:
    train_pack(file_configs, str(root))
  first, last = _names(file_configs)[0], _names(file_configs)[-1]
  assert str(err.value).startswith(f"[{last}] rl step 2: reward term 'parity' failed on all 16")
  stopped = json.loads((root / first / "stopped.json").read_text())
  assert stopped["step"] == 2 and stopped["why"].startswith(f"[{first}] rl step 2: reward term")
  assert sorted(int(p.name) for p in (root / "checkpoints").iterdir() if p.name.isdigit()) == [1]
  errors = metrics_lib.read_scalars(str(root / first))["verifier/errors/parity"]
  assert [v for _, v in errors] == [16, 16]


@pytest.mark.extended
def test_a_packed_prompt_file_sweep_equals_its_runs_alone(file_configs, tmp_path):
  """A clip x temperature x seed pack on a prompt file, trained by `train_pack` (the host
  evaluation included), against `train_and_evaluate` of each run: every logged scalar, the
  final parameters and the last evaluation."""
  root, names = tmp_path / "pack", _names(file_configs)
  final = train_pack(file_configs, str(root))
  clock = lambda s: {k: v for k, v in s.items() if k != "verifier/seconds"}  # noqa: E731
  for r, (config, name) in enumerate(zip(file_configs, names, strict=True)):
    alone = tmp_path / "alone" / name
    final_alone = train_and_evaluate(config, str(alone))
    _assert_same_scalars(clock(_scalars(root / name)), clock(_scalars(alone)))
    _assert_same_params(_params(root, 3, r), _params(alone, 3))
    assert final[name] == pytest.approx(final_alone, abs=1e-5)
    assert {"eval/accuracy", "reward/parity", "verifier/errors"} <= set(_scalars(alone))


FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen2"


def _adapter_configs(grid=GRID, **common):
  """Runs with rank-4 adapters on the Qwen2 fixture checkpoint (one frozen base for all)."""
  adapters = {"model.checkpoint": str(FIXTURE), "model.lora_rank": 4, **common}
  return _configs(grid, **adapters)


@pytest.mark.extended
def test_a_pack_of_runs_with_adapters_shares_one_base_and_equals_each_run_alone():
  """Adapters on a Hugging Face base, packed over clip, temperature, learning rate and seed,
  with a KL term (its reference is the shared base): the pack's state holds the base once (no
  runs axis) and each run's adapters and optimiser state; every step's metrics (the KL's
  included) and the final parameters equal each run alone."""
  from jaxrl_llm.models import lora

  configs = _adapter_configs(**{"kl.beta": 0.05})
  pack = build_pack(configs)
  base, adapters = lora.split_adapters(pack.state.params)
  one = lora.split_adapters(build(configs[0]).state.params)[0]
  assert jax.tree.map(lambda x: x.shape, base) == jax.tree.map(lambda x: x.shape, one)
  assert all(x.shape[0] == 2 for x in jax.tree.leaves((adapters, pack.state.opt_state)))
  _assert_same_steps(_packed_steps(configs, 2), configs, 2)


def test_a_pack_of_adapters_on_random_bases_of_several_seeds_is_refused_in_one_line():
  """Without a checkpoint each seed initialises its own base, which a pack cannot share."""
  configs = [tiny_config(**{"model.lora_rank": 2, "seed": s}) for s in (0, 1)]
  with pytest.raises(ConfigError, match=r"share one frozen base.*seeds \[0, 1\]") as err:
    build_pack(configs)
  assert len(str(err.value).splitlines()) == 1


@pytest.mark.extended
def test_a_pack_of_adapter_runs_trains_checkpoints_adapters_alone_and_resumes(tmp_path):
  """`train_pack` of runs with adapters on a Hugging Face base (a warm start per seed): each
  run equals the run alone (every scalar, the adapters at the end); the pack's checkpoints
  hold every run's adapters and no base weight; a pack stopped at step 2 resumes to the same
  end, and a run taken out of it continues alone as in the pack."""
  from flax import traverse_util

  common = {"sft.steps": 2, "sft.batch_size": 8}
  configs, root = _adapter_configs(**common), tmp_path / "pack"
  names = _names(configs)
  train_pack(configs, str(root))
  stored = traverse_util.flatten_dict(_params(root, STEPS))
  assert stored and all(k[-1] in ("lora_a", "lora_b") for k in stored)  # no base weight
  for r, (config, name) in enumerate(zip(configs, names, strict=True)):
    alone = tmp_path / "alone" / name
    train_and_evaluate(config, str(alone))
    _assert_same_scalars(_scalars(root / name), _scalars(alone))
    _assert_same_params(_params(root, STEPS, r), _params(alone, STEPS))
  killed, out = tmp_path / "killed", tmp_path / "out"
  train_pack(_adapter_configs(**common, **{"train.stop_after_steps": 2}), str(killed))
  assert take_out(_adapter_configs(**common), str(killed), names[1], str(out)) == 2
  train_pack(_adapter_configs(**common), str(killed))
  train_and_evaluate(_adapter_configs(**common)[1], str(out))
  for r in range(len(names)):
    _assert_same_params(_params(killed, STEPS, r), _params(root, STEPS, r))
  _assert_same_scalars(_scalars(out), _scalars(root / names[1]))
  _assert_same_params(_params(out, STEPS), _params(root, STEPS, 1))


@pytest.mark.extended
def test_the_plan_of_a_pack_with_adapters_holds_the_base_once():
  """`parsed.plan(..., runs=4)` (the packed `--dry_run`): three more runs add three times each
  run's adapters and Adam's two moments of them to the arguments, and no copy of the base."""
  from jaxrl_llm.models import lora

  config = parse(_adapter_configs(GRID[:1])[0])
  devices = jax.devices()[:1]
  adapters = lora.split_adapters(build(config, abstract=True, devices=devices).state.params)[1]
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adapters))
  one = parsed.plan(config, devices=devices, runs=1)
  four = parsed.plan(config, devices=devices, runs=4)
  assert four.argument_bytes - one.argument_bytes == pytest.approx(3 * 3 * nbytes, rel=0.02)


# Four runs: two clip widths x two temperatures, each with its own seed.
GRID4 = tuple(
  {"objective.clip_high": c, "sampling.temperature": t, "seed": s}
  for s, (c, t) in enumerate([(0.2, 0.7), (0.28, 1.0), (0.2, 1.0), (0.28, 0.7)])
)


@pytest.mark.extended
@pytest.mark.parametrize("at_once", [1])
def test_a_pack_stepped_a_block_at_a_time_equals_it_stepped_at_once(tmp_path, at_once):
  """`mesh.runs_at_once`: 4 runs trained 1 or 2 at a time (the rest in turn, in one program)
  equal the same pack trained all at once: every logged scalar of every run at every step,
  the held-out evaluations among them, and the final parameters."""
  configs = _configs(GRID4, **{"train.num_steps": 2, "train.eval_every": 2})
  blocked = _configs(GRID4, **{"train.num_steps": 2, "train.eval_every": 2,
                               "mesh.runs_at_once": at_once})  # fmt: skip
  names = _names(configs)
  train_pack(configs, str(tmp_path / "all"))
  train_pack(blocked, str(tmp_path / "blocks"))
  for r, name in enumerate(names):
    want = _scalars(tmp_path / "all" / name)
    assert "eval/accuracy" in want
    _assert_same_scalars(_scalars(tmp_path / "blocks" / name), want)
    _assert_same_params(_params(tmp_path / "blocks", 2, r), _params(tmp_path / "all", 2, r))


@pytest.mark.extended
def test_blocks_of_a_pack_over_a_runs_axis_equal_its_runs_alone():
  """8 fake CPU devices, runs=2 x data=4, one run of each group at a time: every run equals
  that run trained alone on data=4 (metrics of every step, final parameters)."""
  configs = [tiny_config(**{"mesh.data": 4, **point}) for point in GRID4]
  packed = [
    tiny_config(**{"mesh.data": 4, "mesh.runs": 2, "mesh.runs_at_once": 1, **point})
    for point in GRID4
  ]
  _assert_same_steps(_packed_steps(packed, 2), configs, 2)


@pytest.mark.extended
def test_a_pack_stepped_a_run_at_a_time_plans_one_runs_activations():
  """The compile-only plan of 8 runs one at a time holds every run's state but one run's
  activations: its peak is below the plan of the 8 at once by at least 7 times what one
  run's step needs beyond its state (peak - arguments), less a tenth."""

  devices = jax.devices()[:1]
  config = parse(tiny_config())
  one = parsed.plan(config, devices=devices, runs=1)
  at_once = parsed.plan(config, devices=devices, runs=8)
  in_turn = parsed.plan(parse(tiny_config(**{"mesh.runs_at_once": 1})), devices=devices, runs=8)
  assert in_turn.argument_bytes == at_once.argument_bytes
  work = one.peak_bytes - one.argument_bytes
  assert at_once.peak_bytes - in_turn.peak_bytes >= 0.9 * 7 * work


def test_runs_at_once_that_do_not_divide_a_groups_runs_are_refused():
  configs = _configs(GRID4[:3], **{"mesh.runs_at_once": 2})
  with pytest.raises(ConfigError, match=r"mesh.runs_at_once=2 does not divide the 3 runs") as e:
    build_pack(configs)
  assert len(str(e.value).splitlines()) == 1


@pytest.mark.extended
def test_a_pack_of_adapter_runs_one_at_a_time_equals_it_all_at_once():
  """Under adapters the frozen base has no runs axis: stepped one run at a time (not vmapped),
  every run's metrics at each step and final adapters equal the pack stepped all at once."""
  at_once = _packed_steps(_adapter_configs(GRID), 2)
  in_turn = _packed_steps(_adapter_configs(GRID, **{"mesh.runs_at_once": 1}), 2)
  for (got, got_params), (want, want_params) in zip(in_turn, at_once, strict=True):
    for g, w in zip(got, want, strict=True):
      assert set(g) == set(w)
      for tag in w:
        np.testing.assert_allclose(g[tag], w[tag], rtol=1e-5, atol=1e-5, err_msg=tag)
    _assert_same_params(got_params, want_params)


@pytest.mark.extended
def test_a_pack_relaunched_with_a_changed_learner_setting_is_refused_as_a_run_alone(tmp_path):
  """Both go through the one loop: a pack trained 2 of 4 steps, relaunched with
  `objective.clip_low` 0.2 → 0.25 for both runs, is refused in one line naming each run's
  change, as a single run's workdir is, nothing written; `train.resume_changed` lets both
  through, and each run's folder records the resumed config."""
  half = {"train.stop_after_steps": 2}
  changed = {"objective.clip_low": 0.25}
  root, alone = tmp_path / "pack", tmp_path / "alone"
  train_pack(_configs(**half), str(root))
  train_and_evaluate(_configs(**half)[0], str(alone))
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  messages = []
  for launch in (
    lambda: train_pack(_configs(**changed), str(root)),
    lambda: train_and_evaluate(_configs(**changed)[0], str(alone)),
  ):
    with pytest.raises(ConfigError) as err:
      launch()
    messages.append(str(err.value))
  assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
  pack_line, alone_line = messages
  assert len(pack_line.splitlines()) == len(alone_line.splitlines()) == 1
  for line in messages:
    assert "other settings of what is learned" in line
    assert "--config.train.resume_changed=True" in line
  names = _names(_configs())
  for name in names:
    assert f"[{name}] objective.clip_low: 0.2 → 0.25" in pack_line  # 0.2: the default used
  assert "objective.clip_low: 0.2 → 0.25" in alone_line
  final = train_pack(_configs(**changed, **{"train.resume_changed": True}), str(root))
  assert sorted(final) == sorted(names) and all("eval/accuracy" in m for m in final.values())
  for name in names:
    record = json.loads((root / name / "config.resume-2.json").read_text())
    assert record["config"]["objective"]["clip_low"] == pytest.approx(0.25)


@pytest.mark.extended
def test_a_pack_profiles_the_steps_after_the_compiling_one(tmp_path):
  """`train.profile_steps` in a pack, as in a single run: a jax.profiler trace of the steps
  after the compiling one in the pack's root, which `tools/trace_summary.py` reads."""
  import subprocess

  from conftest import REPO, cli_env

  root = tmp_path / "pack"
  train_pack(_configs(**{"train.num_steps": 3, "train.profile_steps": 1}), str(root))
  traces = list((root / "plugins" / "profile").glob("*/*.xplane.pb"))
  assert len(traces) == 1 and traces[0].stat().st_size > 0
  proc = subprocess.run(
    [sys.executable, "tools/trace_summary.py", str(root), "--device=CPU", "--top=3"],
    cwd=REPO,
    env=cli_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = json.loads(proc.stdout)
  assert got["processes"] == ["/host:CPU"] and got["busy_ms"] > 0 and got["top"]


@pytest.mark.extended
def test_one_diverging_run_stops_alone_and_the_pack_goes_on(tmp_path, caplog):
  """A grid over the learning rate where one value diverges (every update non-finite): that
  run stops alone, named, recorded in its folder and kept as it stopped; the other trains to
  the end exactly as it trains alone; a relaunch keeps the stopped run stopped and goes on;
  relaunched once finished, the stopped run's missing last evaluation is not run again."""
  sick = {
    "optim.learning_rate": 1e38,
    "optim.grad_clip": 0.0,
    "optim.warmup_steps": 0,
    "rl.entropy_coef": 0.01,
    "train.max_skipped_updates": 2,
  }
  grid = ({"optim.learning_rate": 1e-3}, {"optim.learning_rate": 1e38})
  common = {k: v for k, v in sick.items() if k != "optim.learning_rate"}
  configs, root = _configs(grid, **common), tmp_path / "pack"
  names = _names(configs)
  final = train_pack(configs, str(root))
  stopped = json.loads((root / names[1] / "stopped.json").read_text())
  assert stopped["step"] == 1 and f"[{names[1]}] rl step 1: 2 consecutive" in stopped["why"]
  assert not (root / names[0] / "stopped.json").exists()
  alone = tmp_path / "alone"
  final_alone = train_and_evaluate(configs[0], str(alone))
  _assert_same_scalars(_scalars(root / names[0]), _scalars(alone))
  _assert_same_params(_params(root, STEPS, 0), _params(alone, STEPS))
  assert final[names[0]] == pytest.approx(final_alone, abs=1e-5)
  kept = _params(root, STEPS, 1)  # the stopped run's parameters as it stopped
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(kept))
  longer = _configs(grid, **common, **{"train.num_steps": STEPS + 2})
  train_pack(longer, str(root))  # resumes; the stopped run stays stopped, the other goes on
  _assert_same_params(_params(root, STEPS + 2, 1), kept)
  steps = [s for s, _ in metrics_lib.read_scalars(str(root / names[0]))["policy/loss"]]
  assert steps[-1] == STEPS + 2
  with caplog.at_level("INFO"):
    train_pack(longer, str(root))
  assert "nothing to train" in caplog.text and "without its evaluation" not in caplog.text
