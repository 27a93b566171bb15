"""The sampler's fused projections (`quant.fuse_projections`: one qkv and one gate-up matmul a
layer, made once per update) against the unfused projections, the learner's own layout and
the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from parsed import build

from jaxrl_llm import quant
from jaxrl_llm.config import parse
from jaxrl_llm.sampling import sample

ARCHS = {
  "gqa": {},
  "qkv_bias": {"model.attention_bias": True},
  "qk_norm": {"model.qk_norm": True, "model.scan_layers": True},
  "moe": {"model.moe_num_experts": 4, "model.moe_top_k": 2},
}


def _experiment(arch):
  cfg = parse(tiny_config(**ARCHS[arch]))
  return cfg, build(cfg)


@pytest.mark.extended
@pytest.mark.parametrize("arch", ARCHS)
def test_the_fused_sampler_draws_the_unfused_samplers_tokens(arch):
  """Same tokens, log-probs within float32 rounding, for every architecture variant."""
  cfg, exp = _experiment(arch)
  samp = cfg.sampling.sampler(exp.task)
  ex = exp.task.eval_examples()
  prompts, mask = jnp.asarray(ex["tokens"][:16]), jnp.asarray(ex["mask"][:16])
  run = jax.jit(lambda p: sample(exp.model, p, prompts, mask, jax.random.key(0), samp))
  fused_params = quant.fuse_projections(exp.state.params)
  ref, fused = (jax.device_get(run(p)) for p in (exp.state.params, fused_params))
  np.testing.assert_array_equal(fused.tokens, ref.tokens)
  np.testing.assert_array_equal(fused.lengths, ref.lengths)
  np.testing.assert_allclose(fused.logprobs, ref.logprobs, atol=2e-5)


def _names(tree, prefix=""):
  out = set()
  for k, v in tree.items():
    out |= _names(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k}
  return out


def test_every_dense_layer_is_fused_and_experts_are_not():
  _, exp = _experiment("moe")
  names = _names(quant.fuse_projections(exp.state.params))
  assert not any(n.split("/")[-2] in ("q", "k", "v") for n in names)
  assert any(n.endswith("attn/qkv/kernel") for n in names)
  moe = [n for n in names if "/moe/" in n]
  assert moe and not any("gate_up" in n for n in moe)  # the experts' grouped matmuls stay
  _, dense = _experiment("gqa")
  names = _names(quant.fuse_projections(dense.state.params))
  mlp = sorted(n for n in names if "/mlp/" in n)
  assert len(mlp) == 2 * dense.model.cfg.num_layers, mlp  # gate_up and down, every layer
  assert all(n.endswith(("mlp/gate_up/kernel", "mlp/down/kernel")) for n in mlp), mlp


def test_adapters_and_int8_bases_stay_unfused_and_sample_the_same():
  cfg = parse(tiny_config(**{"model.lora_rank": 4, "model.lora_base_dtype": "int8"}))
  exp = build(cfg)
  fused = quant.fuse_projections(exp.state.params)
  assert _names(fused) == _names(exp.state.params)  # nothing plain to fuse


def test_a_layer_runs_three_fewer_matmuls_fused():
  """The decode step's program: per layer, q, k, v become one dot and gate, up one."""
  _, exp = _experiment("gqa")
  layers = exp.model.cfg.num_layers
  tokens = jnp.zeros((4, 1), jnp.int32)
  pos = jnp.zeros((4, 1), jnp.int32)
  valid = jnp.ones((4, 1), bool)

  def dots(params):
    fn = jax.jit(lambda p: exp.model.apply({"params": p}, tokens, pos, valid).logits)
    return fn.lower(params).as_text().count("dot_general")

  fused = dots(quant.fuse_projections(exp.state.params))
  assert dots(exp.state.params) - fused == 3 * layers


def test_the_rl_step_samples_from_the_fused_copy():
  """The fused step's sampler phase runs the fused projections (fewer matmuls in its program
  than the unfused sampler's) and draws the unfused sampler's rollout."""
  from jaxrl_llm.rl.step import sample_phase
  from jaxrl_llm.types import PromptBatch

  _, exp = _experiment("gqa")
  ctx = exp.program.learner
  ex = exp.task.eval_examples()
  prompts, mask = jnp.asarray(ex["tokens"][:4]), jnp.asarray(ex["mask"][:4])
  batch = PromptBatch(tokens=prompts, mask=mask, answer=None, answer_mask=None)
  key = jax.random.key(5)
  phase = jax.jit(lambda s: sample_phase(ctx, s, batch, key))
  sample_key, _ = jax.random.split(key)
  alone = jax.jit(lambda p: sample(ctx.sampler_model, p, prompts, mask, sample_key, ctx.sampling))
  fused_dots = phase.lower(exp.state).as_text().count("dot_general")
  assert fused_dots < alone.lower(exp.state.params).as_text().count("dot_general")
  got, ref = jax.device_get(phase(exp.state)), jax.device_get(alone(exp.state.params))
  np.testing.assert_array_equal(got.tokens, ref.tokens)
  np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=2e-5)
