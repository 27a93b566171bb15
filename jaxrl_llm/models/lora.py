"""Low-rank adapters (LoRA) on the model's projections.

A targeted projection `y = x W` becomes `y = x W + (alpha / r) (x A) B`, with A [in, r] drawn as
PEFT draws it (Kaiming-uniform, bound 1/sqrt(in)) and B [r, out] zero, so the adapted model
equals its base at initialisation. `model.lora_rank` (0 = none) turns adapters on and
`model.lora_targets` names the projections that get them: `q k v o` (attention), `gate up down`
(the dense MLP and the MoE layers' shared experts), by these names or by Hugging Face's module
names (`q_proj`, ...), as PEFT's `target_modules` does. Routed experts and the router get none.

The adapters are the parameters named `lora_a` / `lora_b`; `split_adapters` takes them out of
a parameter tree (the base is the rest) and `join_adapters` puts them back. A projection applied
to a tree without its adapters (the base alone, e.g. the reference policy) is the plain one.

In a run the state's parameters hold base and adapters together; the optimiser sees only
`trainable(params)` (the adapters when there are any, else everything), so the base gets no
gradient, no optimiser moments and no update, and the KL reference is `reference(params)`, the
base itself (no second copy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxrl_llm.models.config import HF_NAMES, PROJECTIONS, target_names  # noqa: F401
from jaxrl_llm.models.scan import SCAN_NAME

ADAPTERS = ("lora_a", "lora_b")  # the adapter parameters' names in a projection
RANK_AXIS = "lora_rank"  # the logical axis of the rank r (replicated)
SCALE = "kernel_scale"  # an int8 kernel's float32 scales, one per output channel


def targeted(cfg, name: str | None) -> bool:
  """Whether the projection `name` of a model with `cfg` (a ModelConfig) gets an adapter."""
  return bool(cfg.lora_rank) and name in target_names(cfg.lora_targets)


def projection(cfg, name: str, names: tuple[str, ...], **kwargs) -> nn.Module:
  """The module of projection `name` with kernel axes `names` (`kwargs`: DenseGeneral's): a
  `LoRADense` where it gets an adapter or its base is stored int8, else `nn.DenseGeneral`."""
  int8 = bool(cfg.lora_rank) and cfg.lora_base_dtype == "int8" and name in PROJECTIONS
  if not (targeted(cfg, name) or int8):
    return nn.DenseGeneral(**kwargs, name=name)
  rank = cfg.lora_rank if targeted(cfg, name) else 0
  extra = dict(alpha=cfg.lora_alpha, names=names, dropout=cfg.lora_dropout, int8=int8)
  return LoRADense(**kwargs, name=name, rank=rank, **extra)


def _a_init(fan_in: int):
  """PEFT's A: Kaiming-uniform with a = sqrt(5), i.e. uniform in +-1/sqrt(fan_in)."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


class LoRADense(nn.DenseGeneral):
  """`nn.DenseGeneral` (same parameters, same output) plus a rank-`rank` adapter in float32.
  The adapter's A takes the kernel's input axes and B its output axes, each with the kernel's
  logical names, so they shard like the kernel along their large dimension. `rank` 0: no
  adapter (a projection that is only stored int8). `int8`: the kernel is stored as int8 with a
  float32 `kernel_scale` per output channel (`quantize_base`), dequantised for compute.
  `dropout`: PEFT's lora_dropout on the adapter's input, active when a `dropout` rng is given
  (the learner's gradient passes), never in sampling or scoring."""

  rank: int = 0
  alpha: float = 16.0
  names: tuple[str, ...] = ()  # the kernel's logical axis names (inputs, then outputs)
  dropout: float = 0.0  # rate on the adapter's input when a `dropout` rng is given
  int8: bool = False  # the kernel is stored int8 with one float32 scale per output channel

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """x [..., in...] -> [..., out...]: the projection plus its adapter when present."""
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
    n_in = len(axes)
    dt = self.dtype or inputs.dtype
    x = jnp.moveaxis(inputs, [a % inputs.ndim for a in axes], range(-n_in, 0))
    y = self._base(inputs, x, features, dt)
    if not self.rank or not (self.is_initializing() or self.has_variable("params", "lora_a")):
      return y  # the base alone (the reference policy; a tree without adapters)
    in_shape = x.shape[-n_in:]
    a = self.param(
      "lora_a",
      nn.with_logical_partitioning(_a_init(math.prod(in_shape)), (*self.names[:n_in], RANK_AXIS)),
      (*in_shape, self.rank),
      jnp.float32,
    )
    b = self.param(
      "lora_b",
      nn.with_logical_partitioning(nn.initializers.zeros, (RANK_AXIS, *self.names[n_in:])),
      (self.rank, *features),
      jnp.float32,
    )
    if self.dropout:
      x = nn.Dropout(self.dropout, deterministic=not self.has_rng("dropout"))(x)
    low = jnp.tensordot(x.astype(dt), a.astype(dt), n_in)  # [..., r]
    delta = jnp.tensordot(low, b.astype(dt), 1) * (self.alpha / self.rank)
    return y + delta.astype(y.dtype)

  def _base(self, inputs, x, features, dt) -> jax.Array:
    """The projection itself: DenseGeneral's, or from the int8 kernel and its scales."""
    if not self.int8:
      return super().__call__(inputs)
    scale = self.param(
      SCALE,
      nn.with_logical_partitioning(nn.initializers.ones, self.names[-len(features) :]),
      features,
      jnp.float32,
    )
    if self.is_initializing():  # a float kernel, rounded to int8 once (`quantize_base`)
      return super().__call__(inputs)
    kernel = self.get_variable("params", "kernel")
    n_in = kernel.ndim - len(features)
    y = jnp.tensordot(x.astype(dt), kernel.astype(dt), n_in) * scale.astype(dt)
    if self.use_bias:
      y = y + self.get_variable("params", "bias").astype(dt)
    return y


def is_adapter(path: Sequence[str]) -> bool:
  """Whether a flattened parameter path ends in an adapter parameter."""
  return bool(path) and path[-1] in ADAPTERS


def split_adapters(params: Mapping[str, Any]) -> tuple[dict, dict]:
  """(base, adapters): the parameter tree without its adapters, and the adapters alone (the
  same nesting, holding only `lora_a` / `lora_b` leaves)."""
  flat = traverse_util.flatten_dict(params)
  base = {k: v for k, v in flat.items() if not is_adapter(k)}
  adapters = {k: v for k, v in flat.items() if is_adapter(k)}
  return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(adapters)


def fresh_parts(params: Mapping[str, Any]) -> dict:
  """What a run initialises on top of pretrained weights: the adapters and the int8 scales
  (ones until `quantize_base` sets them)."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict(
    {k: v for k, v in flat.items() if is_adapter(k) or k[-1] == SCALE}
  )


def join_adapters(base: Mapping[str, Any], adapters: Mapping[str, Any]) -> dict:
  """The parameter tree of `base` with `adapters` put back (the inverse of `split_adapters`)."""
  flat = traverse_util.flatten_dict(base) | traverse_util.flatten_dict(adapters)
  return traverse_util.unflatten_dict(flat)


def adapted(adapters: Mapping[str, Any]) -> dict[str, int]:
  """{projection name: how many projections carry an adapter}, from an adapter tree."""
  counts: dict[str, int] = {}
  for path in traverse_util.flatten_dict(adapters):
    if path[-1] == "lora_a":
      counts[path[-2]] = counts.get(path[-2], 0) + 1
  return counts


def unmatched(targets: str, adapters: Mapping[str, Any]) -> list[str]:
  """The targets of `lora_targets` that no projection of the model matched."""
  found = adapted(adapters)
  return [t for t in target_names(targets) if t not in found]


def has_adapters(params: Mapping[str, Any]) -> bool:
  """Whether a parameter tree holds adapters (static: decided from its paths)."""
  return any(is_adapter(k) for k in traverse_util.flatten_dict(params))


def trainable(params: Mapping[str, Any]) -> tuple[dict | None, Any]:
  """(frozen, trainable): (the base, the adapters) when `params` holds adapters, else
  (None, params). `with_frozen(frozen, trainable)` puts them together again."""
  if not has_adapters(params):
    return None, params
  return split_adapters(params)


def with_frozen(frozen: Mapping[str, Any] | None, trained: Any) -> Any:
  """The full parameter tree from `trainable`'s two parts."""
  return trained if frozen is None else join_adapters(frozen, trained)


def reference(params: Mapping[str, Any]) -> dict:
  """The KL reference of a tree with adapters: its base (the policy before any update)."""
  return split_adapters(params)[0]


def _channel_axes(path: Sequence[str], kernel, scale) -> tuple[int, ...]:
  """The kernel axes a per-output-channel scale reduces over: its input axes (after a
  scanned layer axis, which keeps one scale per layer)."""
  lead = int(path[0] == SCAN_NAME)
  return tuple(range(lead, lead + kernel.ndim - scale.ndim))


def quantize_base(params: Mapping[str, Any]) -> dict:
  """Each projection that has a `kernel_scale` (model.lora_base_dtype=int8) gets its kernel
  rounded to symmetric int8, one float32 scale per output channel (max |w| / 127); kernels
  already int8 stay as they are. Weight-only: activations keep the compute dtype."""
  flat = dict(traverse_util.flatten_dict(params))
  for path in [k for k in flat if k[-1] == SCALE]:
    owner = path[:-1]
    w = flat[(*owner, "kernel")]
    if w.dtype == jnp.int8:
      continue
    axes = _channel_axes(path, w, flat[path])
    scale = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axes) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.round(w.astype(jnp.float32) / jnp.expand_dims(scale, axes))
    flat[(*owner, "kernel")] = jnp.clip(q, -127, 127).astype(jnp.int8)
    flat[path] = scale
  return traverse_util.unflatten_dict(flat)


