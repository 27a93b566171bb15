"""A single run's programs take its per-run values (clip ranges, temperature, learning rate,
...) as traced arguments: the update equals the one with those values compiled in, and runs
that differ only in them lower to one program."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import _train_batches, tiny_config
from jax.sharding import NamedSharding, PartitionSpec
from parsed import build

from jaxrl_llm.config import parse
from jaxrl_llm.rl import init_reference, make_rl_step
from jaxrl_llm.rl.step import Bound
from jaxrl_llm.run.assemble import abstract_batch, own_values

# Values off the defaults, each of which changes two updates of the tiny config (2 minibatches:
# the second is off-policy, so the clip range acts; no warmup, so the first moves the policy).
POINT = {
  "objective.clip_high": 0.05,
  "objective.clip_low": 0.1,
  "sampling.temperature": 0.7,
  "optim.learning_rate": 3e-3,
  "rl.entropy_coef": 0.01,
}
OTHER = {  # another value of each
  "objective.clip_high": 0.2,
  "objective.clip_low": 0.2,
  "sampling.temperature": 1.0,
  "optim.learning_rate": 3e-4,
  "rl.entropy_coef": 0.02,
}


def _config(**values):
  return tiny_config(**{"optim.warmup_steps": 0, **values})


def _constants(exp):
  """`exp`'s programs rebuilt with every setting a compile-time constant (the reference)."""
  ctx = exp.program.learner
  return make_rl_step(
    exp.model, ctx.optimizer, ctx.schedule, exp.task.reward_terms, ctx.sampling, ctx.settings,
    exp.mesh, exp.state_shardings, sampler_dtype=ctx.sampler_dtype, rules=exp.rules,
    rebuild_optimizer=ctx.rebuild_optimizer,
  )  # fmt: skip


def _updates(exp, program):
  """Params and metrics after one fused step, then sample -> rewards with spread -> learn."""
  state = jax.tree.map(jnp.copy, init_reference(exp.state, exp.config.kl.beta))  # donated
  batches = _train_batches(exp, tiny_config())
  state, fused = program.step(state, next(batches), jax.random.fold_in(state.rng, 0))
  key = jax.random.fold_in(state.rng, 1)
  rollout = program.sample(state, next(batches), key)
  correct = jnp.tile(jnp.array([1.0, 0.0, 0.0, 1.0]), rollout.lengths.shape[0] // 4)
  state, m = program.learn(state, rollout, {"correct": correct}, key)
  return jax.device_get(state.params), [jax.device_get(fused), jax.device_get(m)]


def test_a_single_run_takes_its_values_as_traced_arguments_and_updates_as_with_constants():
  exp = build(_config(**POINT))
  values = exp.program.values
  assert set(POINT) <= set(values), sorted(values)
  assert all(isinstance(v, jax.Array) and v.shape == () for v in values.values())
  assert {k: float(values[k]) for k in POINT} == pytest.approx(POINT)
  assert "sampling.top_p" not in values and "sampling.top_k" not in values  # `constant`

  traced_params, traced_m = _updates(exp, exp.program)
  exp_c = build(_config(**POINT))
  const_params, const_m = _updates(exp_c, _constants(exp_c))
  assert float(traced_m[1]["policy/clip_frac_low"] + traced_m[1]["policy/clip_frac_high"]) > 0
  for have, want in zip(traced_m, const_m, strict=True):
    assert set(have) == set(want)
    for key in have:
      np.testing.assert_allclose(have[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), traced_params, const_params
  )

  jitted = {p: getattr(exp.program, p).jitted.fn for p in ("step", "sample", "learn")}
  for field, value in OTHER.items():  # the same compiled programs at another value of each
    values = own_values(parse(_config(**{**POINT, field: value})), exp.mesh)
    rebound = {p: Bound(f, values) for p, f in jitted.items()}
    _, other_m = _updates(exp, dataclasses.replace(exp.program, **rebound))
    moved = [np.max(np.abs(a[k] - b[k])) for a, b in zip(traced_m, other_m, strict=True) for k in a]
    assert max(moved) > 1e-5, field  # the value acts
  assert {p: f._cache_size() for p, f in jitted.items()} == {"step": 1, "sample": 1, "learn": 1}


def _step_text(config) -> str:
  exp = build(config, abstract=True)
  repl = NamedSharding(exp.mesh, PartitionSpec())
  key = jax.ShapeDtypeStruct((2,), np.uint32, sharding=repl)
  return exp.program.step.lower(exp.state, abstract_batch(exp), key).as_text()


def test_runs_that_differ_only_in_their_values_lower_to_one_program():
  base = _step_text(_config(**OTHER))
  assert _step_text(_config(**POINT)) == base
  assert _step_text(_config(**OTHER, **{"sampling.top_p": 0.9})) != base  # `constant`
  assert _step_text(_config(**OTHER, **{"rl.num_epochs": 2})) != base  # a shape of the program
  assert _step_text(_config()) != base  # rl.entropy_coef=0: the bonus is off, not traced


def test_a_value_a_single_run_does_not_trace_is_named_by_its_declaration():
  values = parse(_config(**{"kl.beta": 0.0, "sampling.top_k": 5})).step_values(constants=False)
  assert "kl.beta" not in values  # 0: a traced 0 would turn the KL term on
  assert "sampling.top_k" not in values  # its traced form sorts the vocabulary at each token
  assert parse(_config(**{"kl.beta": 0.05})).step_values(constants=False)["kl.beta"] == 0.05


def test_a_single_runs_step_compiled_ahead_is_called_as_the_program():
  """`.lower(...).compile()` (as the benchmarks compile) keeps the values bound: the executable
  takes (state, batch, rng) and updates as the jitted program does."""
  exp = build(_config(**POINT))
  state = init_reference(exp.state, exp.config.kl.beta)
  batch, key = next(_train_batches(exp, tiny_config())), jax.random.PRNGKey(3)
  compiled = exp.program.step.lower(state, batch, key).compile()
  assert compiled.memory_analysis() is not None
  _, ahead = compiled(jax.tree.map(jnp.copy, state), batch, key)
  _, jitted = exp.program.step(jax.tree.map(jnp.copy, state), batch, key)
  assert set(ahead) == set(jitted)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(ahead), jax.device_get(jitted))


def test_a_single_run_a_pack_and_their_plans_give_each_value_one_dtype():
  """The step's value arguments have one dtype per field wherever they are made: a single run's
  (`own_values`), a pack's (`pack.run_values`) and the compile-only plan's (`plan._pack_args`);
  an integer field (`shaping.cache_len`) travels as int32, every other as float32."""
  from jaxrl_llm import plan
  from jaxrl_llm.run import pack

  exp = build(_config(**POINT), abstract=True, runs=2)
  own = own_values(exp.config, exp.mesh, abstract=True)
  varied = list(exp.config.step_values())
  packed = pack.run_values([exp.config, exp.config], varied)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(exp.mesh, PartitionSpec()))
  planned = plan._pack_args(exp, (exp.state, abstract_batch(exp), key), 2, varied)[-1]
  assert exp.config.value("shaping.cache_len") == 2 and "shaping.cache_len" in own
  for field in varied:
    want = np.int32 if field == "shaping.cache_len" else np.float32
    assert packed[field].dtype == want and planned[field].dtype == want, field
    if field in own:
      assert own[field].dtype == want, field
