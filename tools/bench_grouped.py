"""Time one grouped (mixture-of-experts) matmul, forward and forward+backward, per backend.

  python tools/bench_grouped.py [--rows=137728] [--k=1024] [--n=384] [--experts=64] [--iters=20]

Rows are split over the experts in near-equal groups (as a balanced router gives). For each
implementation that runs on this device (`kernel`: the Mosaic GPU kernels, Hopper only;
`portable`: the tiled scan; `ragged`: `jax.lax.ragged_dot`) it prints one JSON line with the
median time, useful TFLOP/s (2·M·K·N forward, 3x that forward+backward) and the compiled
program's temp bytes. An implementation that fails to compile or run reports its error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_llm.kernels import grouped  # noqa: E402


def _impls(device, k: int, n: int) -> dict:
  impls = {"portable": grouped.grouped_matmul, "ragged": jax.lax.ragged_dot}
  if grouped.kernel_unsupported(device, jnp.bfloat16, (k, n)) is None:
    impls["kernel"] = grouped.kernel_matmul
  return impls


def _time(fn, args, iters: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv: list[str]) -> int:
  """Parse flags, time each implementation, print one JSON line per (impl, pass)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=137_728, help="routed rows M (tokens x top-k)")
  parser.add_argument("--k", type=int, default=1024, help="input width (d_model)")
  parser.add_argument("--n", type=int, default=384, help="output width (expert width)")
  parser.add_argument("--experts", type=int, default=64, help="number of groups E")
  parser.add_argument("--iters", type=int, default=20, help="timed calls (median reported)")
  args = parser.parse_args(argv)
  m, k, n, e = args.rows, args.k, args.n, args.experts
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (e, k, n), jnp.bfloat16)
  sizes = jnp.full((e,), m // e, jnp.int32).at[: m % e].add(1)
  device = jax.devices()[0]
  flops = 2 * m * k * n
  for name, fn in _impls(device, k, n).items():
    fwd = jax.jit(lambda a, b, fn=fn: fn(a, b, sizes))

    def loss(a, b, fwd=fwd):
      return jnp.sum(fwd(a, b).astype(jnp.float32))

    both = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for label, prog, work in (("forward", fwd, flops), ("forward+backward", both, 3 * flops)):
      row = {"impl": name, "pass": label, "device": device.device_kind, "m": m, "k": k, "n": n}
      try:
        temp = prog.lower(x, w).compile().memory_analysis().temp_size_in_bytes
        seconds = _time(prog, (x, w), args.iters)
        row.update(ms=seconds * 1e3, tflops_per_s=work / seconds / 1e12, temp_mib=temp / 2**20)
      except Exception as err:  # report the failure, go on with the others
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
      print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
