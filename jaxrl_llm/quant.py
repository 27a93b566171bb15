"""The sampler's numeric copy of the policy: float32, bfloat16, or weight-only int8 / int4.

Production RL samples with a cheaper copy of the policy (bf16 or int8 inference engines)
than the learner trains; that gap is what the behaviour corrections of spec §3 correct. The
copy is made inside the fused jitted step, from the learner's parameters, every update.

int8 is symmetric per-output-channel weight-only quantisation: each matrix is rounded to
±127 levels of its channel's max-abs scale and dequantised for compute (activations stay in
the compute dtype). int4 is the same with ±7 levels: a coarse sampler whose mismatch with the
learner is large enough for the corrections' caps to bind (the values are kept dequantised, so
it models int4's rounding, not its memory).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models.lora import SCALE
from jaxrl_llm.models.scan import is_scanned_path

SAMPLER_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
_LEVELS = {"int8": 127, "int4": 7}  # symmetric integer levels each side of zero


def resolve_sampler_dtype(dtype: str, backend: str | None = None) -> str:
  """`auto`: bfloat16 on accelerators (decode reads half the bytes), float32 on CPU (the run
  keeps bfloat16 only where its check passes on the device: `run/assemble.py`)."""
  if dtype != "auto":
    return dtype
  return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


# Parameter name -> axes reduced to get one scale per output channel. Kernels default to
# "every axis but the last" (output features last); q/k/v map D -> (heads, head_dim).
_REDUCE_AXES = {"q": (0,), "k": (0,), "v": (0,), "embedding": (-1,)}


def _channel_axes(path: tuple[Any, ...], x: jax.Array) -> tuple[int, ...]:
  names = [getattr(p, "key", getattr(p, "name", str(p))) for p in path]
  owner = names[-2] if len(names) >= 2 else ""
  if names[-1] == "embedding":
    return _REDUCE_AXES["embedding"]
  if owner in _REDUCE_AXES:
    return _REDUCE_AXES[owner]
  if owner in ("gate", "up", "down") and x.ndim == 3:  # MoE experts [E, in, out]
    return (1,)
  return tuple(range(x.ndim - 1))


def fake_quant(x: jax.Array, axes: tuple[int, ...], levels: int = 127) -> jax.Array:
  """Rounds x to symmetric integers in [-levels, levels] with one scale per channel (max-abs
  over `axes`): 127 for int8, 7 for int4."""
  xf = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(xf), axis=axes, keepdims=True) / levels
  scale = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(xf / scale), -levels, levels)
  return (q * scale).astype(x.dtype)


def _floating(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def _names(path: tuple[Any, ...]) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def _int8_base(params: Any) -> set[tuple[str, ...]]:
  """The paths of an int8-stored base's leaves: each int8 kernel and its `kernel_scale`
  (model.lora_base_dtype=int8 after `quantize_base`), whatever their rank."""
  out = set()
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = _names(path)
    if names[-1] == "kernel" and x.dtype == jnp.int8:
      out |= {names, (*names[:-1], SCALE)}
  return out


def sampler_params(params: Any, dtype: str) -> Any:
  """The parameters the sampler runs with (float32 returns `params` unchanged). An int8-stored
  base, its int8 kernels and their float32 scales, is kept bit for bit in every dtype."""
  if dtype == "float32":
    return params
  base = _int8_base(params)
  if dtype == "bfloat16":

    def cast(path, x):
      keep = not _floating(x) or _names(path) in base
      return x if keep else x.astype(jnp.bfloat16)

    return jax.tree_util.tree_map_with_path(cast, params)
  if dtype in _LEVELS:

    def quant(path, x):
      lead = int(is_scanned_path(path))  # scanned layers: a leading layer axis, kept per layer
      if x.ndim - lead < 2 or not _floating(x) or _names(path) in base:  # norms, biases, int8
        return x
      axes = _channel_axes(path, jax.ShapeDtypeStruct(x.shape[lead:], x.dtype))
      return fake_quant(x, tuple(a + lead if a >= 0 else a for a in axes), _LEVELS[dtype])

    return jax.tree_util.tree_map_with_path(quant, params)
  raise ValueError(f"sampling.param_dtype={dtype!r}; allowed: {SAMPLER_DTYPES}")


def _plain(tree: Mapping, *names: str) -> bool:
  """Whether `tree` holds each of `names` as a plain projection (a kernel and maybe a bias:
  no adapter, no int8 scale)."""
  return all(isinstance(tree.get(n), Mapping) and set(tree[n]) <= {"kernel", "bias"} for n in names)


def fuse_projections(params: Any) -> Any:
  """The sampler's copy with one query-key-value matmul and one gate-up matmul per layer: each
  attention's q, k, v kernels [D, H|J, Dh] (and biases) concatenated over heads as `qkv`, each
  dense MLP's gate and up [D, F] over features as `gate_up` (what `Attention` and `MLP` run when
  they find them). Made once per update, outside the decode loop; projections with adapters
  or an int8 base, and mixture-of-experts layers, are left as they are. The unfused tree is
  the reference (the learner's own)."""

  def visit(tree: Any, name: str) -> Any:
    if not isinstance(tree, Mapping):
      return tree
    out = {k: visit(v, k) for k, v in tree.items()}
    if name == "attn" and _plain(out, "q", "k", "v"):
      fused = {
        part: jnp.concatenate([out[n][part] for n in "qkv"], axis=-2)
        for part in ("kernel", "bias")
        if part in out["q"]
      }
      out = {k: v for k, v in out.items() if k not in ("q", "k", "v")} | {"qkv": fused}
    if name == "mlp" and _plain(out, "gate", "up"):
      kernel = jnp.concatenate([out["gate"]["kernel"], out["up"]["kernel"]], axis=-1)
      out = {k: v for k, v in out.items() if k not in ("gate", "up")} | {
        "gate_up": {"kernel": kernel}
      }
    return out

  return visit(params, "")
