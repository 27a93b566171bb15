"""An adapted run against a reference written here: a full model whose trainable parameters are
constrained the same way.

The reference (`MergedWeights`) is a plain Transformer (no adapter modules) whose every adapted
kernel is the full matrix W + (alpha / r) A B, merged in this file with jnp on each call, so
the gradient reaches A and B through the merge. Its weights are full matrices, but the only
quantities it trains are A and B, as an adapted run does. Run through the same fused RL step
(`make_rl_step`) from the same state, prompts and keys, the two must sample the same
completions, report the same loss and metrics at every update and end with the same adapters
on the same untouched base.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import traverse_util
from parsed import build

from jaxrl_llm.data import pipeline
from jaxrl_llm.models import ModelConfig, Transformer, lora
from jaxrl_llm.models.scan import SCAN_NAME
from jaxrl_llm.rl import init_reference, make_rl_step
from jaxrl_llm.run import to_global_batch

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5  # float32 programs that differ only in where A B is multiplied (values ~1)


def merged_weights(params, scale: float):
  """`params` with each adapted kernel W replaced by W + scale A B (jnp: differentiable in A
  and B) and the adapters removed; a tree without adapters (the base alone) is returned as it
  is. Scanned layers carry a leading layer axis on W, A and B: one product per layer."""
  if not lora.has_adapters(params):
    return params
  flat = traverse_util.flatten_dict(params)
  out = {k: v for k, v in flat.items() if not lora.is_adapter(k)}
  for path in [k for k in flat if k[-1] == "lora_a"]:
    owner = path[:-1]
    a, b, w = flat[path], flat[(*owner, "lora_b")], flat[(*owner, "kernel")]
    layers, rank = (a.shape[0] if SCAN_NAME in path else 1), a.shape[-1]
    a = a.reshape(layers, -1, rank)  # [L, in, r]: the kernel's input axes flattened
    b = b.reshape(layers, rank, -1)  # [L, r, out]: its output axes flattened
    delta = jnp.einsum("lir,lro->lio", a, b).reshape(w.shape)
    out[(*owner, "kernel")] = w + (scale * delta).astype(w.dtype)
  return traverse_util.unflatten_dict(out)


class MergedWeights(Transformer):
  """The reference network: every `apply` runs a plain Transformer (lora_rank 0, same remat
  and attention) on `merged_weights` of the parameters it is given."""

  def apply(self, variables, *args, **kwargs):
    cfg = self.cfg
    plain = Transformer(  # parent=None: a top-level module, not a child of this one
      dataclasses.replace(cfg, lora_rank=0), remat=self.remat, attention=self.attention, parent=None
    )
    params = merged_weights(variables["params"], cfg.lora_alpha / cfg.lora_rank)
    return plain.apply({**variables, "params": params}, *args, **kwargs)


def _reference_program(exp):
  """The fused RL step of `MergedWeights`, built from the adapted run's learner pieces."""
  ctx = exp.program.learner
  model = MergedWeights(exp.model.cfg, attention=exp.model.attention)
  program = make_rl_step(
    model, ctx.optimizer, ctx.schedule, exp.task.reward_terms, ctx.sampling, ctx.settings,
    exp.mesh, exp.state_shardings, sampler_dtype=ctx.sampler_dtype, rules=exp.rules,
  )  # fmt: skip
  assert isinstance(program.learner.model, MergedWeights)  # the learner keeps the subclass
  assert isinstance(program.learner.sampler_model, MergedWeights)
  return program


def _run(exp, program, host_state, batches, keys):
  """`STEPS` fused updates of `program` from a device copy of `host_state`; returns the host
  state after them and, per update, its rollout (the sampler alone, same key) and metrics."""
  state = jax.device_put(host_state, exp.state_shardings)
  rollouts, metrics = [], []
  for batch, key in zip(batches, keys, strict=True):
    rollouts.append(jax.device_get(program.sample(state, batch, key)))  # not donated
    state, m = program.step(state, batch, key)  # donates `state`
    metrics.append(jax.device_get(m))
  return jax.device_get(state), rollouts, metrics


def _leaves(tree) -> dict:
  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}


def _assert_close(got, want, what: str):
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=what)


def _assert_same_rollout(got, want, step: int):
  """Equal completions (token for token) and sampler log-probs within the tolerance."""
  for field in ("prompt_tokens", "tokens", "loss_mask", "lengths", "truncated", "decode_steps"):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field), f"{step}: {field}")
  _assert_close(got.logprobs, want.logprobs, f"step {step}: rollout logprobs")


