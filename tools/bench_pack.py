"""Benchmark a pack of N runs against the same N runs one after another, in one invocation.

  python tools/bench_pack.py [--shape=default] [--runs=8,16] [--steps=3] [--at_once=0,1]
                             [--set=model.scan_layers=true ...]

For each N: the packed step of N runs (a clip_high x temperature x seed grid) and the single
run's fused step are each compiled, run once, then timed over `--steps` steps (medians). The
sequential cost of N runs is N x the single step (and N compilations); the packed one is one
step (and one compilation). Prints one JSON object per N: the step times, the steady-state
speed-up `N x single / packed`, the compile times, and the compile-only memory per device of the
packed step against one run's (`plan.plan`). `--shape`: `default` (configs/default.py) or a
shape of tools/bench.py (tiny, medium, ...). `--at_once`: the packs' `mesh.runs_at_once`
values, one line each (0: every run at once; k: k runs vmapped at a time, the rest in turn).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "tools"))

import bench  # noqa: E402  (tools/bench.py, next to this file)
import jax  # noqa: E402

from jaxrl_llm import backend, plan, terminal  # noqa: E402
from jaxrl_llm.config import ConfigError, parse  # noqa: E402
from jaxrl_llm.rl import init_reference  # noqa: E402
from jaxrl_llm.run import build, to_global_batch  # noqa: E402
from jaxrl_llm.run.loop import train_iterator  # noqa: E402
from jaxrl_llm.run.pack import batch_to_device, build_pack, pack_iterator, packed_keys  # noqa: E402


def base_config(shape: str, overrides: list[str] = ()):
  """The config of `shape` ('default': configs/default.py; else a tools/bench.py shape), then
  the `FIELD=VALUE` overrides (typed by the trainer's command-line parser)."""
  if shape == "default":
    from jaxrl_llm import launch as trainer_main

    config_file = os.path.join(_REPO, "configs", "default.py")
    argv = ["bench_pack", f"--config={config_file}", *(f"--config.{o}" for o in overrides)]
    return trainer_main.parse_config(argv)
  try:
    return bench.shape_config(shape, overrides)
  except ConfigError as e:  # bench's list of shapes, less this tool's own `default`
    raise ConfigError(str(e).replace("; known: ", "; known: default, ", 1)) from None


def grid(config, n: int) -> list:
  """`n` runs of `config`: clip_high x temperature x seed, as many as needed."""
  points = itertools.product((0.2, 0.28), (0.7, 1.0), range(n))
  out = []
  for clip, temp, seed in itertools.islice(points, n):
    c = config.copy_and_resolve_references()
    c.objective.clip_high, c.sampling.temperature, c.seed = clip, temp, seed
    out.append(c)
  return out


def _timed(step, state, batches, steps: int):
  """(first call s, median of `steps` later calls s, state) of `step(state, batch, i)`."""
  times = []
  for i in range(steps + 1):
    t = time.perf_counter()
    state, metrics = step(state, next(batches), i)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t)
    bench.progress(f"step {i}: {times[-1]:.3f} s" + (" (compile included)" if i == 0 else ""))
  return times[0], statistics.median(times[1:]), state


def time_single(config, steps: int) -> tuple[float, float]:
  """(compile + first step s, steady step s) of one run's fused step."""
  exp = build(parse(config))
  state = init_reference(exp.state, exp.config.kl.beta)
  it = train_iterator(exp)
  batches = (to_global_batch(b, exp.batch_sharding) for b in it)

  def step(state, batch, i):
    return exp.rl_step(state, batch, jax.random.fold_in(state.rng, i))

  first, steady, _ = _timed(step, state, batches, steps)
  return first, steady


def time_pack(configs, steps: int) -> tuple[float, float]:
  """(compile + first step s, steady step s) of the packed step of `configs`."""
  pack = build_pack([parse(c) for c in configs])
  state = init_reference(pack.state, pack.configs[0].kl.beta)
  data = pack_iterator(pack)
  batches = (batch_to_device(b, pack.exp.mesh) for b in data)

  def step(state, batch, i):
    return pack.exp.program.step(state, batch, packed_keys(state.rng, i), pack.values)

  first, steady, _ = _timed(step, state, batches, steps)
  return first, steady


def main(argv=None) -> int:
  """Command line entry point."""
  p = terminal.ArgParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--shape", default="default")
  p.add_argument(
    "--runs", type=terminal.counts, default=[8, 16], help="Comma-separated pack sizes."
  )
  p.add_argument("--steps", type=terminal.count, default=3, help="Timed steps after the first.")
  p.add_argument(
    "--at_once",
    type=lambda t: terminal.counts(t, least=0),
    default=[0],
    help="Comma-separated mesh.runs_at_once values (0: every run at once).",
  )
  p.add_argument("--set", action="append", default=[], help="FIELD=VALUE (repeatable)")
  args = p.parse_args(argv)
  try:  # a bad --set field or value, a pack the devices cannot split: one line
    return _bench(args)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _bench(args) -> int:
  """The measurements of the command line `args`, a JSON line per pack size and runs_at_once."""
  backend.choose()  # as the trainer's command line does
  config = base_config(args.shape, args.set)
  config.mesh.data = 1
  bench.progress("one run's fused step")
  single_first, single = time_single(config, args.steps)
  bench.progress("one run's compile-only plan")
  one = plan.plan(parse(config), devices=jax.devices()[:1])
  device = jax.devices()[0]
  for n, at_once in itertools.product(args.runs, args.at_once):
    config.mesh.runs_at_once = at_once
    configs = grid(config, n)
    bench.progress(f"the packed step of {n} runs, {at_once or n} at once")
    pack_first, packed = time_pack(configs, args.steps)
    bench.progress(f"the pack of {n}'s compile-only plan")
    memory = plan.plan(parse(configs[0]), devices=jax.devices()[:1], runs=n)
    result = {
      "shape": args.shape,
      "set": args.set,
      "runs": n,
      "runs_at_once": at_once,
      "device": f"{device.platform} {device.device_kind} (cpu_count={os.cpu_count()})",
      "single_step_s": round(single, 4),
      "packed_step_s": round(packed, 4),
      "speedup_steady": round(n * single / packed, 2),
      "single_compile_and_first_step_s": round(single_first, 2),
      "packed_compile_and_first_step_s": round(pack_first, 2),
      "single_peak_bytes": one.peak_bytes,
      "packed_peak_bytes": memory.peak_bytes,
      "memory_ratio": round(memory.peak_bytes / one.peak_bytes, 2),
    }
    print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
