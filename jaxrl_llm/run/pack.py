"""A pack: the runs of a sweep trained together as one program.

The runs of a clip x temperature x seed grid differ only in values, not in the program's
shapes, so one jitted step serves them all: the train state gains a leading runs axis
(parameters, optimiser state, PRNG keys; under adapters the frozen base has none: one copy
serves every run, `rl.step.run_axes`), the step is vmapped over it, and each field the grid
varies enters the step as a traced per-run value (`Learner.with_values`) instead of a
compile-time constant. Runs on prompt files sample in one program, are verified on the host
run by run, and learn in one program. `packable_fields` names those fields (declared beside each field); a grid over any other field (objective
name, model shape, group size, ...) changes the program and is refused with one line.

Each run stays a run for the user: its own TensorBoard folder `ROOT/<name>` (config.json,
config Text, HParams with the varied fields), its own progress line and evaluations. The pack
checkpoints as a whole in `ROOT/checkpoints` (every run's state and data position) and resumes
from there; `take_out` writes one run's state as a workdir of its own, to continue alone.

On several processes (`tools/sweep.py --packed --distributed`) each process feeds the block of
the pack's prompts its devices hold (`pack_iterator`): with `mesh.runs=1` every run and its own
block of each run's rows, as a single run's processes do; with the runs axis over the
processes, only its device groups' runs, each whole where a group lies within one process.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import distributed, sharding
from jaxrl_llm.config import (
  PER_RUN,
  SWITCH,
  TRACED,
  Config,
  ConfigError,
  tagged,
  traced_dtype,
  typed,
)
from jaxrl_llm.data.pipeline import PROMPT_KEYS
from jaxrl_llm.models import lora
from jaxrl_llm.rl.step import over_runs, packed_sharding, shared_leaf
from jaxrl_llm.run import record
from jaxrl_llm.run.assemble import Experiment, build, device_columns, fresh_run_state
from jaxrl_llm.run.loop import train_iterator
from jaxrl_llm.types import PromptBatch, TrainState


def packable_fields() -> tuple[str, ...]:
  """Every field a pack may vary, as declared beside each field (`config.PER_RUN`): the seed,
  sampling, optimiser and regulariser values, and every registered objective's plain-float
  hyperparameters."""
  return tagged(PER_RUN)


def varied_fields(configs: Sequence[Config]) -> tuple[str, ...]:
  """The fields whose values differ between `configs`, in the config's order."""
  flats = [c.flat() for c in configs]
  return tuple(k for k in flats[0] if any(f.get(k) != flats[0][k] for f in flats[1:]))


def check_packable(configs: Sequence[Config]) -> tuple[str, ...]:
  """The varied fields of `configs`; raises ConfigError (one line) if one is not packable."""
  varied = varied_fields(configs)
  allowed = packable_fields()
  bad = [f for f in varied if f not in allowed]
  if bad:
    raise ConfigError(
      f"a pack cannot vary {', '.join(bad)}: it changes the program; run those as separate "
      f"sweeps or packs (packable fields: {', '.join(allowed)})"
    )
  for field in tagged(SWITCH):
    on = {c.value(field) > 0 for c in configs}
    if field in varied and len(on) > 1:
      raise ConfigError(
        f"a pack's runs must all have {field} > 0 or all {field} = 0 (it switches a term on); "
        "run the two kinds as separate packs"
      )
  return varied


def run_values(configs: Sequence[Config], varied: Sequence[str]) -> dict[str, np.ndarray]:
  """{field: [R] array} of every varied field the step reads (`config.TRACED`: all but the
  seed), on the host (the same on every process, so any process may place it)."""
  out, traced = {}, tagged(PER_RUN, TRACED)
  for field in varied:
    if field not in traced:
      continue
    vals = [c.value(field) for c in configs]
    out[field] = np.asarray(vals, traced_dtype(vals))
  return out


def run_name(cfg: Config, varied: Sequence[str]) -> str:
  """A run's folder name: `field=value,...` over the varied fields (`record.folder_name`)."""
  return record.folder_name({f: cfg.value(f) for f in varied})


