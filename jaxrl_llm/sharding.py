"""Device mesh from the config, logical-axis rules, and initialisation straight into shardings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "model")

# Logical parameter / activation axis -> mesh axis (None = replicated).
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
  ("batch", "data"),
  ("vocab", "model"),
  ("heads", "model"),
  ("mlp", "model"),
  ("expert", "expert"),
  ("kv_heads", None),
  ("head_dim", None),
  ("embed", None),
  ("layers", None),  # leading axis of scanned layer params (model.scan_layers): never split
)


def make_mesh(
  data: int = -1,
  model: int = 1,
  devices: Sequence[jax.Device] | None = None,
  *,
  expert: int = 1,
) -> Mesh:
  """A ('data', 'expert', 'model') mesh; `data=-1` takes every device the others leave."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  for name, size in (("model", model), ("expert", expert)):
    if size < 1:
      raise ValueError(f"mesh.{name}={size} must be >= 1")
  inner = model * expert
  if data == -1:
    if n % inner:
      raise ValueError(f"mesh.expert x mesh.model = {inner} does not divide the {n} devices")
    data = n // inner
  if data < 1 or data * inner > n:
    raise ValueError(
      f"mesh.data={data} x mesh.expert={expert} x mesh.model={model} = {data * inner} devices, "
      f"but {n} are available; set mesh.data=-1 to use all of them"
    )
  if data * inner < n:
    logging.warning("mesh uses %d of the %d devices", data * inner, n)
  grid = np.asarray(devices[: data * inner]).reshape(data, expert, model)
  return Mesh(grid, MESH_AXES)


def rules_from_config(rules: Any) -> tuple[tuple[str, str | None], ...]:
  """Normalises a config's rule table ([[logical, mesh_axis_or_None], ...])."""
  if not rules:
    return DEFAULT_RULES
  out = []
  for item in rules:
    logical, axis = item
    if axis is not None and axis not in MESH_AXES:
      raise ValueError(
        f"mesh.rules maps {logical!r} to unknown mesh axis {axis!r}; allowed: {MESH_AXES} or None"
      )
    out.append((str(logical), axis))
  return tuple(out)


def logical_sharding(mesh: Mesh, rules, *logical_axes: str | None) -> NamedSharding:
  """NamedSharding for an array whose dimensions carry the given logical names."""
  spec = nn.logical_to_mesh_axes(logical_axes, rules)
  return NamedSharding(mesh, spec)


def replicated(mesh: Mesh) -> NamedSharding:
  """A fully replicated sharding on `mesh`."""
  return NamedSharding(mesh, PartitionSpec())


def init_sharded(boxed_init: Callable[[jax.Array], Any], rng: jax.Array, mesh: Mesh, rules):
  """Initialises logically-annotated params directly into their shardings.

  `boxed_init(rng)` returns a tree with `nn.LogicallyPartitioned` leaves (a Linen
  `init(...)["params"]`). Returns (params, shardings) with plain-array leaves; the full model
  is never materialised on a single device.
  """
  abstract = jax.eval_shape(boxed_init, rng)
  specs = nn.get_partition_spec(abstract)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  params = jax.jit(lambda r: nn.unbox(boxed_init(r)), out_shardings=shardings)(rng)
  return params, shardings


def param_shardings(boxed_abstract: Any, mesh: Mesh, rules) -> Any:
  """Shardings for an abstract boxed parameter tree (from `jax.eval_shape`)."""
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_abstract), mesh, rules)


def opt_state_shardings(tx, params: Any, param_shardings: Any, mesh: Mesh):
  """(abstract optax state, its shardings): placed like the params it mirrors; counters and
  scalars replicated. `params` may be arrays or ShapeDtypeStructs."""
  abstract = jax.eval_shape(tx.init, params)
  shardings = optax.tree_map_params(
    tx,
    lambda _, s: s,
    abstract,
    param_shardings,
    transform_non_params=lambda _: replicated(mesh),
  )
  return abstract, shardings


def init_opt_state(tx, params: Any, param_shardings: Any, mesh: Mesh):
  """optax state placed like the params it mirrors (`opt_state_shardings`)."""
  _, shardings = opt_state_shardings(tx, params, param_shardings, mesh)
  return jax.jit(tx.init, out_shardings=shardings)(params)
