"""A new objective is one decorated function: registered here, it trains through the fused step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, tiny_config
from parsed import build

from jaxrl_llm import objectives
from jaxrl_llm.config import ConfigError, check, parse
from jaxrl_llm.data import pipeline
from jaxrl_llm.run import to_global_batch


def toy_scaled_pg(logp, old_logp, adv, mask, *, clip_high: float = 0.5):
  """J = s·r·A: an importance-weighted policy gradient scaled by its own hyperparameter s."""
  m = mask.astype(jnp.float32)
  delta = jnp.where(m > 0, logp - jax.lax.stop_gradient(old_logp), 0.0)
  a = adv[:, None] * m if adv.ndim == 1 else adv * m
  j = clip_high * jnp.exp(delta) * a
  no = jnp.zeros_like(m)
  diag = {"ratio": jnp.exp(delta), "log_ratio": delta, "is_clipped_low": no, "is_clipped_high": no}
  diag["toy_scale"] = jnp.full_like(m, clip_high)
  return j, jax.tree.map(jax.lax.stop_gradient, diag)


def _check(h):
  return [] if h["clip_high"] > 0 else [f"objective.clip_high={h['clip_high']} must be > 0"]


@pytest.fixture
def toy():
  objectives.register_objective("toy_scaled_pg", check=_check)(toy_scaled_pg)
  yield "toy_scaled_pg"
  del objectives.OBJECTIVES["toy_scaled_pg"]


@pytest.mark.extended
def test_a_registered_toy_objective_runs_one_fused_step(toy):
  c = tiny_config(**{"objective.name": toy})
  check(parse(c), num_devices=8)
  _, metrics = run_steps(c, 1)
  m = metrics[0]
  assert float(m["policy/toy_scale_mean"]) == pytest.approx(0.5)  # its signature default
  assert np.isfinite(float(m["policy/loss"])) and np.isfinite(float(m["optim/grad_norm"]))


def _grad_norm(config) -> float:
  """Gradient norm of one learn phase on a sampled rollout with rewards that have spread."""
  exp = build(config)
  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), config.rl.num_prompts, seed=0)
  batch = to_global_batch(next(it), exp.batch_sharding)
  rng = jax.random.PRNGKey(3)
  rollout = exp.program.sample(exp.state, batch, rng)
  correct = jnp.tile(jnp.array([1.0, 0.0, 0.0, 1.0]), config.rl.num_prompts)
  _, m = exp.program.learn(exp.state, rollout, {"correct": correct}, rng)
  return float(m["optim/grad_norm"])


@pytest.mark.extended
def test_a_toy_objectives_hyperparameter_comes_from_the_config_and_is_checked(toy):
  # The warm-up's first learning rate is 0, so both minibatches see the initial parameters and
  # the gradient is exactly proportional to the objective's scale.
  default = _grad_norm(tiny_config(**{"objective.name": toy}))
  scaled = _grad_norm(tiny_config(**{"objective.name": toy, "objective.clip_high": 2.0}))
  assert default > 0
  assert scaled / default == pytest.approx(4.0, rel=1e-4)
  bad = tiny_config(**{"objective.name": toy, "objective.clip_high": -1.0})
  with pytest.raises(ConfigError, match=r"objective\.clip_high=-1\.0 must be > 0"):
    check(parse(bad), num_devices=8)