def dequantized(params: Mapping[str, Any], dtype=jnp.float32) -> dict:
  """The plain tree of a tree with int8 kernels: each kernel q * scale in `dtype`, the scales
  removed (the inverse of `quantize_base` up to its rounding)."""
  flat = traverse_util.flatten_dict(params)
  out = {k: v for k, v in flat.items() if k[-1] != SCALE}
  for path in [k for k in flat if k[-1] == SCALE]:
    q, scale = flat[(*path[:-1], "kernel")], flat[path]
    w = q.astype(jnp.float32) * jnp.expand_dims(scale, _channel_axes(path, q, scale))
    out[(*path[:-1], "kernel")] = w.astype(dtype)
  return traverse_util.unflatten_dict(out)


def merged(params: Mapping[str, Any], scale: float) -> dict:
  """The plain parameter tree whose projections compute what the adapted ones do: each
  adapted kernel W becomes W + scale A B (scale = alpha / r) in its own dtype, the adapters
  removed (for a Hugging Face export of the merged weights; an int8 base is dequantised to
  float32 first)."""
  flat = traverse_util.flatten_dict(dequantized(params))
  out = {k: v for k, v in flat.items() if not is_adapter(k)}
  for path in [k for k in flat if k[-1] == "lora_a"]:
    owner = path[:-1]
    a, b, w = flat[path], flat[(*owner, "lora_b")], flat[(*owner, "kernel")]
    product = lambda a, b: jnp.tensordot(a, b, 1)  # noqa: E731  [in..., r] x [r, out...]
    delta = jax.vmap(product)(a, b) if path[0] == SCAN_NAME else product(a, b)
    out[(*owner, "kernel")] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
  return traverse_util.unflatten_dict(out)
