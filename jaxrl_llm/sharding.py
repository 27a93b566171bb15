"""Device mesh from the config, logical-axis rules, and initialisation straight into shardings."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# `runs`: the runs of a pack (`run.pack`), each group of devices along it training its own
# runs; 1 for a single run, whose arrays never name it.
MESH_AXES = ("runs", "data", "fsdp", "expert", "model")
RUNS_AXIS = "runs"
PACK_AXIS = "pack"  # the vmap axis name of a pack's runs (for collectives across its runs)
# The mesh axes a batch's rows are split over. The expert axis is one of them: outside the
# experts each expert-parallel device works on its own rows (nothing is replicated over it).
BATCH_AXES = ("data", "fsdp", "expert")

# Logical parameter / activation axis -> mesh axis or axes (None = replicated).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
  ("batch", BATCH_AXES),
  ("activation_batch", BATCH_AXES),  # rows of the residual stream between blocks
  ("activation_length", None),
  ("activation_embed", None),
  ("vocab", "model"),
  ("heads", "model"),
  ("mlp", "model"),
  ("expert", "expert"),
  ("kv_heads", None),
  ("head_dim", None),
  # FSDP: weights split along d_model, gathered where a layer uses them; over the expert axis
  # too, except in the routed experts' weights, whose first dimension already takes it.
  ("embed", ("fsdp", "expert")),
  ("norm", None),  # RMSNorm scales (d_model): replicated
  ("layers", None),  # leading axis of scanned layer params (model.scan_layers): never split
  ("lora_rank", None),  # the rank r of a low-rank adapter (model.lora_rank): replicated
)

# The residual stream's logical axes: [B, T, D] rows over the batch axes, the rest whole.
ACTIVATION = ("activation_batch", "activation_length", "activation_embed")


def mesh_shape(
  num_devices: int,
  *,
  data: int = -1,
  fsdp: int = 1,
  expert: int = 1,
  model: int = 1,
  runs: int = 1,
) -> dict[str, int]:
  """The mesh's axis sizes: at most one of `data` / `fsdp` may be -1 (every device the other
  axes leave). Raises ValueError naming the fields when the sizes do not fit `num_devices`."""
  sizes = {"runs": runs, "data": data, "fsdp": fsdp, "expert": expert, "model": model}
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1 or (free and free[0] not in ("data", "fsdp")):
    raise ValueError(
      f"mesh sizes {sizes}: only one of mesh.data / mesh.fsdp may be -1 (all devices left)"
    )
  for name, size in sizes.items():
    if size < 1 and size != -1:
      raise ValueError(f"mesh.{name}={size} must be >= 1 (or -1 for mesh.data / mesh.fsdp)")
  fixed = int(np.prod([v for v in sizes.values() if v != -1]))
  if free:
    if num_devices % fixed:
      others = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items() if v != -1)
      raise ValueError(f"{others} = {fixed} does not divide the {num_devices} devices")
    sizes[free[0]] = num_devices // fixed
  total = int(np.prod(list(sizes.values())))
  if total > num_devices:
    raise ValueError(
      " x ".join(f"mesh.{k}={v}" for k, v in sizes.items())
      + f" = {total} devices, but {num_devices} are available; set mesh.data=-1 to use all"
    )
  return sizes


def make_mesh(
  data: int = -1,
  model: int = 1,
  devices: Sequence[jax.Device] | None = None,
  *,
  expert: int = 1,
  fsdp: int = 1,
  runs: int = 1,
) -> Mesh:
  """A ('runs', 'data', 'fsdp', 'expert', 'model') mesh (`jax.make_mesh`, which orders the devices by
  their physical layout). `devices` defaults to `jax.devices()`; pass a TPU topology's devices
  (`jax.experimental.topologies`) or fake CPU devices to compile for hardware not attached."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = mesh_shape(len(devices), data=data, fsdp=fsdp, expert=expert, model=model, runs=runs)
  n = int(np.prod(list(sizes.values())))
  if n < len(devices):
    logging.warning("mesh uses %d of the %d devices", n, len(devices))
  return jax.make_mesh(
    tuple(sizes[a] for a in MESH_AXES),
    MESH_AXES,
    axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
    devices=devices[:n],
  )


