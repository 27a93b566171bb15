"""The learning-rate schedule goes on through a KL reference reset that resets the optimiser
(only Adam's moments start afresh), and `optim/learning_rate` is the rate the last applied
update used, read from the optimiser state's schedule count (exact after skipped updates)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_steps, tiny_config

from jaxrl_llm import optim
from jaxrl_llm.config import parse
from jaxrl_llm.config.learner import KLSettings
from jaxrl_llm.config.sections import OptimSettings
from jaxrl_llm.rl import update
from jaxrl_llm.types import TrainState

WARMUP = OptimSettings(learning_rate=1e-3, warmup_steps=10, grad_clip=0.0)


def _adam(opt_state) -> optax.ScaleByAdamState:
  return optax.tree_utils.tree_get(opt_state, "ScaleByAdamState")


def _count(opt_state) -> int:
  """The count of the schedule's state in the chain `OptimSettings.build` makes."""
  return int(optax.tree_utils.tree_get(opt_state, "ScaleByScheduleState").count)


def test_a_reset_that_resets_the_optimiser_keeps_the_schedule_and_zeroes_the_moments():
  """Three updates, a reset (`update_reference` with kl.reset_optimizer), one more update: that
  update moves each weight by the schedule at count 3 (Adam's first step after fresh moments
  is ±lr), not by the warmup's 0 at count 0."""
  tx, schedule = WARMUP.build(total_updates=100)
  params = {"w": jnp.zeros(4)}
  grads = {"w": jnp.array([0.5, -1.0, 2.0, -0.25])}
  opt_state = tx.init(params)
  for _ in range(3):
    params, opt_state, skipped = optim.guarded_update(tx, grads, opt_state, params)
    assert int(skipped) == 0
  state = TrainState(
    step=jnp.int32(1), params=params, opt_state=opt_state, ref_params=params, rng=None
  )
  kl = KLSettings(beta=0.1, reference="reset_every", reset_every=2, reset_optimizer=True)
  _, reset = update.update_reference(state, params, opt_state, kl=kl, optimizer=tx)
  assert _count(reset) == 3  # carried over
  adam = _adam(reset)
  assert int(adam.count) == 0  # Adam's bias correction belongs to the moments
  assert not np.any(adam.mu["w"]) and not np.any(adam.nu["w"])
  new, after, _ = optim.guarded_update(tx, grads, reset, params)
  step = np.asarray(new["w"] - params["w"])
  assert float(schedule(3)) > 0
  np.testing.assert_allclose(step, -float(schedule(3)) * np.sign(grads["w"]), rtol=1e-5)
  assert _count(after) == 4
  kept = dataclasses.replace(kl, reset_optimizer=False)
  assert update.update_reference(state, params, opt_state, kl=kept, optimizer=tx)[1] is opt_state


def test_the_logged_rate_is_the_one_the_last_applied_update_used_after_a_skip():
  """Two updates applied, then one skipped (a NaN gradient, `guarded_update`): the schedule's
  count stays at 2, so the rate logged is schedule(1), the one last applied, where the
  update count (3) would name a rate never used."""
  tx, schedule = WARMUP.build(total_updates=100)
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)
  assert float(optim.applied_rate(schedule, opt_state)) == float(schedule(0))
  good, bad = {"w": jnp.ones(3)}, {"w": jnp.array([1.0, jnp.nan, 1.0])}
  for g in (good, good, bad):
    params, opt_state, skipped = optim.guarded_update(tx, g, opt_state, params)
  assert int(skipped) == 1 and int(optim.schedule_count(opt_state)) == _count(opt_state) == 2
  np.testing.assert_allclose(optim.applied_rate(schedule, opt_state), schedule(1))


def _rate(config, states, metrics):
  """(schedule, each step's logged optim/learning_rate) of a `run_steps` run."""
  _, schedule = parse(config).optim.build(parse(config).schedule_updates)
  return schedule, [float(m["optim/learning_rate"]) for m in metrics]


