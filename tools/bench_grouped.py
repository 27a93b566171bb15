"""Time one grouped (mixture-of-experts) matmul, forward and forward+backward, per backend.

  python tools/bench_grouped.py [--rows=137728] [--k=1024] [--n=384] [--experts=64] [--iters=20]
  python tools/bench_grouped.py --rows=16384 --sweep   # the Mosaic kernels' block sizes (Hopper)

Rows are split over the experts in near-equal groups (as a balanced router gives). For each
implementation that runs on this device (`kernel`: the Mosaic GPU kernels, Hopper only;
`portable`: the tiled scan; `ragged`: `jax.lax.ragged_dot`) it prints one JSON line with the
time per call and useful TFLOP/s (2·M·K·N forward, 3x that forward+backward) and the compiled
program's temp bytes. An implementation that fails to compile or run reports its error.

A call of a quarter of a millisecond is timed three ways, since the host's share is not small
next to it: `ms` is `iters` calls dispatched back to back and waited for once (the device's
pace: the host queues the next call while the device runs this one; what a model's step sees),
`ms_synced` the median of calls each waited for (adds one dispatch and one host round trip per
call), and `ms_device` the kernels' own time by CUPTI (GPU only, where the profiler may attach).

`--sweep` times each of the three Mosaic kernels (forward, input gradient, weight gradient)
over a grid of block sizes, one JSON line per setting and then the fastest beside the one
`jaxrl_llm/kernels/grouped.py` uses. Settings the kernel refuses (shared memory) report it.
"""

from __future__ import annotations

import itertools
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

from jaxrl_llm import fast_paths, terminal  # noqa: E402
from jaxrl_llm.kernels import grouped, verify  # noqa: E402


def _impls(device, k: int, n: int) -> dict:
  impls = {"portable": grouped.grouped_matmul, "ragged": jax.lax.ragged_dot}
  if grouped.kernel_unsupported(device, jnp.bfloat16, (k, n)) is None:
    impls["kernel"] = grouped.kernel_matmul
  return impls


def _device_ms(fn, args, iters: int) -> float | None:
  """Median of the kernels' summed time per call by CUPTI (None off GPU or if it cannot attach)."""
  if jax.devices()[0].platform != "gpu":
    return None
  try:
    from jax.experimental.mosaic.gpu import profiler

    _, times = profiler.measure(fn, iterations=max(iters, 2))(*args)  # a list from 2 on
    return statistics.median(times) if times else None
  except Exception as err:  # no CUPTI here: the other two timings stand
    print(f"CUPTI timing unavailable: {type(err).__name__}: {err}", file=sys.stderr)
    return None


def timings(fn, args, iters: int) -> dict[str, float]:
  """Milliseconds per call: `ms` (back to back), `ms_synced`, and `ms_device` where measured."""
  jax.block_until_ready(fn(*args))  # compile and warm up
  synced = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    synced.append(time.perf_counter() - start)
  start = time.perf_counter()
  jax.block_until_ready([fn(*args) for _ in range(iters)])
  out = {
    "ms": (time.perf_counter() - start) / iters * 1e3,
    "ms_synced": statistics.median(synced) * 1e3,
  }
  device = _device_ms(fn, args, iters)
  if device is not None:
    out["ms_device"] = device
  return out


def sweep_settings(kernel: str, k: int, n: int) -> list[dict[str, int]]:
  """The block sizes tried for one Mosaic kernel (`forward`, `input_grad`, `weight_grad`) at
  input width k and output width n: every output-block width that divides the output, with 1
  or 2 column blocks per grid step, 2 or 4 pipeline stages and 64 or 128 rows per block."""
  out_width = {"forward": n, "input_grad": k, "weight_grad": n}[kernel]
  settings = []
  for block_m, block_n, stages, grid_block_n in itertools.product(
    (64, 128), (64, 128, 192), (2, 4), (1, 2)
  ):
    if out_width % (block_n * grid_block_n):
      continue
    if kernel == "weight_grad" and k % block_m:  # its block_m tiles the input width
      continue
    settings.append(
      dict(
        block_m=block_m,
        block_n=block_n,
        block_k=grouped.KERNEL_BLOCK_K,
        max_concurrent_steps=stages,
        grid_block_n=grid_block_n,
      )
    )
  return settings


KERNELS = ("forward", "input_grad", "weight_grad")  # the order of `grouped.KERNEL_OPS`' tuples


def _operands(kernel: str, x, w, dy) -> tuple:
  """The two matrices a kernel multiplies: x @ w, dy @ w.T, x.T @ dy."""
  return {"forward": (x, w), "input_grad": (dy, w), "weight_grad": (x, dy)}[kernel]


def _kernel_call(kernel: str, blocks: dict[str, int]):
  """The module's own Mosaic kernel call at other block sizes, jitted over (x, w, dy, sizes)."""
  op = grouped.KERNEL_OPS["mgpu"][KERNELS.index(kernel)]
  return jax.jit(lambda x, w, dy, s: op(*_operands(kernel, x, w, dy), s, blocks))


