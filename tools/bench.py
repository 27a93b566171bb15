"""Benchmark the fused RL step: `python tools/bench.py --config=configs/default.py`.

Prints one JSON object: sampler tokens/s, learner tokens/s, RL step time, the share of the
step spent sampling, compile time, peak memory, and the machine it ran on. The sampler is
timed alone with the fused step's own sample phase (the sampler's weight copy); the learner's share is the
rest of the fused step. Timings are medians over `--steps` warm steps.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from jaxrl_llm import config_lib, data, train


def _peak_memory_bytes() -> dict[str, int | None]:
  """Peak device memory (accelerators) and peak host RSS of this process."""
  dev = jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  device_peak = stats.get("peak_bytes_in_use") if stats else None
  host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"device_peak_bytes": device_peak, "host_peak_rss_bytes": host_peak}


def _machine() -> dict[str, object]:
  dev = jax.devices()[0]
  return {
    "platform": dev.platform,
    "device_kind": dev.device_kind,
    "device_count": jax.device_count(),
    "host": platform.node(),
    "cpu_count": os.cpu_count(),
    "processor": platform.processor() or platform.machine(),
    "jax": jax.__version__,
  }


def _time(fn, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def bench(config, steps: int) -> dict[str, object]:
  """Runs `steps` warm fused RL steps and a sampler-only pass; returns the measurements."""
  exp = train.build(config)
  samp = config_lib.sampling_config(config, exp.task)
  it = data.make_prompt_iterator(
    exp.task.train_examples(config.seed), config_lib.num_sampled_prompts(config), seed=config.seed
  )
  batches = [train.to_global_batch(next(it), exp.batch_sharding) for _ in range(steps + 1)]
  state = exp.state
  if config.kl.beta > 0:
    state = state.replace(ref_params=jax.tree.map(lambda x: x.copy(), state.params))

  t0 = time.perf_counter()
  compiled = exp.rl_step.lower(state, batches[0], state.rng).compile()
  compile_s = time.perf_counter() - t0

  step_times, gen_tokens = [], []
  state, m = compiled(state, batches[0], jax.random.fold_in(state.rng, 0))  # warm-up
  jax.block_until_ready(m)
  for i in range(1, steps + 1):
    t0 = time.perf_counter()
    state, m = compiled(state, batches[i], jax.random.fold_in(state.rng, i))
    m = jax.device_get(m)
    step_times.append(time.perf_counter() - t0)
    gen_tokens.append(float(m["perf/generated_tokens"]))
  learner_tokens = float(m["perf/learner_tokens"])

  # The fused step's own sample phase: the sampler's weight copy (sampling.param_dtype).
  sample_fn = exp.program.sample
  jax.block_until_ready(sample_fn(state, batches[0], state.rng))
  sample_times, sample_tokens = [], []
  for i in range(1, steps + 1):
    key = jax.random.fold_in(state.rng, 1000 + i)
    t0 = time.perf_counter()
    r = jax.block_until_ready(sample_fn(state, batches[i], key))
    sample_times.append(time.perf_counter() - t0)
    sample_tokens.append(float(np.sum(r.lengths)))

  step_s = statistics.median(step_times)
  sample_s = statistics.median(sample_times)
  learn_s = max(step_s - sample_s, 1e-9)
  return {
    "config": {
      "task": config.task.name,
      "model": config_lib.model_config(config).to_dict(),
      "prompts": config.rl.num_prompts,
      "group_size": config.sampling.group_size,
      "max_new_tokens": samp.max_new_tokens,
      "epochs": config.rl.num_epochs,
      "minibatches": config.rl.num_minibatches,
    },
    "rl_step_s": step_s,
    "compile_s": compile_s,
    "sampler_tokens_per_s": statistics.median(sample_tokens) / sample_s,
    "learner_tokens_per_s": learner_tokens / learn_s,
    "sampling_share_of_step": min(sample_s / step_s, 1.0),
    "generated_tokens_per_step": statistics.median(gen_tokens),
    **_peak_memory_bytes(),
    "machine": _machine(),
  }


def main(argv):
  """Prints the benchmark result as JSON."""
  del argv
  print(json.dumps(bench(flags.FLAGS.config, flags.FLAGS.steps), indent=2))


if __name__ == "__main__":
  # Flags are defined only when run as a program, so importing `bench` defines none.
  config_flags.DEFINE_config_file("config", None, "Experiment config.", lock_config=True)
  flags.DEFINE_integer("steps", 5, "Warm RL steps to time.")
  flags.mark_flags_as_required(["config"])
  app.run(main)
