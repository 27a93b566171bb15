"""Adapter dropout (`model.lora_dropout`, PEFT's lora_dropout): it acts in the learner's
gradient passes alone (the RL loss pass, a key of its own per microbatch and optimiser step;
the SFT warm start's loss), never in sampling, the old pass or the reference pass; each layer
draws its own mask, scanned layers too; off (0, the default) no program makes a key for it; on,
a run trains."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, tiny_config
from parsed import build

from jaxrl_llm.data import pipeline
from jaxrl_llm.models import ModelConfig, Transformer, lora
from jaxrl_llm.models.transformer import positions_from_mask
from jaxrl_llm.rl import init_reference
from jaxrl_llm.rl import loss as rl_loss
from jaxrl_llm.run import to_global_batch
from jaxrl_llm.run import warm_start as warm_start_lib

# Adapters with a gradient whatever the rewards (KL to the base, entropy), two microbatches
ADAPTED = {
  "model.lora_rank": 4,
  "kl.beta": 0.05,
  "rl.entropy_coef": 0.01,
  "rl.num_microbatches": 2,
}
SAMPLER_SIDE = ("rollout/", "samples/", "hist/", "behaviour/", "reward/", "kl/ref")
LOSS = rl_loss.loss  # the learner's loss, unwrapped


def _noisy(params, scale: float = 0.2):
  """`params` with random adapters (B != 0), so they change the forward value from step 0;
  each leaf keeps the sharding it had."""
  base, adapters = lora.split_adapters(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  noisy = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  out = lora.join_adapters(base, jax.tree.unflatten(tree, noisy))
  return jax.tree.map(lambda p, old: jax.device_put(p, old.sharding), out, params)


def _record_loss_keys(monkeypatch) -> dict:
  """Wraps the learner's loss (`rl.loss.loss`) to record, for each microbatch it runs, the
  dropout key it was given: `keys` (host copies, at run time) and `keyless` (traces without)."""
  seen = {"keys": [], "keyless": 0}

  def loss(*args, dropout_key=None, **kwargs):
    if dropout_key is None:
      seen["keyless"] += 1
    else:
      jax.debug.callback(lambda k: seen["keys"].append(tuple(np.asarray(k).ravel())), dropout_key)
    return LOSS(*args, dropout_key=dropout_key, **kwargs)

  monkeypatch.setattr(rl_loss, "loss", loss)
  return seen


def _two_steps(rate: float, monkeypatch):
  """(metrics of two fused steps from random adapters, the loss's recorded keys) at
  `model.lora_dropout` = `rate`."""
  seen = _record_loss_keys(monkeypatch)
  exp = build(tiny_config(**ADAPTED, **{"model.lora_dropout": rate}))
  state = init_reference(exp.state.replace(params=_noisy(exp.state.params)), 0.05)
  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), 4, seed=0)
  metrics = []
  for i in range(2):
    batch = to_global_batch(next(it), exp.batch_sharding)
    state, m = exp.rl_step(state, batch, jax.random.fold_in(state.rng, i))
    metrics.append(jax.device_get(m))
  return metrics, seen


@pytest.mark.extended
def test_dropout_acts_in_the_loss_pass_alone_with_a_key_per_microbatch_and_step(monkeypatch):
  """Same random adapters, same batch and key, dropout 0.5 against 0: the sampler's rollout and
  the old and reference passes are bit-identical (the old pass still reproduces the sampler's
  log-probs), while the learner's loss pass differs (its ratio to the old pass leaves 1, its
  entropy and gradient move). With dropout the loss got 2 steps x 2 minibatches x 2
  microbatches = 8 distinct keys; without, none."""
  (plain, plain_seen), (drop, drop_seen) = (_two_steps(r, monkeypatch) for r in (0.0, 0.5))
  assert plain_seen["keys"] == [] and plain_seen["keyless"] >= 1
  assert len(set(drop_seen["keys"])) == 8 and drop_seen["keyless"] == 0, drop_seen
  p, d = plain[0], drop[0]
  shared = [k for k in p if k.startswith(SAMPLER_SIDE)]
  assert "behaviour/mismatch_max" in shared and "samples/tokens" in shared, sorted(p)
  for k in shared:
    np.testing.assert_array_equal(d[k], p[k], err_msg=k)
  assert float(d["behaviour/mismatch_max"]) < 1e-5  # old pass == sampler under dropout too
  assert float(p["policy/ratio_var"]) < 1e-10 < 1e-6 < float(d["policy/ratio_var"])
  for k in ("policy/entropy", "policy/total_loss", "optim/grad_norm"):
    assert float(d[k]) != float(p[k]), k
  for m in drop:
    assert all(np.isfinite(np.asarray(v, np.float64)).all() for v in m.values())


def _random_ops(rate: float | None, rank: int = 4) -> dict[str, int]:
  """The PRNG primitives of the fused step's jaxpr (traced only) at `model.lora_dropout` =
  `rate` (None: the field left at its default) and `model.lora_rank` = `rank`."""
  over = {**ADAPTED, "model.lora_rank": rank}
  if rate is not None:
    over["model.lora_dropout"] = rate
  exp = build(tiny_config(**over))
  state = init_reference(exp.state, 0.05)  # a reference copy where the model has no adapters
  batch = next(pipeline.make_prompt_iterator(exp.task.train_examples(0), 4, seed=0))
  jaxpr = jax.make_jaxpr(exp.rl_step)(state, to_global_batch(batch, exp.batch_sharding), state.rng)
  ops = re.findall(r"\b(random_\w+|threefry2x32)\b", str(jaxpr))
  return {op: ops.count(op) for op in set(ops)}


@pytest.mark.extended
def test_without_dropout_no_key_is_made():
  """lora_dropout = 0 (and the field left out) trace the fused step with the same PRNG
  operations as a model without adapters: no dropout key is split or folded, so every other
  draw (the sampler's, the shuffles) stays as it was; 0.1 adds them."""
  none = _random_ops(None, rank=0)
  assert _random_ops(0.0) == none and _random_ops(None) == none
  on = _random_ops(0.1)
  assert sum(on.values()) > sum(none.values()), (on, none)


@pytest.mark.extended
def test_a_run_with_dropout_trains():
  """lora_dropout = 0.1 trains two fused steps with finite metrics (scanned layers draw their
  masks as unrolled ones do: the per-layer mask test below)."""
  config = tiny_config(**ADAPTED, **{"model.lora_dropout": 0.1})
  states, metrics = run_steps(config, 2)
  for m in metrics:
    for k, v in m.items():
      assert np.isfinite(np.asarray(v, np.float64)).all(), k
  _, first = lora.split_adapters(states[0].params)
  _, last = lora.split_adapters(states[-1].params)
  assert any(
    not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(last))
  )


