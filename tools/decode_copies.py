"""The sampler alone against a vmapped pack of R copies of it: seconds per rollout and the
copies of a KV-cache array in the compiled decode loop.

  python tools/decode_copies.py [--scan_layers] [--dtype=bfloat16] [--runs=1]

The medium model of tools/bench.py (6 layers, d 256, 8 / 4 heads of 32, vocab 4,096; random
weights), 16 prompts of 13 tokens x 8 completions of 64 tokens, every completion at full length.
Prints one JSON object: per program, the median of 5 timed calls after a warm-up, the cache
copies and the cache writes (dynamic-update-slice or scatter instructions) in the decode loop,
and whether the pack's last run sampled the tokens of the run alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_llm import hlo, launch, sharding, terminal
from jaxrl_llm.models import ModelConfig, Transformer
from jaxrl_llm.models.transformer import positions_from_mask
from jaxrl_llm.sampling import DECODE_SCOPE, SamplingConfig, sample

PROMPTS, PROMPT_LEN, NEW_TOKENS, GROUP = 16, 13, 64, 8


def loop_counts(fn, *args) -> dict[str, int]:
  """Cache copies and cache writes among the compiled decode loop's instructions."""
  body = hlo.loop_instructions(jax.jit(fn).lower(*args).compile().as_text(), DECODE_SCOPE)
  cache = f"{PROMPT_LEN + NEW_TOKENS},32]"  # [.., N, Dh]
  return {
    "cache_copies": sum(i.opcode == "copy" and cache in i.line for i in body),
    "cache_writes": sum(i.opcode in ("dynamic-update-slice", "scatter") for i in body),
  }


def seconds(fn, *args) -> float:
  """Median seconds of 5 calls of jit(fn) after a warm-up call."""
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(5):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main(argv=None) -> int:
  """Command line entry point."""
  p = terminal.ArgParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--scan_layers", action="store_true", help="blocks under nn.scan")
  p.add_argument(
    "--dtype",
    default="float32",
    choices=["float32", "bfloat16", "float16"],
    help="compute dtype (parameters stay float32)",
  )
  p.add_argument("--runs", type=terminal.count, default=1, help="runs in the pack")
  args = p.parse_args(argv)
  launch.choose_backend()  # as the trainer's command line: a failing plugin's chatter kept off
  cfg = ModelConfig(
    vocab_size=4096, d_model=256, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=32,
    mlp_dim=1024, dtype=args.dtype, param_dtype="float32", scan_layers=args.scan_layers,
  )  # fmt: skip
  model = Transformer(cfg)
  prompt = jax.random.randint(jax.random.PRNGKey(0), (PROMPTS, PROMPT_LEN), 3, cfg.vocab_size)
  mask = jnp.ones(prompt.shape, bool)
  variables = model.init(jax.random.PRNGKey(1), prompt, positions_from_mask(mask), mask)
  params = nn.unbox(variables["params"])

  def sampler(loop_axis):
    scfg = SamplingConfig(NEW_TOKENS, group_size=GROUP, eos_id=-1, kv_block=0, loop_axis=loop_axis)
    return lambda p, k: sample(model, p, prompt, mask, k, scfg)

  alone = sampler(None)
  packed = jax.vmap(sampler(sharding.PACK_AXIS), axis_name=sharding.PACK_AXIS)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * args.runs), params)
  keys = jnp.stack([jax.random.PRNGKey(2)] * args.runs)
  result = {"scan_layers": args.scan_layers, "dtype": args.dtype, "runs": args.runs}
  result["alone"] = {"s": seconds(alone, params, keys[0]), **loop_counts(alone, params, keys[0])}
  result["pack"] = {"s": seconds(packed, stacked, keys), **loop_counts(packed, stacked, keys)}
  same = jax.jit(packed)(stacked, keys).tokens[-1] == jax.jit(alone)(params, keys[0]).tokens
  result["same_tokens"] = bool(same.all())
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
