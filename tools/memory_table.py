"""Compile-only memory of the fused RL step at real model shapes (nothing is allocated).

  python tools/memory_table.py --shapes=qwen2.5-0.5b,qwen2.5-1.5b [--set=rl.num_microbatches=4]

For each shape the whole fused step (sampling, verifier, old pass, learner, optimiser) is
built from abstract state (`train.build(config, abstract=True)`), lowered and compiled for this
machine's backend, and `compiled.memory_analysis()` is printed: argument, output and temporary
bytes per device. On a CPU-only machine the CPU backend's plan is an upper-bound proxy for a
GPU's (the accelerator compilers fuse more); it shows what a change saves without hardware.
Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Qwen2.5 shapes: the model fields the memory depends on (weights are never materialised).
SHAPES: dict[str, dict[str, object]] = {
  "qwen2.5-0.5b": {
    "model.vocab_size": 151936,
    "model.d_model": 896,
    "model.num_layers": 24,
    "model.num_heads": 14,
    "model.num_kv_heads": 2,
    "model.head_dim": 64,
    "model.mlp_dim": 4864,
    "model.attention_bias": True,
    "model.tie_embeddings": True,
    "sampling.max_new_tokens": 256,
  },
  "qwen2.5-1.5b": {
    "model.vocab_size": 151936,
    "model.d_model": 1536,
    "model.num_layers": 28,
    "model.num_heads": 12,
    "model.num_kv_heads": 2,
    "model.head_dim": 128,
    "model.mlp_dim": 8960,
    "model.attention_bias": True,
    "model.tie_embeddings": True,
    "sampling.max_new_tokens": 512,
  },
}

# The run around the model: 8 prompts x 8 completions, bf16 compute, one minibatch.
COMMON: dict[str, object] = {
  "model.dtype": "bfloat16",
  "model.param_dtype": "float32",
  "rl.num_prompts": 8,
  "sampling.group_size": 8,
  "rl.num_minibatches": 1,
  "task.max_len": 11,  # 13-token prompts
  "sft.steps": 0,
  "mesh.data": 1,
}


def shape_config(name: str, overrides: list[str] = ()):
  """The default config at shape `name` with COMMON and the user's `FIELD=VALUE` overrides,
  parsed by the trainer's own command-line parser (typed, unknown fields named)."""
  from jaxrl_llm import main as trainer_main

  config_file = os.path.join(os.path.dirname(__file__), "..", "configs", "default.py")
  fixed = [f"--config.{k}={v}" for k, v in {**COMMON, **SHAPES[name]}.items()]
  return trainer_main.parse_config(
    ["memory_table", f"--config={config_file}", *fixed, *(f"--config.{o}" for o in overrides)]
  )


def compiled_memory(config) -> dict[str, object]:
  """Compile the fused step from abstract state; its memory analysis and compile time."""
  import jax

  from jaxrl_llm import train

  exp = train.build(config, abstract=True)
  t0 = time.perf_counter()
  rng = jax.ShapeDtypeStruct((2,), jax.numpy.uint32)
  lowered = exp.program.step.lower(exp.state, train.abstract_batch(exp), rng)
  compiled = lowered.compile()
  mem = compiled.memory_analysis()
  gib = 2**30
  out = {
    "argument_gib": mem.argument_size_in_bytes / gib,
    "output_gib": mem.output_size_in_bytes / gib,
    "temp_gib": mem.temp_size_in_bytes / gib,
    "alias_gib": mem.alias_size_in_bytes / gib,
    "compile_s": time.perf_counter() - t0,
    "backend": jax.default_backend(),
  }
  out["peak_estimate_gib"] = (
    out["argument_gib"] + out["output_gib"] - out["alias_gib"] + out["temp_gib"]
  )
  return out


def main(argv: list[str]) -> int:
  """Command line: one JSON line per shape."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--set", action="append", default=[], help="FIELD=VALUE (repeatable)")
  args = parser.parse_args(argv)
  overrides = args.set
  for name in args.shapes.split(","):
    if name not in SHAPES:
      print(f"unknown shape {name!r}; known: {', '.join(SHAPES)}", file=sys.stderr)
      return 2
    result = {
      "shape": name,
      "overrides": overrides,
      **compiled_memory(shape_config(name, overrides)),
    }
    print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main(sys.argv[1:]))
