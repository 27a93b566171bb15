"""python tools/sampler_memory.py: Compile-only temp bytes of sample() at a Qwen2.5-0.5B-like vocabulary and width (2 layers),
256 rows x 64 new tokens, bfloat16 compute: float32_logits reference vs the fast path."""

import dataclasses
import json
import sys

sys.path.insert(
  0,
  __import__("os").path.join(
    __import__("os").path.dirname(__import__("os").path.abspath(__file__)), "..", "tests"
  ),
)
import flax.linen as nn
import jax
import jax.numpy as jnp
from conftest import tiny_config

from jaxrl_llm.config import parse
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.sampling import SamplingConfig, sample

cfg = parse(tiny_config())
mc = dataclasses.replace(
  cfg.model.arch,
  vocab_size=151936,
  d_model=896,
  mlp_dim=4864,
  num_layers=2,
  num_heads=14,
  num_kv_heads=2,
  head_dim=64,
  dtype="bfloat16",
)
model = Transformer(mc)
P, S, T, G = 32, 64, 64, 8
toks = jax.ShapeDtypeStruct((P, S), jnp.int32)
mask = jax.ShapeDtypeStruct((P, S), jnp.bool_)

params = jax.eval_shape(
  lambda: nn.unbox(
    model.init(
      jax.random.key(0),
      jnp.zeros((1, S), jnp.int32),
      jnp.zeros((1, S), jnp.int32),
      jnp.ones((1, S), bool),
    )["params"]
  )
)
out = {}
for ref in (True, False):
  sc = SamplingConfig(max_new_tokens=T, group_size=G, float32_logits=ref, kv_block=0)
  c = (
    jax.jit(lambda p, t, m, k, sc=sc: sample(model, p, t, m, k, sc))
    .lower(params, toks, mask, jax.random.key(0))
    .compile()
  )
  out["float32_logits" if ref else "fast"] = c.memory_analysis().temp_size_in_bytes
print(
  json.dumps(
    {
      "shape": f"V=151936 D=896 2 layers bf16, {P} prompts x G={G}, S={S}, T={T}",
      "temp_bytes": out,
      "ratio_fast_over_reference": out["fast"] / out["float32_logits"],
    }
  )
)
