"""Memory plans compiled ahead of time: will this run fit, before anything is allocated?

The whole fused step (for host verifiers, the sample and learn programs around them) is built
from abstract state (`run.build(config, abstract=True)`), lowered and compiled for a set of
devices (this machine's, fake CPU devices, or a TPU slice's from `jax.experimental.topologies`),
and its `memory_analysis()` gives the bytes per device.
Nothing is initialised, loaded or placed. Used by `--dry_run` and `tools/memory_table.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxrl_llm import sigterm

GIB = 2**30

# HBM per chip of TPU generations, by `device_kind` substring (lower case, specific first):
# public spec sheets. Devices that report `memory_stats()` (GPUs) use their own limit.
TPU_HBM_BYTES: tuple[tuple[str, int], ...] = (
  ("v5 lite", 16 * GIB),  # v5e
  ("v5e", 16 * GIB),
  ("v6 lite", 32 * GIB),  # v6e (Trillium)
  ("v6e", 32 * GIB),
  ("v5p", 95 * GIB),
  ("v5", 95 * GIB),  # v5p reports "TPU v5"
  ("v4", 32 * GIB),
)

# Slice names users rent -> (topology name for `get_topology_desc`, chips).
TPU_SLICES: dict[str, tuple[str, int]] = {
  "v5e-4": ("v5e:2x2", 4),
  "v5e-8": ("v5e:2x4", 8),
  "v5e-64": ("v5e:8x8", 64),
  "v5p-8": ("v5p:2x2x1", 4),  # 8 TensorCores = 4 chips (megacore)
  "v6e-4": ("v6e:2x2", 4),
  "v6e-8": ("v6e:2x4", 8),
}


def tpu_slice_devices(name: str) -> list[jax.Device]:
  """The devices of TPU slice `name` (e.g. "v5e-8", or a topology like "v5e:2x2") to compile
  for on any machine. Needs libtpu (`pip install -e '.[tpu]'`); raises RuntimeError if absent."""
  from jax.experimental import topologies

  topology = TPU_SLICES.get(name, (name, 0))[0]
  try:
    import libtpu  # noqa: F401
  except ImportError as err:
    raise RuntimeError(
      f"compiling for TPU slice {name!r} needs libtpu: pip install -e '.[tpu]'"
    ) from err
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server off a TPU VM
  return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def device_capacity(device: jax.Device) -> int | None:
  """Memory one device can hold, in bytes: its own `memory_stats()` limit where it reports one
  (GPUs), the spec sheet's HBM for TPUs, the host's physical memory for a CPU; None if unknown."""
  if device.platform == "cpu":
    try:
      return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
  try:
    stats = device.memory_stats()
  except Exception:  # topology devices have no runtime behind them
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  kind = device.device_kind.lower()
  return next((b for k, b in TPU_HBM_BYTES if k in kind), None)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Compile-only bytes per device of the fused step, and what the devices can hold."""

  argument_bytes: int  # state + batch resident before the step
  output_bytes: int
  alias_bytes: int  # outputs written into donated arguments
  temp_bytes: int  # XLA's scratch: activations, KV cache, gradients, gathered weights
  capacity_bytes: int | None  # per device; None when unknown (CPU)
  device_kind: str
  num_devices: int
  mesh: dict[str, int]
  compile_s: float
  refused: str = ""  # the compiler's out-of-memory message when it refused the program (TPU)
  runs: int = 0  # runs of a pack (0: a single run)
  host_rewards: bool = False  # two programs (sample, learn) around host verifiers; the larger
  program: str = ""  # what was planned when not the RL step (the held-out evaluation)
  resident_bytes: int = 0  # held beside the program's arguments (the train state's other parts)
  evaluation: MemoryPlan | None = None  # the held-out evaluation's plan (`plan(evaluation=...)`)

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs not aliased to them + temp (+ what stays resident beside them): the
    program's peak per device."""
    out = _peak_of(self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes)
    return out + self.resident_bytes

  @property
  def fits(self) -> bool | None:
    """Whether the peak is within the capacity (None when the capacity is unknown)."""
    if self.refused:
      return False
    return None if self.capacity_bytes is None else self.peak_bytes <= self.capacity_bytes

  def summary(self) -> str:
    """One line: the peak against the capacity, and the verdict."""
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "one device"
    rest = f" + the rest of the state {human_bytes(self.resident_bytes)}" * bool(
      self.resident_bytes
    )
    need = (
      f"{human_bytes(self.peak_bytes)} per device (arguments "
      f"{human_bytes(self.argument_bytes)} + temp {human_bytes(self.temp_bytes)}{rest}) on "
      f"{self.num_devices} x {self.device_kind} ({mesh})"
    )
    step = f"the packed step of {self.runs} runs" if self.runs else "the fused step"
    if self.program:
      step = self.program
    elif self.host_rewards:  # the verifiers run on the host between two programs
      step = "the larger of the sample and learn programs" + (
        f" of a pack of {self.runs} runs" if self.runs else ""
      )
    if self.capacity_bytes is None:
      return f"{step} needs {need}; the device reports no memory limit"
    if self.refused:
      return f"{step} needs {need}: does NOT fit (the compiler: {self.refused})"
    verdict = "fits in" if self.fits else "does NOT fit in"
    return f"{step} needs {need}: {verdict} {human_bytes(self.capacity_bytes)} per device"


