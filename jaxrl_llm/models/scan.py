"""Unrolled <-> scanned layouts of the transformer's layers (`ModelConfig.scan_layers`).

Unrolled, block i's parameters live under `layer_{i}/...` and the KV cache holds a tuple of L
per-layer [B, J, N, Dh] arrays. Scanned, the blocks run under `nn.scan` in steps of
p = `cfg.scan_period` blocks (p = moe_every in an MoE model: p - 1 dense blocks and one MoE
block; p = 1 otherwise). Block i = g·p + j keeps its parameters under `layers/block_{j}/...` at
index g of a leading axis of length L / p (logical axis name `layers`, mapped to no mesh axis),
and the cache is one [L, B, J, N, Dh] array per k and v.

The converters are pure functions of plain (unboxed) parameter trees: `scan_params` stacks an
unrolled tree, `unscan_params` splits a scanned one (a gradient tree as well as parameters).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxrl_llm.models.config import ModelConfig

SCAN_NAME = "layers"  # the scanned module, and the logical name of its leading (layer) axis
_LAYER_PREFIX = "layer_"
_BLOCK_PREFIX = "block_"


def scanned_path(cfg: ModelConfig, path: tuple[str, ...]) -> tuple[tuple[str, ...], int] | None:
  """(scanned path, index on the layer axis) of an unrolled parameter path; None outside blocks."""
  head = path[0]
  if not head.startswith(_LAYER_PREFIX):
    return None
  i, p = int(head[len(_LAYER_PREFIX) :]), cfg.scan_period
  return (SCAN_NAME, f"{_BLOCK_PREFIX}{i % p}", *path[1:]), i // p


def is_scanned_path(path: tuple[Any, ...]) -> bool:
  """Whether a parameter path (strings or jax key entries) is under the scanned layers."""
  head = path[0] if path else None
  return getattr(head, "key", head) == SCAN_NAME


def _check(cfg: ModelConfig, params: Any, scanned: bool) -> dict:
  flat = traverse_util.flatten_dict(params)
  has_layers = any(k[0] == SCAN_NAME for k in flat)
  has_unrolled = any(k[0].startswith(_LAYER_PREFIX) for k in flat)
  if (has_layers, has_unrolled) != (scanned, not scanned):
    want = f"a '{SCAN_NAME}' subtree" if scanned else "'layer_{i}' subtrees"
    raise ValueError(f"expected params with {want}; got top-level keys {sorted(params)}")
  return flat


def scan_params(cfg: ModelConfig, params: Any) -> dict:
  """An unrolled parameter tree (`layer_{i}/...`) in the scanned layout of `cfg`."""
  flat = _check(cfg, params, scanned=False)
  out, groups = {}, {}
  for path, leaf in flat.items():
    target = scanned_path(cfg, path)
    if target is None:
      out[path] = leaf
    else:
      groups.setdefault(target[0], {})[target[1]] = leaf
  num_groups = cfg.num_layers // cfg.scan_period
  for path, parts in groups.items():
    if sorted(parts) != list(range(num_groups)):
      raise ValueError(f"params hold {len(parts)} of the {num_groups} layers of {path}")
    out[path] = jnp.stack([parts[g] for g in range(num_groups)])
  return traverse_util.unflatten_dict(out)


def unscan_params(cfg: ModelConfig, params: Any) -> dict:
  """A scanned parameter tree (`layers/block_{j}/...`) in the unrolled layout."""
  flat = _check(cfg, params, scanned=True)
  out, p = {}, cfg.scan_period
  for path, leaf in flat.items():
    if path[0] != SCAN_NAME:
      out[path] = leaf
      continue
    j = int(path[1][len(_BLOCK_PREFIX) :])
    for g in range(leaf.shape[0]):
      out[(f"{_LAYER_PREFIX}{g * p + j}", *path[2:])] = leaf[g]
  return traverse_util.unflatten_dict(out)


def scan_cache(cache):
  """A `KVCache` of per-layer tuples as one stacked [L, B, J, N, Dh] array per k and v."""
  return cache.replace(k=jnp.stack(cache.k), v=jnp.stack(cache.v))


def unscan_cache(cache):
  """A stacked `KVCache` as tuples of per-layer [B, J, N, Dh] arrays."""
  return cache.replace(k=tuple(cache.k), v=tuple(cache.v))


def layer_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The sharding of one layer's slice of a scanned parameter (its leading axis dropped)."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec)[1:]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
  return sharding
