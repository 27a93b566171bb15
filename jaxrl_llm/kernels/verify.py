"""The fast paths `auto` may choose, each checked against its reference on this device.

A fast path (a Mosaic GPU kernel, cuDNN attention, the sampler's reduced-precision copy, the
chunked log-probs) is chosen by `auto` only where it has been verified for the device kind
it runs on: listed in `VERIFIED` for this device kind and JAX version, or checked once in this
process by running it and its reference at a small shape and comparing values and gradients.
A path whose check fails (or raises) is not chosen; one log line says so and names the
fallback.

  CHECKS            check name -> `Check` (the fast path, its reference, the tolerance)
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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxrl_llm.kernels import attention, grouped, logprobs

# (fast path, device kind, JAX version) measured passing by `tools/device_check.py` on a card;
# `verified` trusts these rows without running the check again. Elsewhere the check runs.
VERIFIED: frozenset[tuple[str, str, str]] = frozenset(
  {
    ("moe_kernel", "NVIDIA H200", "0.11.2"),  # 2026-11-26, after the dx rows fix
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


def _rel_error(fast, ref) -> float:
  """max |fast - ref| / max |ref| over pairs of arrays (float64 on the host)."""
  worst = 0.0
  for a, b in zip(fast, ref, strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
      return float("inf")
    scale = max(float(np.max(np.abs(b))), 1e-30) if b.size else 1.0
    worst = max(worst, float(np.max(np.abs(a - b))) / scale if b.size else 0.0)
  return worst


# ---- the cases --------------------------------------------------------------------------------

_GROUPS = (37, 0, 150, 1, 64, 200, 100, 48)  # 600 rows over 8 experts, one empty, one of 1 row
_GROUPED_SHAPE = (640, 128, 128)  # M (40 rows past the groups), K, N


def _grouped_case(ops: str, output: str):
  """The grouped matmul's forward (`output="y"`), input gradient ("dx") or weight gradient
  ("dw") by the Mosaic GPU kernels (`ops`) against `jax.lax.ragged_dot` in float32."""
  m, k, n = _GROUPED_SHAPE
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (len(_GROUPS), k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  dy = jax.random.normal(kc, (m, n), jnp.bfloat16)
  sizes = jnp.asarray(_GROUPS, jnp.int32)

  def fast(x, w):
    return grouped.kernel_matmul(x, w, sizes, ops)

  def ref(x, w):
    return jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)

  def pull(fn, x, w):
    y, vjp = jax.vjp(fn, x, w)
    dx, dw = vjp(dy.astype(y.dtype))
    return {"y": y, "dx": dx, "dw": dw}[output]

  got = jax.jit(functools.partial(pull, fast))(x, w)
  want = jax.jit(functools.partial(pull, ref))(x, w)
  return (got,), (want,)


def _grouped_refusal(interpreted: bool, backward: bool) -> Callable[[], str | None]:
  def refusal():
    if interpreted:
      if backward:
        return "the interpreter cannot run the backward kernels (transposed operands)"
      return None
    return grouped.kernel_unsupported(jax.devices()[0], jnp.bfloat16, _GROUPED_SHAPE[1:])

  return refusal


def _attention_case():
  """cuDNN attention (`padded_causal`) at an odd length with left padding, against the einsum
  reference, in values and in the gradients of q, k and v (valid positions only)."""
  b, t, h, j, dh = 3, 37, 4, 2, 64
  kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(1), 4)
  q = jax.random.normal(kq, (b, t, h, dh), jnp.bfloat16)
  keys = jax.random.normal(kk, (b, j, t, dh), jnp.bfloat16)
  values = jax.random.normal(kv, (b, j, t, dh), jnp.bfloat16)
  lengths = jnp.asarray([t, 20, 1])
  key_valid = jnp.arange(t)[None, :] >= (t - lengths)[:, None]  # left-padded rows
  cot = jax.random.normal(kc, (b, t, h, dh), jnp.float32) * key_valid[:, :, None, None]

  def loss(fn, q, keys, values):
    out = fn(q, keys, values).astype(jnp.float32)
    return jnp.sum(out * cot), out * key_valid[:, :, None, None]

  def fast(q, keys, values):
    return attention.padded_causal(q, keys, values, key_valid, "cudnn")

  def ref(q, keys, values):
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, keys, values))
    return attention.reference(qf, kf, vf, attention.mask(key_valid, t, 0))

  def both(fn):
    grad = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2), has_aux=True)
    grads, out = jax.jit(grad)(q, keys, values)
    return (out, *grads)

  return both(fast), both(ref)


def _attention_refusal() -> str | None:
  return attention.cudnn_refusal(jnp.bfloat16, 64)


def _sampler_case(dtype: str):
  """A small policy's token log-probs with the sampler's `dtype` copy of its weights against
  the float32 weights (the gap the behaviour corrections of spec §3 see)."""
  from jaxrl_llm import quant
  from jaxrl_llm.models.config import ModelConfig
  from jaxrl_llm.models.transformer import Transformer, positions_from_mask

  cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=2, head_dim=16, mlp_dim=128)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (4, 24), 0, cfg.vocab_size)
  valid = jnp.ones(tokens.shape, bool)
  pos = positions_from_mask(valid)
  params = nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(3), tokens, pos, valid))["params"]

  def logp(p, compute):
    model = Transformer(dataclasses.replace(cfg, dtype=compute))
    logits = model.apply({"params": p}, tokens, pos, valid).logits
    return jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)

  compute = "bfloat16" if dtype in ("bfloat16", "int8") else "float32"
  got = jax.jit(lambda p: logp(quant.sampler_params(p, dtype), compute))(params)
  want = jax.jit(lambda p: logp(p, "float32"))(params)
  return (got,), (want,)


def _chunked_case(temperature: float = 0.7, reference_temperature: float = 0.7):
  """`logprobs.chunked` against `logprobs.reference`: ℓ, H and the gradient of the hidden
  states. (`reference_temperature` differs only in the tests' failing check.)"""
  b, t, d, v = 3, 16, 32, 97
  kh, kw, kt = jax.random.split(jax.random.PRNGKey(4), 3)
  hidden = jax.random.normal(kh, (b, t, d), jnp.float32)
  w = jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)
  tokens = jax.random.randint(kt, (b, t), 0, v)
  head = lambda h: jnp.einsum("...d,dv->...v", h, w)  # noqa: E731

  def run(fn, tau):
    def loss(h):
      lp, ent = fn(h, head, tokens, tau)
      return jnp.sum(lp) + 0.3 * jnp.sum(ent), (lp, ent)

    grad, (lp, ent) = jax.jit(jax.grad(loss, has_aux=True))(hidden)
    return lp, ent, grad

  return run(functools.partial(logprobs.chunked, chunk=4), temperature), run(
    logprobs.reference, reference_temperature
  )