def print_dry_run(memory: MemoryPlan) -> int:
  """Prints a `--dry_run`'s lines (the step's plan, then its evaluation's) on stdout; returns
  its exit status: 3 when one does not fit, else 0."""
  plans = [memory, *([memory.evaluation] if memory.evaluation else [])]
  for p in plans:
    print(f"dry run: {p.summary()}", flush=True)
  return 3 if any(p.fits is False for p in plans) else 0


def human_bytes(n: float) -> str:
  """`n` bytes in GiB (MiB below 1 GiB), one decimal."""
  return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def plan(
  config,
  devices: list[jax.Device] | None = None,
  *,
  prompt_len: int | None = None,
  capacity_bytes: int | None = None,
  runs: int = 0,
  varied: Sequence[str] | None = None,
  evaluation: bool = False,
) -> MemoryPlan:
  """Builds `config` (a `config.Config`) abstractly on `devices` (default: this machine's)
  and compiles the fused step; `prompt_len` sizes prompts other than the task's, `capacity_bytes` overrides the
  device's own capacity (e.g. to plan a GPU run on a CPU machine). `runs` > 0 plans a pack
  of that many runs (`run.pack`) varying the fields `varied` (default: `_pack_args`).
  `evaluation`: also plan the held-out evaluation's program (the plan's `evaluation`)."""
  from jaxrl_llm import run  # the run imports this module's callers, not the reverse

  devices = list(devices if devices is not None else jax.devices())
  exp = run.build(config, abstract=True, devices=devices, prompt_len=prompt_len, runs=runs)
  repl = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
  args = (exp.state, run.abstract_batch(exp), jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl))
  if runs:
    args = _pack_args(exp, args, runs, varied)
  common = {
    "capacity_bytes": capacity_bytes if capacity_bytes is not None else device_capacity(devices[0]),
    "device_kind": devices[0].device_kind,
    "num_devices": exp.mesh.size,
    "mesh": dict(exp.mesh.shape),
    "runs": runs,
  }
  host = exp.task.rewards_on_host

  def step():
    if host:  # sample -> host verifiers -> learn: the larger peak
      return max(_sample_and_learn(exp, args), key=lambda c: _peak_of(**_sizes(c)))
    return exp.program.step.lower(*args).compile()

  memory = _planned(step, args, common, "the RL step", host_rewards=host)
  if evaluation:
    memory = dataclasses.replace(memory, evaluation=_evaluation(exp, args, common))
  return memory


def _planned(compile_program, args, common: dict, what: str, **fields) -> MemoryPlan:
  """The plan of the program `compile_program()` compiles (`what`, for a stop during it) from
  the abstract `args`; a TPU compiler's refusal (out of HBM) is a plan that does not fit."""
  t0 = time.perf_counter()
  try:
    with sigterm.compiling(f"{what} (a plan: nothing is written)"):
      compiled = compile_program()
  except jax.errors.JaxRuntimeError as err:  # TPU compilers refuse what exceeds the HBM
    message = str(err)
    if "RESOURCE_EXHAUSTED" not in message:
      raise
    held = shard_bytes(args)
    temp = re.search(r"temporaries \(([\d.]+)G\)", message)
    return MemoryPlan(
      argument_bytes=held,
      output_bytes=held,
      alias_bytes=held,
      temp_bytes=int(float(temp.group(1)) * GIB) if temp else 0,
      compile_s=time.perf_counter() - t0,
      refused=message.split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0],
      **fields,
      **common,
    )
  return MemoryPlan(compile_s=time.perf_counter() - t0, **_sizes(compiled), **common, **fields)