def batch_size_divisor(mesh: Mesh) -> int:
  """How many ways a batch's rows are split (data x fsdp x expert)."""
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def rows(mesh: Mesh) -> NamedSharding:
  """Leading (row) dimension over the batch axes, the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def without_axis(sharding: NamedSharding, axis: str) -> NamedSharding:
  """The same sharding with mesh axis `axis` dropped from every dimension (replicated there)."""

  def drop(entry):
    if entry is None or entry == axis:
      return None
    if isinstance(entry, tuple):
      kept = tuple(a for a in entry if a != axis)
      return kept if len(kept) > 1 else (kept[0] if kept else None)
    return entry

  return NamedSharding(sharding.mesh, PartitionSpec(*(drop(e) for e in sharding.spec)))


EXPERT_WEIGHTS = ("gate", "up", "down")  # a MoE layer's stacked expert weights (under `moe`)


def decode_shardings(param_shardings: Any) -> Any:
  """The layout the decode loop reads the weights in: FSDP gathered (replicated over `fsdp`
  and `expert`, which also splits d_model), tensor parallelism kept. Resharding to it once per RL step keeps every weight
  all-gather outside the decode `while_loop`. Routed experts' weights are the exception: they
  keep their stored layout (a whole bf16 copy of every expert on every device is what does
  not fit at MoE sizes), and each MoE layer gathers its experts' FSDP shards where it runs;
  `mesh.expert` splits them without any gather."""

  def layout(path, s):
    keys = [getattr(k, "key", None) for k in path]
    if len(keys) >= 2 and keys[-2] == "moe" and keys[-1] in EXPERT_WEIGHTS:
      return s
    return without_axis(without_axis(s, "fsdp"), "expert")

  return jax.tree_util.tree_map_with_path(layout, param_shardings)


# (mesh, rules) while a program is traced under `activation_rules`; None otherwise.
_ACTIVE: contextvars.ContextVar[tuple[Mesh, Any] | None] = contextvars.ContextVar(
  "jaxrl_llm_activation_rules", default=None
)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules):
  """While tracing inside it, `constrain` pins activations to `rules` on `mesh`."""
  token = _ACTIVE.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active_mesh() -> tuple[Mesh, tuple[str, ...]] | None:
  """(mesh, the mesh axes the residual stream's rows are split over) while tracing under
  `activation_rules`; None outside."""
  active = _ACTIVE.get()
  if active is None:
    return None
  mesh, rules = active
  spec = mesh_axes(("activation_batch",), rules)[0]
  axes = () if spec is None else ((spec,) if isinstance(spec, str) else tuple(spec))
  return mesh, axes


def active_platform() -> str | None:
  """The platform ('cpu', 'gpu', 'tpu') of the devices of the mesh under `activation_rules`:
  the one the program is compiled for, also for a TPU slice planned from a CPU machine; None
  outside them."""
  active = _ACTIVE.get()
  return None if active is None else active[0].devices.flat[0].platform


def logical_spec(logical_axes: tuple[str | None, ...]) -> PartitionSpec | None:
  """The mesh layout `logical_axes` map to under the active rules; None outside them."""
  active = _ACTIVE.get()
  return None if active is None else mesh_axes(logical_axes, active[1])


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
  """`x` constrained to the layout its logical axes map to under the active rules; unchanged
  outside `activation_rules` (e.g. a model applied on its own)."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  spec = mesh_axes(logical_axes, rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_rows(tree, axis: int = 0):
  """Every leaf's dimension `axis` (its rows) over the batch axes under the active rules, the
  rest replicated; leaves with no such dimension are left alone. Unchanged outside
  `activation_rules`."""

  def one(x):
    if x.ndim <= axis:
      return x
    names = [None] * x.ndim
    names[axis] = "batch"
    return constrain(x, tuple(names))

  return jax.tree.map(one, tree)


def traced_with_rules(fn: Callable, mesh: Mesh, rules) -> Callable:
  """`fn` whose tracing runs inside `activation_rules(mesh, rules)` (wrap before `jax.jit`)."""

  def wrapped(*args, **kwargs):
    with activation_rules(mesh, rules):
      return fn(*args, **kwargs)

  inner = fn.func if isinstance(fn, functools.partial) else fn
  wrapped.__name__ = wrapped.__qualname__ = getattr(inner, "__name__", "program")
  wrapped.__doc__ = inner.__doc__
  return wrapped


def _leaf_axes(axes: Any, tree: Any) -> list:
  """The vmap axis (0 or None) of each leaf of `tree`, from `axes` (a prefix of `tree`)."""
  out = []
  jax.tree.map(
    lambda ax, sub: out.extend([ax] * len(jax.tree.leaves(sub))),
    axes,
    tree,
    is_leaf=lambda a: a is None,
  )
  return out


def in_turn(at_once: int, groups: int) -> bool:
  """Whether a pack steps its runs one after another, each as the run alone (one device group,
  one run at a time: not vmapped, so nothing may name `PACK_AXIS`)."""
  return at_once == 1 and groups == 1


def vmap_runs(
  fn: Callable, in_axes: tuple, out_axes: Any = 0, *, at_once: int = 0, groups: int = 1,
  update_first: bool = False,
) -> Callable:  # fmt: skip
  """`fn` vmapped over a pack's runs axis (axis 0 of every leaf whose axis is 0; `PACK_AXIS`
  names it for collectives, the mesh's `RUNS_AXIS` spreads it over `groups` device groups).

  `at_once` > 0: each device group steps `at_once` of its runs at a time, vmapped, and the
  rest in turn in one loop: the activations of `at_once` runs per group instead of all of them,
  and a collective over `PACK_AXIS` spans one block. Run r of group g's block b is run
  g * R/groups + b * at_once + r (the groups' runs stay on their devices); one run at a time
  on one group (`in_turn`) calls `fn` itself on each run, not vmapped. `update_first`: the
  first argument and the first output have one structure and axes (a train state), and each
  block's output is written back in its place (updated in place, no second copy); leaves of
  axis None come out of the last block."""
  vmapped = jax.vmap(fn, in_axes, out_axes, axis_name=PACK_AXIS, spmd_axis_name=RUNS_AXIS)
  if not at_once:
    return vmapped

  def blocked(*args):
    flat, treedef = jax.tree.flatten(args)
    axes = _leaf_axes(tuple(in_axes), args)
    runs = next(x.shape[0] for x, ax in zip(flat, axes, strict=True) if ax == 0)
    blocks, alone = _RunBlocks(runs, groups, at_once), in_turn(at_once, groups)
    if blocks.count <= 1 and not alone:
      return vmapped(*args)
    split = [blocks.split(x) if ax == 0 else x for x, ax in zip(flat, axes, strict=True)]
    n_first = len(jax.tree.leaves(args[0])) if update_first else 0
    shapes = jax.eval_shape(lambda: vmapped(*jax.tree.unflatten(treedef, flat)))
    out_ax = _leaf_axes(out_axes, shapes)

    def call(leaves, b):
      block = [blocks.take(x, b) if ax == 0 else x for x, ax in zip(leaves, axes, strict=True)]
      if not alone:
        return jax.tree.leaves(vmapped(*jax.tree.unflatten(treedef, block)))
      one = [x[0] if ax == 0 else x for x, ax in zip(block, axes, strict=True)]  # not vmapped
      out = jax.tree.leaves(fn(*jax.tree.unflatten(treedef, one)))
      return [y[None] if ax == 0 else y for y, ax in zip(out, out_ax, strict=True)]

    bufs = [blocks.empty(s, ax) for s, ax in zip(jax.tree.leaves(shapes), out_ax, strict=True)]

    def body(b, carry):  # the updated first argument is carried; the others are read only
      out = call(carry[:n_first] + split[n_first:], b)
      return [blocks.put(x, y, b) if ax == 0 else y for x, y, ax in zip(
        carry, out, out_ax, strict=True)]  # fmt: skip

    out = jax.lax.fori_loop(0, blocks.count, body, split[:n_first] + bufs[n_first:])
    out = [blocks.join(x) if ax == 0 else x for x, ax in zip(out, out_ax, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(shapes), out)

  return blocked


@dataclasses.dataclass(frozen=True)
class _RunBlocks:
  """A pack's [R, ...] arrays as `groups` x (R / groups) runs, stepped `at_once` at a time.
  With several groups each is held as [groups, R / groups, ...] and a block is a slice of its
  second axis; with one, a slice of its first. (No unit axes: XLA then keeps the reshapes free
  and updates the donated state in place.)"""

  runs: int
  groups: int
  at_once: int

  def __post_init__(self):
    if self.runs % (self.groups * self.at_once):
      raise ValueError(
        f"mesh.runs_at_once={self.at_once} does not divide the {self.runs // self.groups} runs "
        f"of each of {self.groups} device groups; use a divisor, or 0 for all at once"
      )

  @property
  def count(self) -> int:
    """Blocks per group."""
    return self.runs // self.groups // self.at_once

  @property
  def _lead(self) -> tuple[int, ...]:
    return (self.groups, self.runs // self.groups) if self.groups > 1 else (self.runs,)

  def split(self, x):
    """[R, ...] -> the held layout."""
    return x.reshape(*self._lead, *x.shape[1:])

  def join(self, x):
    """The held layout -> [R, ...]."""
    return x.reshape(self.runs, *x.shape[len(self._lead) :])

  def take(self, x, b):
    """Block b of every group: [groups * at_once, ...]."""
    x = jax.lax.dynamic_slice_in_dim(x, b * self.at_once, self.at_once, len(self._lead) - 1)
    return x.reshape(self.groups * self.at_once, *x.shape[len(self._lead) :])

  def put(self, buf, y, b):
    """`buf` with block b of every group set to `y` ([groups * at_once, ...])."""
    y = y.reshape(self.groups, self.at_once, *y.shape[1:]) if self.groups > 1 else y
    return jax.lax.dynamic_update_slice_in_dim(buf, y, b * self.at_once, len(self._lead) - 1)

  def empty(self, s, ax):
    """A zero buffer for an output of shape `s` (one block's) and vmap axis `ax`, all runs."""
    return jnp.zeros((*self._lead, *s.shape[1:]) if ax == 0 else s.shape, s.dtype)


def rules_from_config(rules: Any) -> tuple[tuple[str, str | None], ...]:
  """Normalises a config's rule table ([[logical, mesh_axis_or_None], ...])."""
  if not rules:
    return DEFAULT_RULES
  shape = "a list of [logical_axis, mesh_axis | [mesh_axes] | None] pairs"
  if isinstance(rules, str) or not isinstance(rules, Sequence):
    raise ValueError(f"mesh.rules={rules!r} must be {shape}")
  out = []
  for item in rules:
    if isinstance(item, str) or not isinstance(item, Sequence) or len(item) != 2:
      raise ValueError(f"mesh.rules entry {item!r} must be a pair; mesh.rules is {shape}")
    logical, axis = item
    axes = (axis,) if axis is None or isinstance(axis, str) else tuple(axis)
    if any(a is not None and a not in MESH_AXES for a in axes):
      raise ValueError(
        f"mesh.rules maps {logical!r} to unknown mesh axis {axis!r}; allowed: {MESH_AXES}, "
        "a list of them, or None"
      )
    out.append((str(logical), axis if axis is None or isinstance(axis, str) else axes))
  return tuple(out)


def mesh_axes(logical_axes: Sequence[str | None], rules) -> PartitionSpec:
  """The PartitionSpec of logical axis names under `rules`. A mesh axis serves one dimension
  only: where a rule names mesh axes an earlier dimension already uses, those are left out and
  the rest kept (Flax's own resolution drops the whole entry)."""
  table: dict[str, Any] = {}
  for logical, axes in rules:
    table.setdefault(logical, axes)  # the first rule for a name wins
  used: set[str] = set()
  spec = []
  for name in logical_axes:
    axes = table.get(name) if name is not None else None
    axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    kept = tuple(a for a in axes if a not in used)
    used.update(kept)
    spec.append(None if not kept else (kept[0] if len(kept) == 1 else kept))
  return PartitionSpec(*spec)


def mesh_shardings(logical_specs: Any, mesh: Mesh, rules) -> Any:
  """NamedShardings of a tree of logical PartitionSpecs (`nn.get_partition_spec`)."""
  return jax.tree.map(
    lambda p: NamedSharding(mesh, mesh_axes(tuple(p), rules)),
    logical_specs,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def logical_sharding(mesh: Mesh, rules, *logical_axes: str | None) -> NamedSharding:
  """NamedSharding for an array whose dimensions carry the given logical names."""
  return NamedSharding(mesh, mesh_axes(logical_axes, rules))


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
  shardings = mesh_shardings(specs, mesh, rules)
  params = jax.jit(lambda r: nn.unbox(boxed_init(r)), out_shardings=shardings)(rng)
  return params, shardings


def param_shardings(boxed_abstract: Any, mesh: Mesh, rules) -> Any:
  """Shardings for an abstract boxed parameter tree (from `jax.eval_shape`)."""
  return mesh_shardings(nn.get_partition_spec(boxed_abstract), mesh, rules)


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
