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


def targeted(cfg, name: str | None) -> bool:
  """Whether the projection `name` of a model with `cfg` (a ModelConfig) gets an adapter."""
  return bool(cfg.lora_rank) and name in target_names(cfg.lora_targets)


def _a_init(fan_in: int):
  """PEFT's A: Kaiming-uniform with a = sqrt(5), i.e. uniform in +-1/sqrt(fan_in)."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


class LoRADense(nn.DenseGeneral):
  """`nn.DenseGeneral` (same parameters, same output) plus a rank-`rank` adapter in float32.
  The adapter's A takes the kernel's input axes and B its output axes, each with the kernel's
  logical names, so they shard like the kernel along their large dimension."""

  rank: int = 0
  alpha: float = 16.0
  names: tuple[str, ...] = ()  # the kernel's logical axis names (inputs, then outputs)

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """x [..., in...] -> [..., out...]: the projection plus its adapter when present."""
    y = super().__call__(inputs)
    if not (self.is_initializing() or self.has_variable("params", "lora_a")):
      return y  # the base alone (the reference policy; a tree without adapters)
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
    in_shape = tuple(inputs.shape[a] for a in axes)
    n_in = len(in_shape)
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
    dt = self.dtype or inputs.dtype
    x = jnp.moveaxis(inputs, [a % inputs.ndim for a in axes], range(-n_in, 0))
    low = jnp.tensordot(x.astype(dt), a.astype(dt), n_in)  # [..., r]
    delta = jnp.tensordot(low, b.astype(dt), 1) * (self.alpha / self.rank)
    return y + delta.astype(y.dtype)


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


def merged(params: Mapping[str, Any], scale: float) -> dict:
  """The plain parameter tree whose projections compute what the adapted ones do: each
  adapted kernel W becomes W + scale A B (scale = alpha / r) in its own dtype, the adapters
  removed (for a Hugging Face export of the merged weights)."""
  flat = traverse_util.flatten_dict(params)
  out = {k: v for k, v in flat.items() if not is_adapter(k)}
  for path in [k for k in flat if k[-1] == "lora_a"]:
    owner = path[:-1]
    a, b, w = flat[path], flat[(*owner, "lora_b")], flat[(*owner, "kernel")]
    product = lambda a, b: jnp.tensordot(a, b, 1)  # noqa: E731  [in..., r] x [r, out...]
    delta = jax.vmap(product)(a, b) if path[0] == SCAN_NAME else product(a, b)
    out[(*owner, "kernel")] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
  return traverse_util.unflatten_dict(out)