def _evaluation(exp, args: tuple, common: dict) -> MemoryPlan:
  """The held-out evaluation's plan: its device program (greedy and pass@k sampling of the
  task's held-out prompts) on the state's parameters, the rest of the train state resident
  beside it (as in a run, between two steps)."""
  from jaxrl_llm import sharding
  from jaxrl_llm.data import pipeline
  from jaxrl_llm.run.assemble import device_columns

  rows, _ = exp.task.eval_set(multiple_of=sharding.batch_size_divisor(exp.mesh))
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=exp.batch_sharding),
    pipeline.to_prompt_batch(device_columns(rows)),
  )
  state, _, key, *values = args
  n, k = len(rows["tokens"]), max(exp.config.train.pass_k, 1)
  runs = f" of {common['runs']} runs" if common["runs"] else ""
  what = f"the held-out evaluation{runs} ({n} prompts: greedy, and {k} sample{'s' * (k > 1)} each)"
  return _planned(
    lambda: exp.eval_fn.lower(state.params, batch, key, *values).compile(),
    (state.params, batch),
    common,
    what,
    program=what,
    resident_bytes=shard_bytes(state) - shard_bytes(state.params),
  )


def _sample_and_learn(exp, args: tuple) -> tuple:
  """The compiled sample and learn programs of a task whose verifiers run on the host, the
  learner's arguments those the sampler returns, with the task's reward terms per row."""
  state, _, key, *values = args
  sample = exp.program.sample.lower(*args).compile()
  rollout = jax.tree.map(_abstract, sample.out_info)
  rows = rollout.lengths  # [B], or [R, B] in a pack: one float32 per row and term
  terms = {k: _abstract(rows, jnp.float32) for k in exp.task.host_term_names}
  return sample, exp.program.learn.lower(state, rollout, terms, key, *values).compile()


def _abstract(x, dtype=None) -> jax.ShapeDtypeStruct:
  """`x`'s shape and sharding (and dtype, unless given) without its layout."""
  return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=x.sharding)


def _sizes(compiled) -> dict[str, int]:
  """A compiled program's memory analysis as `MemoryPlan`'s byte fields."""
  m = compiled.memory_analysis()
  return {
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
  }


def _peak_of(argument_bytes: int, output_bytes: int, alias_bytes: int, temp_bytes: int) -> int:
  """Arguments + outputs not aliased to them + temp: a program's peak bytes per device."""
  return argument_bytes + output_bytes - alias_bytes + temp_bytes


def _pack_args(exp, args: tuple, runs: int, varied: Sequence[str] | None) -> tuple:
  """The packed step's abstract arguments: `args` (state, batch, key) of `runs` runs, and the
  per-run values of `varied` (default: every traced field this run's step reads that is not
  0: a traced 0 would switch its term on)."""
  from jaxrl_llm.config import traced_dtype
  from jaxrl_llm.rl.step import over_runs

  if varied is None:
    varied = list(exp.config.step_values())
  repl = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
  values = {
    f: jax.ShapeDtypeStruct((), traced_dtype(exp.config.value(f)), sharding=repl) for f in varied
  }
  stacked = functools.partial(_packed, runs)
  state = over_runs(args[0], stacked)  # under adapters, one base for every run
  return (state, *jax.tree.map(stacked, (*args[1:], values)))


def _packed(runs: int, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  """A pack's abstract argument: `runs` of `x` on a leading axis over the mesh's runs axis."""
  from jaxrl_llm.rl.step import packed_sharding

  return jax.ShapeDtypeStruct((runs, *x.shape), x.dtype, sharding=packed_sharding(x.sharding))


def shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its largest shard each)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += math.prod(shape) * jax.numpy.dtype(x.dtype).itemsize
  return total


AUTO_MARGIN = 0.10  # rl.microbatch_tokens=auto leaves this share of the device's memory free
AUTO_MAX_SLICES = 4  # remat=auto recomputes more only when less needs more slices than this
AUTO_REMATS = ("none", "attention", "full")  # remat=auto's policies, least recomputation first