_RUNS_ANYWHERE = lambda: None  # noqa: E731
_GROUPED_NOTE = "E=8 groups (one empty), M=640 (40 rows past the groups), K=N=128, bf16"

CHECKS: dict[str, Check] = {
  "grouped_forward": Check(
    functools.partial(_grouped_case, "mgpu", "y"),
    _grouped_refusal(False, False),
    2e-2,
    "Mosaic GPU grouped matmul forward; " + _GROUPED_NOTE,
  ),
  "grouped_input_grad": Check(
    functools.partial(_grouped_case, "mgpu", "dx"),
    _grouped_refusal(False, True),
    2e-2,
    "its input-gradient kernel (w read transposed)",
  ),
  "grouped_weight_grad": Check(
    functools.partial(_grouped_case, "mgpu", "dw"),
    _grouped_refusal(False, True),
    2e-2,
    "its weight-gradient kernel (transposed grouped matmul)",
  ),
  "cudnn_attention": Check(
    _attention_case,
    _attention_refusal,
    3e-2,
    "cuDNN flash attention, T=37, left padding 0/17/36, GQA 4/2, Dh=64; values, dq, dk, dv",
  ),
  "sampler_bfloat16": Check(
    functools.partial(_sampler_case, "bfloat16"),
    _RUNS_ANYWHERE,
    5e-2,
    "log-probs with the bf16 sampler copy vs float32 weights",
  ),
  "sampler_int8": Check(
    functools.partial(_sampler_case, "int8"),
    _RUNS_ANYWHERE,
    1e-1,
    "log-probs with the int8 (weight-only) sampler copy vs float32 weights",
  ),
  "chunked_logprobs": Check(
    _chunked_case,
    _RUNS_ANYWHERE,
    1e-5,
    "chunked log-probs and entropies (float32) and their gradient",
  ),
}

# The forward kernel alone, under the Pallas GPU interpreter (runs on CPU).
INTERPRETED: dict[str, Check] = {
  "grouped_forward": dataclasses.replace(
    CHECKS["grouped_forward"],
    case=functools.partial(_grouped_case, "mgpu_forward", "y"),
    refusal=_grouped_refusal(True, False),
    interpreted=True,
  ),
  "grouped_input_grad": dataclasses.replace(
    CHECKS["grouped_input_grad"], refusal=_grouped_refusal(True, True), interpreted=True
  ),
  "grouped_weight_grad": dataclasses.replace(
    CHECKS["grouped_weight_grad"], refusal=_grouped_refusal(True, True), interpreted=True
  ),
}

FAST_PATHS: dict[str, tuple[str, ...]] = {
  "moe_kernel": ("grouped_forward", "grouped_input_grad", "grouped_weight_grad"),
  "cudnn_attention": ("cudnn_attention",),
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
      return _rel_error(fast, ref)

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
