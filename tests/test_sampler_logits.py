"""The sampler's fast logits path (the last position unembedded alone, logits kept at the
compute dtype, cast inside the draw's and the log-prob's own passes) against its reference
(`SamplingConfig.float32_logits`: the model's float32 logits of every position)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from parsed import build

from jaxrl_llm import quant
from jaxrl_llm.config import parse
from jaxrl_llm.sampling import _prefill, sample


@pytest.mark.extended
# Each head once, the float32 and bfloat16 samplers between them.
@pytest.mark.parametrize(
  "arch,dtype",
  [
    ({}, "bfloat16"),
    ({"model.tie_embeddings": False}, "float32"),
    ({"model.moe_num_experts": 4, "model.moe_top_k": 2}, "bfloat16"),
  ],
  ids=["tied-bfloat16", "lm_head-float32", "moe-bfloat16"],
)
def test_the_fast_logits_path_draws_the_reference_tokens(arch, dtype):
  """Same tokens, log-probs within float32 rounding, for float32 and bfloat16 samplers."""
  cfg = parse(tiny_config(**arch))
  exp = build(cfg)
  model = type(exp.model)(dataclasses.replace(exp.model.cfg, dtype=dtype))
  params = quant.sampler_params(exp.state.params, dtype)
  samp = cfg.sampling.sampler(exp.task)
  ex = exp.task.eval_examples()
  prompts, mask = jnp.asarray(ex["tokens"][:16]), jnp.asarray(ex["mask"][:16])
  out = []
  for reference in (True, False):
    c = dataclasses.replace(samp, float32_logits=reference)
    run = jax.jit(lambda p, t, m, k, c=c: sample(model, p, t, m, k, c))
    out.append(jax.device_get(run(params, prompts, mask, jax.random.key(0))))
  ref, fast = out
  np.testing.assert_array_equal(fast.tokens, ref.tokens)
  np.testing.assert_array_equal(fast.lengths, ref.lengths)
  np.testing.assert_allclose(fast.logprobs, ref.logprobs, atol=2e-6)
  # The loop carries the logits at the compute dtype: no float32 [B, V] buffer in bfloat16.
  state = jax.eval_shape(
    lambda p: _prefill(model, p, prompts, mask, jax.random.key(0), samp)[0], params
  )
  assert state.logits.dtype == jnp.dtype(dtype) and state.logits.shape == (
    16 * samp.group_size,
    model.cfg.vocab_size,
  )
