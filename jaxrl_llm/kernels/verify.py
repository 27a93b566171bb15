"""The fast paths `auto` may choose, each checked against its reference on this device.

A fast path (a Mosaic GPU kernel, cuDNN attention, the sampler's reduced-precision copy, the
chunked log-probs) is chosen by `auto` only where it has been verified for the device kind
it runs on: listed in `VERIFIED` for this device kind and JAX version, or checked once in this
process by running it and its reference at a small shape and comparing values and gradients.
A path whose check fails (or raises) is not chosen; one log line says so and names the
fallback.

  CHECKS            check name -> `Check` (the fast path, its reference, the tolerance),
                    filled by `register` from `jaxrl_llm/fast_paths.py`
  FAST_PATHS        the fast path `auto` chooses -> the checks it needs
  run_check(name)   one `Result`: pass | fail | skip (does not run here) | error
  verified(path)    whether `auto` may choose `path` on this device (cached per process)
  choose(path, fast, fallback)   what `auto` picks: `fast` if verified, else `fallback`
  table(results)    the rows `tools/device_check.py` prints

Errors are relative: max |fast - reference| / max |reference| over the compared outputs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np
from absl import logging

# (fast path, device kind, JAX version) measured passing by `tools/device_check.py` on a card;
# `verified` trusts these rows without running the check again. Elsewhere the check runs.
VERIFIED: frozenset[tuple[str, str, str]] = frozenset(
  {
    # moe_kernel on the H200 (passed 2026-11-26) is checked once per process again until
    # tools/device_check.py passes with the weight-gradient blocks and check shape of 2026-11-27.
    ("cudnn_attention", "NVIDIA H200", "0.11.2"),  # 2026-11-26
    ("sampler_bfloat16", "NVIDIA H200", "0.11.2"),  # 2026-11-26
  }
)


@dataclasses.dataclass(frozen=True)
class Result:
  """One check's outcome on one device."""

  name: str
  status: str  # pass | fail | skip | error
  error: float | None = None  # the largest relative error over values and gradients
  tolerance: float | None = None
  note: str = ""  # why it skipped or failed, or what it compared
  seconds: float = 0.0  # compile and run, both paths


@dataclasses.dataclass(frozen=True)
class Check:
  """A fast path against its reference. `case()` -> (fast outputs, reference outputs), each
  a tuple of arrays compared pairwise; `refusal()` -> why it cannot run here (None if it
  can). `interpreted` runs the case under the Pallas GPU interpreter (CPU tests)."""

  case: Callable[[], tuple[tuple, tuple]]
  refusal: Callable[[], str | None]
  tolerance: float
  note: str
  interpreted: bool = False


def rel_error(fast, ref) -> float:
  """max |fast - ref| / max |ref| over pairs of arrays (float64 on the host); inf where a fast
  output is not finite."""
  worst = 0.0
  for a, b in zip(fast, ref, strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
      return float("inf")
    scale = max(float(np.max(np.abs(b))), 1e-30) if b.size else 1.0
    worst = max(worst, float(np.max(np.abs(a - b))) / scale if b.size else 0.0)
  return worst


CHECKS: dict[str, Check] = {}  # name -> check, filled by `register` (jaxrl_llm/fast_paths.py)
INTERPRETED: dict[str, Check] = {}  # the same names, as the Pallas GPU interpreter runs them


def register(name: str, check: Check, interpreted: Check | None = None) -> None:
  """Adds the check `name` (and its interpreter form, for CPU tests) to the tables."""
  CHECKS[name] = check
  if interpreted is not None:
    INTERPRETED[name] = interpreted


FAST_PATHS: dict[str, tuple[str, ...]] = {
  "moe_kernel": ("grouped_forward", "grouped_input_grad", "grouped_weight_grad"),
  "cudnn_attention": ("cudnn_attention",),
  "pallas_decode": ("pallas_decode",),
  "sampler_bfloat16": ("sampler_bfloat16",),
}


def _interpreter():
  from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

  return force_gpu_interpret_mode()


def run_check(name: str, checks: Mapping[str, Check] | None = None) -> Result:
  """Runs one check here (eagerly, even when called while a program is being traced)."""
  check = (CHECKS if checks is None else checks)[name]
  why = check.refusal()
  if why is not None:
    return Result(name, "skip", note=why)
  start = time.perf_counter()

  def compare() -> float:
    with _interpreter() if check.interpreted else contextlib.nullcontext():
      fast, ref = check.case()
      return rel_error(fast, ref)

  try:  # a thread of its own: JAX's trace state is per thread, so this runs eagerly
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # even while a caller traces
      error = pool.submit(compare).result()
  except Exception as err:  # a fast path that fails to compile or run is not chosen
    first = (str(err).splitlines() or [""])[0][:300]
    return Result(name, "error", note=f"{type(err).__name__}: {first}")
  status = "pass" if error <= check.tolerance else "fail"
  seconds = time.perf_counter() - start
  return Result(name, status, error, check.tolerance, check.note, seconds)


def _device_kind() -> str:
  return jax.devices()[0].device_kind


@functools.cache
def _verified(path: str, device_kind: str, checks_id: int) -> bool:
  """`verified` for one (path, device kind, check table), computed once per process."""
  checks = _TABLES[checks_id]
  if checks is CHECKS and (path, device_kind, jax.__version__) in VERIFIED:
    return True
  results = [run_check(name, checks) for name in FAST_PATHS.get(path, (path,))]
  bad = [r for r in results if r.status != "pass"]
  if bad:
    why = "; ".join(f"{r.name}: {r.status} {r.note if r.error is None else r.error}" for r in bad)
    logging.warning("fast path %s not verified on %s, falling back (%s)", path, device_kind, why)
  return not bad


_TABLES: dict[int, Mapping[str, Check]] = {id(CHECKS): CHECKS}


def verified(path: str, checks: Mapping[str, Check] | None = None) -> bool:
  """Whether `auto` may choose the fast path `path` (a FAST_PATHS key, or a check name) on
  this process's device: in `VERIFIED`, or its checks pass here (run once per process). On a
  failure one warning names the check and why; the caller falls back."""
  checks = CHECKS if checks is None else checks
  if any(name not in checks for name in FAST_PATHS.get(path, (path,))):
    return False  # its checks are not registered in this process (see jaxrl_llm/fast_paths.py)
  _TABLES.setdefault(id(checks), checks)
  return _verified(path, _device_kind(), id(checks))


def choose(path: str, fast: str, fallback: str, checks: Mapping[str, Check] | None = None) -> str:
  """`fast` where `verified(path)`, else `fallback`: how every `auto` setting picks a fast
  path (MoE experts, attention)."""
  return fast if verified(path, checks) else fallback


def run_all(interpret: bool = False) -> list[Result]:
  """Every check on this device; with `interpret`, the grouped kernels by the interpreter."""
  checks = {**CHECKS, **INTERPRETED} if interpret else CHECKS
  return [run_check(name, checks) for name in checks]


def table(results: list[Result]) -> str:
  """A Markdown table of results: check, status, relative error, tolerance, seconds, note."""
  rows = ["| check | status | rel. error | tolerance | s | what |", "|---|---|---|---|---|---|"]
  for r in results:
    err = "" if r.error is None else f"{r.error:.2e}"
    tol = "" if r.tolerance is None else f"{r.tolerance:.0e}"
    rows.append(f"| {r.name} | {r.status} | {err} | {tol} | {r.seconds:.1f} | {r.note} |")
  return "\n".join(rows)