def auto_learner(
  config,
  rows_per_device: int,
  devices: list[jax.Device] | None = None,
  *,
  capacity_bytes: int | None = None,
  **plan_kw,
) -> tuple[int, str, list[dict]]:
  """`rl.microbatch_tokens=auto`: (microbatches, remat, the plans compiled) for `config`
  (`plan_kw`: prompt_len, and a pack's runs and varied fields, as `plan` takes them).

  The fewest microbatches k (a divisor of a device's minibatch rows) whose compile-only plan
  (`plan`) peaks within (1 - AUTO_MARGIN) of the device's memory: one plan where the whole
  minibatch fits; else the k that plan's temp predicts (split k ways), checked, then bisection
  (the peak falls as k grows). With `rl.remat=auto` the policies are tried least recomputation
  first (AUTO_REMATS) and the first one that fits in at most AUTO_MAX_SLICES slices is taken
  (else the last's fewest slices that fit). A ConfigError says what was tried when nothing fits."""
  from jaxrl_llm.config import ConfigError

  devices = list(devices if devices is not None else jax.devices())
  capacity = capacity_bytes if capacity_bytes is not None else device_capacity(devices[0])
  if capacity is None:
    raise ConfigError(
      f"rl.microbatch_tokens=auto needs the device's memory; {devices[0].device_kind} reports "
      "none: set a number of tokens"
    )
  budget = (1 - AUTO_MARGIN) * capacity
  divisors = [d for d in range(1, rows_per_device + 1) if rows_per_device % d == 0]
  remats = AUTO_REMATS if config.rl.remat == "auto" else (config.rl.remat,)
  tried: list[dict] = []

  def fits(k: int, remat: str) -> bool:
    rl = dataclasses.replace(config.rl, num_microbatches=k, remat=remat)
    p = plan(dataclasses.replace(config, rl=rl), devices, capacity_bytes=capacity, **plan_kw)
    ok = not p.refused and p.peak_bytes <= budget
    temp = None if p.refused else p.temp_bytes
    tried.append({"microbatches": k, "remat": remat, "peak_bytes": p.peak_bytes, "fits": ok})
    tried[-1]["temp_bytes"] = temp
    return ok

  guess = lambda: _predicted(tried[-1], budget, divisors)  # noqa: E731  (after the first plan)
  fallback = None
  for remat in remats:
    k = _fewest(divisors, lambda k, remat=remat: fits(k, remat), guess)
    if k is not None and k <= AUTO_MAX_SLICES:
      return k, remat, tried
    fallback = fallback or (k and (k, remat))
  if fallback:
    return (*fallback, tried)
  smallest = min(t["peak_bytes"] for t in tried)
  raise ConfigError(
    f"rl.microbatch_tokens=auto: no microbatching fits {human_bytes(budget)} per device "
    f"({100 * (1 - AUTO_MARGIN):.0f}% of {human_bytes(capacity)}); the smallest plan needs "
    f"{human_bytes(smallest)} (remat {', '.join(remats)}, up to {divisors[-1]} slices)"
  )


def _predicted(one: dict, budget: float, divisors: list[int]) -> int | None:
  """The slices a one-slice plan (`one`, a `tried` entry) predicts: the fewest of `divisors`
  whose share of its temp fits `budget` beside the rest of its peak (None: it was refused)."""
  if not one["temp_bytes"]:
    return None
  room = budget - (one["peak_bytes"] - one["temp_bytes"])
  return next((d for d in divisors if room > 0 and one["temp_bytes"] / d <= room), divisors[-1])


def _fewest(divisors: list[int], fits, guess=lambda: None) -> int | None:
  """The smallest of the ascending `divisors` that `fits` (None when the largest does not),
  with few plans: the smallest first, where a large device holds the whole minibatch in one
  plan; then `guess()`'s divisor (predicted from that plan) and its neighbour below (it fits
  and that does not: found in two plans) or above; then bisection between what failed and
  what fits, the largest checked first (what fits at k fits at every larger k)."""
  if fits(divisors[0]):
    return divisors[0]
  lo, hi, last = 1, None, len(divisors) - 1  # divisors[lo - 1] does not fit; divisors[hi] fits
  g = guess()
  if g in divisors[lo:]:
    i = divisors.index(g)
    if fits(g):
      if i == lo or not fits(divisors[i - 1]):
        return g
      hi = i - 1
    else:
      if i < last and fits(divisors[i + 1]):
        return divisors[i + 1]
      lo = i + 2
  if hi is None:
    if lo > last or not fits(divisors[last]):
      return None
    hi = last
  while lo < hi:
    mid = (lo + hi) // 2
    if fits(divisors[mid]):
      hi = mid
    else:
      lo = mid + 1
  return divisors[hi]
