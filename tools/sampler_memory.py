"""Compile-only temporary bytes of the sampler: the float32-logits reference (the model's float32
[B, V] logits each step) against the fast path, at a Qwen2.5-0.5B-like vocabulary and width.
Nothing is allocated: the program is lowered and compiled for this machine's backend, and its
memory analysis read back.

  python tools/sampler_memory.py                                  # 32 prompts x 8, 64 + 64 tokens
  python tools/sampler_memory.py --prompts=8 --layers=4 --out=temp.json

One JSON line on stdout (and in --out): the shape, each path's temporary bytes and their ratio.
The archived figure is docs/cpu_runs/sampler_logits_temp_bytes.json.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxrl_llm.terminal import ArgParser, count

# Qwen2.5-0.5B's vocabulary and widths; the depth is a flag (the logits' memory does not grow with it).
_QWEN_05B = dict(
  vocab_size=151936, d_model=896, mlp_dim=4864, num_heads=14, num_kv_heads=2, head_dim=64
)


def temp_bytes(prompts: int, group_size: int, prompt_len: int, new_tokens: int, layers: int):
  """{path: temporary bytes} of `sample` at this shape, bfloat16 compute, compiled only."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from jaxrl_llm.models.config import ModelConfig
  from jaxrl_llm.models.transformer import Transformer
  from jaxrl_llm.sampling import SamplingConfig, sample

  model = Transformer(ModelConfig(**_QWEN_05B, num_layers=layers, dtype="bfloat16"))
  zeros = jnp.zeros((1, prompt_len), jnp.int32)
  params = jax.eval_shape(
    lambda: nn.unbox(
      model.init(jax.random.key(0), zeros, zeros, jnp.ones((1, prompt_len), bool))["params"]
    )
  )
  tokens = jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32)
  mask = jax.ShapeDtypeStruct((prompts, prompt_len), jnp.bool_)
  out = {}
  for name, reference in (("float32_logits", True), ("fast", False)):
    sc = SamplingConfig(
      max_new_tokens=new_tokens, group_size=group_size, float32_logits=reference, kv_block=0
    )
    step = jax.jit(lambda p, t, m, k, sc=sc: sample(model, p, t, m, k, sc))
    compiled = step.lower(params, tokens, mask, jax.random.key(0)).compile()
    out[name] = compiled.memory_analysis().temp_size_in_bytes
  return out


def main(argv: list[str] | None = None) -> int:
  """The command line: measures, prints one JSON line, writes it to --out if given."""
  parser = ArgParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--prompts", type=count, default=32, help="prompts P (rows = P x G)")
  parser.add_argument("--group_size", type=count, default=8, help="completions per prompt G")
  parser.add_argument("--prompt_len", type=count, default=64, help="prompt tokens S")
  parser.add_argument("--new_tokens", type=count, default=64, help="completion budget T")
  parser.add_argument("--layers", type=count, default=2, help="transformer blocks")
  parser.add_argument("--out", help="also write the JSON line to this file")
  args = parser.parse_args(argv)
  if args.out:
    from jaxrl_llm.paths import file_problem

    problem = file_problem(args.out)
    if problem:
      parser.error(f"--out: {problem}")
  out = temp_bytes(args.prompts, args.group_size, args.prompt_len, args.new_tokens, args.layers)
  record = {
    "shape": f"V={_QWEN_05B['vocab_size']} D={_QWEN_05B['d_model']} {args.layers} layers bf16, "
    f"{args.prompts} prompts x G={args.group_size}, S={args.prompt_len}, T={args.new_tokens}",
    "temp_bytes": out,
    "ratio_fast_over_reference": out["fast"] / out["float32_logits"],
  }
  line = json.dumps(record)
  print(line)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write(line + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