def _in_use(kernel: str, k: int, n: int) -> dict[str, int]:
  """The block sizes `grouped.kernel_matmul` uses for this kernel at these widths."""
  if kernel == "forward":
    return grouped.kernel_blocks(n)
  if kernel == "input_grad":
    return grouped.kernel_blocks(k)
  return grouped.weight_grad_blocks(k, n)


def _reference(kernel: str):
  """A kernel's `jax.lax.ragged_dot` form (the oracles the interpreter's tests use) over
  (x, w, dy, sizes)."""
  op = (jax.lax.ragged_dot, *grouped.KERNEL_OPS["mgpu_forward"][1:])[KERNELS.index(kernel)]
  return lambda x, w, dy, s: op(*_operands(kernel, x, w, dy), s)


REFERENCES = {kernel: _reference(kernel) for kernel in KERNELS}  # to check every setting
TOLERANCE = fast_paths.GROUPED_TOLERANCE  # what `tools/device_check.py` allows these kernels


def held_rows_error(kernel: str, got: jax.Array, want: jax.Array, sizes: jax.Array) -> float:
  """`verify.rel_error` over the rows the groups hold (the kernels leave the rows past them
  unwritten; the weight gradient has no such rows)."""
  if kernel != "weight_grad":
    used = int(jnp.sum(sizes))
    got, want = got[:used], want[:used]
  return verify.rel_error((got,), (want,))


def _sweep_row(kernel: str, blocks: dict[str, int], args, want, iters: int) -> dict:
  """One setting's JSON row: its block sizes, relative error, timings and TFLOP/s (or error)."""
  x, w = args[0], args[1]
  m, k, n = x.shape[0], x.shape[1], w.shape[2]
  row = {"sweep": kernel, "m": m, "k": k, "n": n, **blocks}
  try:
    call = _kernel_call(kernel, blocks)
    row["rel_error"] = held_rows_error(kernel, call(*args), want, args[3])
    row.update(timings(call, args, iters))
    row["tflops_per_s"] = 2 * m * k * n / row.get("ms_device", row["ms"]) / 1e9
  except Exception as err:  # too much shared memory, or a layout the kernel refuses
    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
  return row


def sweep(x, w, sizes, iters: int) -> None:
  """Print one JSON line per (kernel, block sizes) with its time and its relative error against
  `jax.lax.ragged_dot`, then each kernel's fastest correct setting beside the one in use."""
  k, n = x.shape[1], w.shape[2]
  dy = jax.random.normal(jax.random.PRNGKey(1), (x.shape[0], n), x.dtype)
  args = (x, w, dy, sizes)
  for kernel in KERNELS:
    want = jax.jit(REFERENCES[kernel])(*args)
    rows = []
    for blocks in sweep_settings(kernel, k, n):
      rows.append(_sweep_row(kernel, blocks, args, want, iters))
      print(json.dumps(rows[-1]), flush=True)
    ms = lambda r: r.get("ms_device", r["ms"])  # noqa: E731
    good = [r for r in rows if "error" not in r and r["rel_error"] <= TOLERANCE]
    in_use = _in_use(kernel, k, n)
    mine = [ms(r) for r in good if all(r[key] == v for key, v in in_use.items())]
    if good:
      fastest = min(good, key=ms)
      summary = {"sweep": kernel, "fastest": {key: fastest[key] for key in in_use}}
      summary.update(fastest_ms=ms(fastest), in_use=in_use, in_use_ms=mine[0] if mine else None)
      print(json.dumps(summary), flush=True)


def main(argv: list[str]) -> int:
  """Parse flags, time each implementation (or sweep the kernels), print JSON lines."""
  parser = terminal.ArgParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--rows", type=terminal.count, default=137_728, help="routed rows M (tokens x top-k)"
  )
  parser.add_argument("--k", type=terminal.count, default=1024, help="input width (d_model)")
  parser.add_argument("--n", type=terminal.count, default=384, help="output width (expert width)")
  parser.add_argument("--experts", type=terminal.count, default=64, help="number of groups E")
  parser.add_argument(
    "--iters", type=terminal.count, default=20, help="timed calls per measurement"
  )
  parser.add_argument("--sweep", action="store_true", help="the Mosaic kernels' block sizes")
  args = parser.parse_args(argv)
  m, k, n, e = args.rows, args.k, args.n, args.experts
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (e, k, n), jnp.bfloat16)
  sizes = jnp.full((e,), m // e, jnp.int32).at[: m % e].add(1)
  device = jax.devices()[0]
  if args.sweep:
    why = grouped.kernel_unsupported(device, jnp.bfloat16, (k, n))
    if m % 128:
      why = f"--rows={m} must be a multiple of 128 (the largest block of rows tried)"
    if why:
      print(f"error: --sweep times the Mosaic GPU kernels, which cannot run here: {why}")
      return 2
    sweep(x, w, sizes, args.iters)
    return 0
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
        row.update(timings(prog, (x, w), args.iters), temp_mib=temp / 2**20)
        for key in ("ms", "ms_synced", "ms_device"):
          if key in row:
            row["tflops_per_s" + key[2:]] = work / row[key] / 1e9
      except Exception as err:  # report the failure, go on with the others
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
      print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