@pytest.mark.extended
def test_the_warm_start_loss_drops_with_a_key_per_update():
  """The SFT update with dropout on: its loss under the run's key differs from the keyless
  (deterministic) loss and between two updates, and one update's key gives one loss."""
  exp = build(tiny_config(**{"model.lora_rank": 4, "model.lora_dropout": 0.5}))
  params = _noisy(exp.state.params)
  tx, _ = exp.config.sft.optimizer(exp.config.optim).build(2)
  opt_state = tx.init(lora.trainable(params)[1])
  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  sft_step = warm_start_lib._sft_step(exp, tx, shardings)
  batch = to_global_batch(next(exp.task.train_iterator(8, 1)), exp.batch_sharding)
  loss = lambda *key: float(sft_step(params, opt_state, batch, *key)[2])  # noqa: E731
  keyless, first, again, second = loss(), *(loss(exp.state.rng, i) for i in (0, 0, 1))
  assert np.isfinite(keyless) and first == again
  assert len({keyless, first, second}) == 3, (keyless, first, second)


@pytest.mark.extended
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_each_layer_draws_its_own_mask_only_when_given_a_dropout_rng(scan):
  """Two layers' adapters on q: with a `dropout` rng each layer's dropout mask is its own,
  scanned layers too (`nn.scan` splits the rng per layer); without, the model is
  deterministic and no input is dropped."""
  cfg = ModelConfig(
    vocab_size=24,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    num_layers=2,
    lora_rank=4,
    lora_targets="q",
    lora_dropout=0.5,
    scan_layers=scan,
  )
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 6), 3, 24)
  mask = jnp.ones((2, 6), bool)
  inputs = (tokens, positions_from_mask(mask), mask)
  model = Transformer(cfg)
  params = _noisy(nn.unbox(model.init(jax.random.PRNGKey(1), *inputs)["params"]))
  dropped = []

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if isinstance(context.module, nn.Dropout):
      jax.debug.callback(lambda z: dropped.append(np.asarray(z)), out == 0)
    return out

  with nn.intercept_methods(record):
    plain = model.apply({"params": params}, *inputs).logits
    jax.effects_barrier()
    assert len(dropped) == 2 and not any(z.any() for z in dropped)
    dropped.clear()
    rngs = {"dropout": jax.random.PRNGKey(3)}
    noisy = model.apply({"params": params}, *inputs, rngs=rngs).logits
    jax.effects_barrier()
  assert len(dropped) == 2 and all(0.3 < z.mean() < 0.7 for z in dropped)
  assert not np.array_equal(dropped[0], dropped[1])  # a mask of its own per layer
  assert float(jnp.max(jnp.abs(noisy - plain))) > 1e-4
