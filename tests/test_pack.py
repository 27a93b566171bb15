"""Packs: a sweep's runs trained as one vmapped program, each run equal to itself trained alone.

The oracle of every test here is the single run: the same config trained by
`train_and_evaluate`, its scalars read back from its TensorBoard events and its parameters from
its orbax checkpoint.
"""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import tiny_config
from etils import epath

from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.run import build, train_and_evaluate
from jaxrl_llm.run.loop import train_iterator
from jaxrl_llm.run.pack import (
  PackIterator,
  batch_to_device,
  build_pack,
  packable_fields,
  packed_keys,
  run_name,
  varied_fields,
)
from jaxrl_llm.run.pack_loop import take_out, train_pack

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


def test_packed_runs_equal_their_runs_alone_resume_and_come_out_whole(tmp_path):
  """One pack serves every check of the acceptance list (it is the costly part): each run
  equals the run trained alone (scalars at every step, final parameters, last evaluation), has
  its own TensorBoard folder and HParams session, a killed pack resumes to the uninterrupted
  result, a run taken out continues alone as in the pack, another grid is refused."""
  configs, root = _configs(), tmp_path / "pack"
  names, final = _names(configs), train_pack(_configs(), str(root))
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


def test_the_packed_step_compiles_once():
  pack = build_pack(_configs())
  data = PackIterator([train_iterator(pack.run(r)) for r in range(pack.size)])
  state = pack.state
  for step in range(3):
    batch = batch_to_device(next(data), pack.exp.mesh)
    state, _ = pack.exp.program.step(state, batch, packed_keys(state.rng, step), pack.values)
  assert pack.exp.program.step._cache_size() == 1


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
  fields = packable_fields()
  for f in (
    "seed",
    "sampling.temperature",
    "sampling.top_p",
    "sampling.top_k",
    "optim.learning_rate",
    "kl.beta",
    "rl.entropy_coef",
    "objective.clip_low",
    "objective.clip_high",
    "objective.tau_pos",
    "objective.is_clip_high",
    "objective.clip_log",
  ):
    assert f in fields
  assert "objective.name" not in fields and "sampling.group_size" not in fields


def test_a_pack_over_a_runs_axis_equals_its_runs_alone(tmp_path):
  """8 fake CPU devices, runs=4 x data=2: each device pair trains one run of the pack, which
  equals that run trained alone on data=2 (scalars at every step, final parameters)."""
  grid = [
    {"objective.clip_high": c, "sampling.temperature": t} for c in (0.2, 0.28) for t in (0.7, 1.0)
  ]
  common = {"train.num_steps": 2, "train.eval_every": 2, "mesh.data": 2}
  configs = [tiny_config(**{**common, **point}) for point in grid]
  packed = [tiny_config(**{**common, **point, "mesh.runs": 4}) for point in grid]
  train_pack(packed, str(tmp_path / "pack"), names=_names(configs))
  for r, (config, name) in enumerate(zip(configs, _names(configs), strict=True)):
    train_and_evaluate(config, str(tmp_path / name))
    _assert_same_scalars(_scalars(tmp_path / "pack" / name), _scalars(tmp_path / name))
    _assert_same_params(_params(tmp_path / "pack", 2, r), _params(tmp_path / name, 2))
