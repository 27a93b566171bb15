"""Faults and bad numbers: a non-finite update is skipped, never applied or saved, and a run
that keeps producing them stops with a clear message (objectives.md §5 applies finite updates
only); numeric config fields with a range are validated before anything compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_config

from jaxrl_llm import checkpoint, config_lib, metrics, optim, train


def _tx():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


@pytest.mark.parametrize("bad", ["grad_nan", "grad_inf", "loss_nan", "finite"])
def test_guarded_update_skips_non_finite_steps(bad):
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
  new_params, new_state, skipped = jax.jit(optim.guarded_update, static_argnums=0)(
    tx, grads, state, params, loss
  )
  same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), (new_params, new_state), (params, state))
  if bad == "finite":
    assert int(skipped) == 0 and not all(jax.tree.leaves(same))
  else:
    assert int(skipped) == 1 and all(jax.tree.leaves(same))  # nothing moved, Adam's count too


def test_an_overflowing_update_is_skipped_too():
  """Finite gradients whose update overflows the parameters (lr 1e38) are not applied."""
  params = {"w": jnp.full((2,), 3e38)}
  tx = optax.sgd(1e38)
  _, _, skipped = optim.guarded_update(tx, {"w": -jnp.ones(2)}, tx.init(params), params)
  assert int(skipped) == 1


def test_a_run_that_keeps_diverging_stops_and_saves_only_finite_state(tmp_path):
  """lr 1e38 without clipping (an entropy bonus gives a gradient before any reward): the first
  update leaves finite garbage, every later one is non-finite and skipped; after
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
  with pytest.raises(train.NonFiniteError, match=r"rl step 3: 5 consecutive optimiser updates"):
    train.train_and_evaluate(config, str(tmp_path))
  logged = metrics.read_scalars(str(tmp_path))
  assert max(v for _, v in logged["optim/skipped_updates"]) == 2  # both updates of a step
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    steps = ckpt.all_steps()
    assert steps
    exp = train.build(config, abstract=True)
    for step in steps:
      state, _ = ckpt.restore(step, exp.state)
      assert not checkpoint.non_finite_paths(state)


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
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(tiny_config(**{field: value}), num_devices=8)