def _assert_same_metrics(got: dict, want: dict, step: int):
  """The same metric names, every one (scalars and any arrays) within the tolerance."""
  assert sorted(got) == sorted(want), step
  for name, value in want.items():
    _assert_close(got[name], value, f"step {step}: {name}")


@pytest.mark.extended  # checks the oracle itself; the model side is in test_lora.py
@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_the_reference_computes_what_the_adapted_model_does(scan):
  """`MergedWeights` on base + adapters gives the adapted model's logits (random adapters,
  loop or scanned layers), and on the base alone the base's."""
  sizes = dict(vocab_size=24, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
  cfg = ModelConfig(**sizes, lora_rank=4, lora_alpha=8.0, scan_layers=scan)
  rng = np.random.default_rng(0)  # inputs and noise on the host: no program per shape
  mask = np.array([[0, 0, 1, 1, 1, 1], [1] * 6], bool)
  tokens = np.where(mask, rng.integers(3, 24, mask.shape), 0).astype(np.int32)
  inputs = (tokens, np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32), mask)
  adapted, reference = Transformer(cfg), MergedWeights(cfg)
  params = nn.unbox(jax.jit(adapted.init)(jax.random.PRNGKey(1), *inputs)["params"])
  base, adapters = lora.split_adapters(jax.device_get(params))
  noisy = jax.tree.map(lambda x: x + rng.normal(0, 0.1, x.shape).astype(x.dtype), adapters)

  @jax.jit  # one program for the four passes
  def logits(base, noisy):
    full = lora.join_adapters(base, noisy)
    pairs = ((adapted, full), (adapted, base), (reference, full), (reference, base))
    return [m.apply({"params": p}, *inputs).logits for m, p in pairs]

  want, plain, got, got_plain = logits(base, noisy)
  assert float(jnp.max(jnp.abs(want - plain))) > 1e-3  # the adapters act
  _assert_close(got, want, "base + adapters")
  np.testing.assert_array_equal(got_plain, plain)


@pytest.mark.extended  # about 70 s on two shared CPU cores: two fused RL programs compiled and run
def test_an_adapted_run_equals_a_full_model_trained_through_merged_weights():
  """Three fused updates (two optimiser steps each, a reward with non-zero advantages, KL to
  the base, an entropy bonus) of the adapted model and of `MergedWeights` from one state, on
  the same prompts and keys: equal completions, equal loss and metrics at every update, equal
  adapters at the end, the base bit-identical in both. Guards against a vacuous pass: the
  advantages are not all 0, every adapter moves and the KL to the base is > 0 at the end."""
  overrides = {"model.lora_rank": 4, "kl.beta": 0.05, "rl.entropy_coef": 0.01}
  overrides |= {"optim.learning_rate": 1e-2, "rl.num_minibatches": 2}
  config = tiny_config(**overrides, **{"task.reward_weights": {"correct": 1.0, "partial": 1.0}})
  exp = build(config)
  assert exp.settings.rl.num_minibatches == 2 and exp.program.learner.sampler_dtype == "float32"
  host_state = jax.device_get(init_reference(exp.state, config.kl.beta))
  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), config.rl.num_prompts, seed=0)
  batches = [to_global_batch(next(it), exp.batch_sharding) for _ in range(STEPS)]
  keys = [jax.random.fold_in(jax.random.PRNGKey(config.seed), i) for i in range(STEPS)]

  adapted = _run(exp, exp.program, host_state, batches, keys)
  reference = _run(exp, _reference_program(exp), host_state, batches, keys)
  for step in range(STEPS):
    _assert_same_rollout(adapted[1][step], reference[1][step], step)
    _assert_same_metrics(adapted[2][step], reference[2][step], step)

  base0, adapters0 = lora.split_adapters(host_state.params)
  for path, value in _leaves(base0).items():  # the base: bit-identical in both runs
    for final, _, _ in (adapted, reference):
      np.testing.assert_array_equal(_leaves(lora.split_adapters(final.params)[0])[path], value)
  got, want = (_leaves(lora.split_adapters(r[0].params)[1]) for r in (adapted, reference))
  for path, value in want.items():
    _assert_close(got[path], value, f"adapter {path}")
    assert not np.array_equal(got[path], _leaves(adapters0)[path]), f"{path} did not move"
  assert max(float(m["adv/abs_max"]) for m in adapted[2]) > 0  # a policy-gradient term too
  kl = float(adapted[2][-1]["kl/ref_kl"])
  assert np.isfinite(kl) and kl > 0, kl