@dataclasses.dataclass
class Pack:
  """The runs of a pack and the programs and initial state they share."""

  exp: Experiment  # the programs (vmapped) and the first run's pieces
  configs: list[Config]  # one per run
  names: list[str]  # each run's folder name under the pack's root
  varied: tuple[str, ...]  # the fields that differ between runs
  values: dict[str, jax.Array]  # [R] per-run value of each varied field but seed
  state: Any  # the runs' fresh states stacked on a leading axis

  def stacked(self, states: Sequence[Any]) -> Any:
    """The runs' states (no reference copy yet) stacked into the pack's state shardings."""
    return stack(states, over_runs(self.exp.state_shardings, packed_sharding))

  @property
  def size(self) -> int:
    """How many runs the pack holds."""
    return len(self.configs)

  def run(self, r: int) -> Experiment:
    """Run `r` as an `Experiment` view: its config; the pack's task, mesh and programs."""
    return dataclasses.replace(self.exp, config=self.configs[r])

  def meta(self) -> dict:
    """What the pack's checkpoints record: the first run's meta and every run's values."""
    runs = [{f: c.value(f) for f in self.varied} for c in self.configs]
    return {**self.exp.meta, "pack": {"names": self.names, "runs": runs}}


def build_pack(
  configs: Sequence[Config], names: Sequence[str] | None = None, *, devices=None
) -> Pack:
  """Builds a pack from the configs of its runs (their `Config`s)."""
  configs = [typed(c, "build_pack") for c in configs]
  if not configs:
    raise ConfigError("a pack needs at least one run")
  varied = check_packable(configs)
  seeds = sorted({c.seed for c in configs})
  if configs[0].model.arch.lora_rank and not configs[0].model.checkpoint and len(seeds) > 1:
    raise ConfigError(
      f"the runs of a pack with adapters share one frozen base, but without model.checkpoint "
      f"each seed initialises its own (seeds {seeds}): start them from a checkpoint, or pack "
      "each seed's runs apart"
    )
  traced = list(run_values(configs, varied))  # the per-run values the programs take
  exp = build(configs[0], devices=devices, runs=len(configs), varied=traced)
  groups = exp.mesh.shape[sharding.RUNS_AXIS]
  if len(configs) % groups:
    raise ConfigError(
      f"mesh.runs={groups} does not divide the pack's {len(configs)} runs; use a divisor of "
      f"{len(configs)} (each device group trains runs / mesh.runs of them)"
    )
  at_once = configs[0].mesh.runs_at_once
  if at_once and (len(configs) // groups) % at_once:
    raise ConfigError(
      f"mesh.runs_at_once={at_once} does not divide the {len(configs) // groups} runs of each "
      f"device group (a pack of {len(configs)} runs over mesh.runs={groups}); use a divisor "
      "of it, or 0 for all at once"
    )
  names = list(names) if names is not None else [run_name(c, varied) for c in configs]
  if len(set(names)) != len(names):
    raise ConfigError(f"the runs of a pack need distinct names, got {names}")
  values = jax.device_put(run_values(configs, varied), per_run_sharding(exp.mesh))
  pack = Pack(exp, configs, names, varied, values, None)
  pack.state = pack.stacked([exp.state] + [fresh_run_state(exp, c) for c in configs[1:]])
  return pack


def per_run_sharding(mesh) -> NamedSharding:
  """A pack's [R, ...] array with each run's slice whole on its device group."""
  return packed_sharding(NamedSharding(mesh, PartitionSpec()))


def _stack(trees: Sequence[Any]) -> Any:
  if not isinstance(trees[0], TrainState):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  adapters = lora.has_adapters(trees[0].params)
  return jax.tree_util.tree_map_with_path(
    lambda path, *xs: xs[0] if shared_leaf(path, adapters) else jnp.stack(xs), *trees
  )


def _unstack(tree: Any, r) -> Any:
  if isinstance(tree, TrainState):
    return over_runs(tree, lambda x: x[r])
  return jax.tree.map(lambda x: x[r], tree)


# Both run as one program over the whole tree, not one small program per leaf: on XLA:CPU a
# burst of hundreds of multi-device programs can fill a device's queue of launches while an
# earlier program's collective waits for that device, and the process stalls for good.
def stack(trees: Sequence[Any], shardings: Any = None) -> Any:
  """The trees stacked on a new leading axis (None leaves stay None), placed in `shardings`
  (None: where the compiler puts them); of TrainStates under adapters, the frozen base the
  runs share is the first's, unstacked."""
  return jax.jit(_stack, out_shardings=shardings)(list(trees))


def unstack(tree: Any, r: int, shardings: Any = None) -> Any:
  """Run `r`'s slice of a stacked tree (of a TrainState, the shared base as it is), placed in
  `shardings` (None: where the compiler puts it); one program whatever `r`."""
  return jax.jit(_unstack, out_shardings=shardings)(tree, np.int32(r))


def _put(tree: TrainState, own: TrainState, r) -> TrainState:
  adapters = lora.has_adapters(tree.params)

  def put(path, x, o):
    if path[0].name in ("step", "rng") or shared_leaf(path, adapters):
      return x  # the pack's step counts on; the shared base is not a run's
    return x.at[r].set(o)

  return jax.tree_util.tree_map_with_path(put, tree, own)


def put_run(tree: TrainState, own: TrainState, r: int) -> TrainState:
  """The stacked state `tree` with run `r`'s parameters and optimiser state (and reference
  copy) set to `own` (`unstack`'s slice): a stopped run kept as it stopped; one program,
  `tree`'s buffers donated and its shardings kept."""
  shardings = jax.tree.map(lambda x: x.sharding, tree)
  return jax.jit(_put, out_shardings=shardings, donate_argnums=0)(tree, own, np.int32(r))


class PackIterator:
  """The prompt iterators of a pack's runs (this process's, `pack_iterator`) as one: `next`
  stacks one batch of each on a leading axis; its state (saved by grain's checkpoint handler
  with the pack, per process) is each of those runs' position."""

  def __init__(self, iterators: Sequence[Any]):
    self.iterators = list(iterators)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batches = [next(it) for it in self.iterators]
    return {k: np.stack([np.asarray(b[k]) for b in batches]) for k in batches[0]}

  def get_state(self) -> bytes:
    """Every run's iterator state, as JSON bytes."""
    states = [_iterator_state(it) for it in self.iterators]
    return json.dumps(states).encode()

  def set_state(self, state: bytes) -> None:
    """Sets every run's iterator to its saved position."""
    states = json.loads(state)
    if len(states) != len(self.iterators):
      raise ConfigError(
        f"the checkpoint holds the data positions of {len(states)} runs for this process; it "
        f"feeds {len(self.iterators)}: resume with the same grid, processes and mesh.runs, or "
        "use a new root"
      )
    for it, s in zip(self.iterators, states, strict=True):
      it.set_state(s if isinstance(it, grain.DatasetIterator) else s.encode())

  def start_prefetch(self) -> None:
    """Starts each iterator's prefetch (grain calls this after a restore)."""
    for it in self.iterators:
      if hasattr(it, "start_prefetch"):
        it.start_prefetch()


def pack_iterator(pack: Pack) -> PackIterator:
  """This process's share of the pack's prompts: the runs whose rows its devices hold (every
  run unless the runs axis spans processes), and of each the block of rows they hold."""
  prompts = pack.configs[0].sampled_prompts
  shard = distributed.shard_of(pack_rows(pack.exp.mesh), (pack.size, prompts), 1)
  return PackIterator([train_iterator(pack.run(r), shard) for r in own_runs(pack)])


def own_runs(pack: Pack) -> range:
  """The runs whose rows this process's devices hold (all of them unless the runs axis spans
  processes)."""
  mesh = pack.exp.mesh
  span = distributed.own_block(pack_rows(mesh), (pack.size, sharding.batch_size_divisor(mesh)))[0]
  return range(span.start, span.stop)


def _iterator_state(it: Any) -> Any:
  state = it.get_state()
  return state.decode() if isinstance(state, bytes) else state


@jax.jit
def packed_keys(keys: jax.Array, step) -> jax.Array:
  """Each run's key of RL step `step`: `fold_in(run key, step)`, as a single run draws it."""
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)


def batch_to_device(np_batch: Mapping[str, np.ndarray], mesh) -> PromptBatch:
  """A stacked host batch [R, P, ...] of this process's prompts of every run -> the pack's
  `PromptBatch`: runs over the mesh's runs axis, each run's rows over its batch axes, the
  processes' rows side by side (string answers stay on the host)."""
  columns = device_columns(np_batch)
  return PromptBatch(**{k: to_rows(columns[k], mesh) for k in PROMPT_KEYS})


def pack_rows(mesh) -> NamedSharding:
  """A pack's [R, B, ...] rows: runs over the runs axis, each run's rows as a run's batch."""
  return packed_sharding(sharding.rows(mesh))


def to_rows(local: np.ndarray, mesh) -> jax.Array:
  """This process's block [R_local, B_local, ...] of the pack's rows (`pack_iterator`) -> the
  pack's global [R, B, ...] array (`jax.make_array_from_process_local_data`)."""
  return jax.make_array_from_process_local_data(pack_rows(mesh), np.asarray(local))