@pytest.mark.slow
def test_a_run_resetting_the_optimiser_every_step_goes_on_warming_up():
  """kl.reset_every=1 with kl.reset_optimizer, one update a step: after each step Adam's moments
  are zero and the schedule's count is the updates applied, so step 2's update moves weights
  by schedule(1) (the warmup's second rate), not schedule(0) = 0; each logged rate is the one
  its step applied."""
  config = tiny_config(
    **{
      "kl.beta": 0.01,
      "kl.reference": "reset_every",
      "kl.reset_every": 1,
      "kl.reset_optimizer": True,
      "optim.learning_rate": 1e-3,
      "optim.warmup_steps": 10,
      "optim.weight_decay": 0.0,
      "optim.grad_clip": 0.0,
      "rl.num_minibatches": 1,
      "rl.entropy_coef": 0.01,  # a gradient before any reward
    }
  )
  states, metrics = run_steps(config, steps=2)
  schedule, logged = _rate(config, states, metrics)
  for i, s in enumerate(states[1:], start=1):
    assert _count(s.opt_state) == i
    adam = _adam(s.opt_state)
    assert int(adam.count) == 0
    assert not any(np.any(x) for x in jax.tree.leaves((adam.mu, adam.nu)))
  moved = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), states[2].params, states[1].params)
  np.testing.assert_allclose(max(jax.tree.leaves(moved)), schedule(1), rtol=1e-3)
  np.testing.assert_allclose(logged, [schedule(0), schedule(1)], rtol=1e-6)


@pytest.mark.slow
def test_a_run_whose_updates_are_skipped_logs_the_rate_at_the_schedules_count():
  """lr 1e38 without clipping: every update is skipped, so the schedule never advances and
  each step logs schedule(0) (the rate the first applied update will use), where the update
  count (step x 2 updates) would log the decayed rate that was never applied."""
  config = tiny_config(
    **{
      "optim.learning_rate": 1e38,
      "optim.grad_clip": 0.0,
      "optim.warmup_steps": 0,
      "rl.entropy_coef": 0.01,
    }
  )
  states, metrics = run_steps(config, steps=2)
  schedule, logged = _rate(config, states, metrics)
  assert [float(m["optim/skipped_updates"].sum()) for m in metrics] == [2.0, 2.0]
  assert _count(states[2].opt_state) == 0
  assert float(schedule(2)) < 0.99 * float(schedule(0))  # the decay is visible
  np.testing.assert_allclose(logged, [schedule(0), schedule(0)], rtol=1e-6)


@pytest.mark.parametrize("traced", [False, True], ids=["constant", "traced"])
@pytest.mark.parametrize("warmup", [0, 10])
def test_the_schedule_is_linear_warmup_then_cosine_decay_in_closed_form(warmup, traced):
  """The rate at update t, written out (the config's comments): 0 → peak linearly over
  `warmup_steps` (none at 0), then peak · (d + (1 − d) · (1 + cos(π s)) / 2) at the fraction s
  of the remaining updates, reaching d · peak at `total_updates` and holding it after; a
  traced peak (a run's own or a pack's value) gives the same rates."""
  peak, d, total = 3e-4, 0.1, 50
  settings = OptimSettings(learning_rate=peak, warmup_steps=warmup, decay_to=d, grad_clip=0.0)
  if traced:
    settings = dataclasses.replace(settings, learning_rate=jnp.float32(peak))
  _, schedule = settings.build(total_updates=total)

  def want(t: int) -> float:
    if t < warmup:
      return peak * t / warmup
    s = min((t - warmup) / (total - warmup), 1.0)
    return peak * (d + (1 - d) * (1 + np.cos(np.pi * s)) / 2)

  for t in [0, 1, warmup // 2, warmup, warmup + 1, (warmup + total) // 2, total - 1, total, 80]:
    np.testing.assert_allclose(float(schedule(t)), want(t), rtol=1e-5, atol=1e-12, err_msg=t)
  assert float(schedule(warmup)) == pytest.approx(peak)
  assert float(schedule(total)) == pytest.approx(d * peak)


@pytest.mark.parametrize("decay_to, same", [(1.0, True), (0.1, False)])
def test_only_a_decaying_schedule_compiles_the_run_length_into_the_step(decay_to, same):
  """Without decay (optim.decay_to=1) the rate is the peak after warmup whatever the length,
  yet train.num_steps was compiled into the step: each relaunch that extended a run compiled
  it again (70 s for SmolLM2 on 2 cores) instead of loading it from the cache. The step's
  program is now the same for 6 and 9 steps without decay, and differs with decay, whose
  rates do depend on the length."""
  from parsed import build

  from jaxrl_llm.run import abstract_batch

  texts, rates = [], []
  for steps in (6, 9):
    config = tiny_config(**{"train.num_steps": steps, "optim.decay_to": decay_to})
    exp = build(config, abstract=True)
    key = jax.random.PRNGKey(0)
    texts.append(exp.program.step.lower(exp.state, abstract_batch(exp), key).as_text())
    _, schedule = parse(config).optim.build(parse(config).schedule_updates)
    rates.append([float(schedule(u)) for u in range(0, 40, 3)])
  assert (texts[0] == texts[1]) is same
  assert (rates[0] == rates[1]) is same
