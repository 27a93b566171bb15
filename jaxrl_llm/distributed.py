"""Several processes, one global mesh: joining the job, checking it is one job, moving rows.

A multi-process run starts the same command on every host (`--distributed`). On TPU pods and
SLURM/GPU clusters `jax.distributed.initialize()` finds its peers by itself; elsewhere (and in
`tools/launch_local.py`, which rehearses a pod on one machine with fake CPU devices) the
coordinator is given by the environment:

  JAXRL_LLM_COORDINATOR   host:port of process 0's coordinator service
  JAXRL_LLM_NUM_PROCESSES number of processes
  JAXRL_LLM_PROCESS_ID    this process's index

On CPU the cross-process collectives are gloo's. Every process then sees every device
(`jax.devices()`), builds the same mesh, feeds the block of each batch its devices hold
(`own_block`, `jax.make_array_from_process_local_data`) and reads back that block
(`local_block`).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from jaxrl_llm import sigterm

ENV_COORDINATOR = "JAXRL_LLM_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRL_LLM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_LLM_PROCESS_ID"


class DistributedError(RuntimeError):
  """The processes of a multi-process run could not form one job."""


def initialize(timeout_s: int = 300) -> None:
  """Joins the multi-process job (`jax.distributed.initialize`), from the environment's
  coordinator when `JAXRL_LLM_COORDINATOR` is set, else by the platform's own discovery.
  Raises DistributedError naming the coordinator and the time waited when it fails."""
  address = os.environ.get(ENV_COORDINATOR)
  kwargs: dict = {"initialization_timeout": int(timeout_s)}
  where = "the platform's coordinator"
  if address:
    try:
      kwargs.update(
        coordinator_address=address,
        num_processes=int(os.environ[ENV_NUM_PROCESSES]),
        process_id=int(os.environ[ENV_PROCESS_ID]),
      )
    except (KeyError, ValueError) as e:
      raise DistributedError(
        f"{ENV_COORDINATOR}={address} needs {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} set to "
        f"integers too ({e})"
      ) from None
    where = (
      f"the coordinator at {address} (process {kwargs['process_id']} of {kwargs['num_processes']})"
    )
    if jax.config.jax_platforms in ("cpu", None) or "cpu" in str(jax.config.jax_platforms):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
  advice = (
    "Start the same command on every process, check the address and port, and that process 0 runs"
  )

  def give_up() -> None:  # the runtime aborts the process itself when its own limit passes
    sys.stderr.write(
      f"error: could not join the multi-process job through {where} within {timeout_s} s. "
      f"{advice}\n"
    )
    sys.stderr.flush()
    os._exit(2)

  watchdog = threading.Timer(timeout_s, give_up)
  watchdog.daemon = True
  watchdog.start()
  kwargs["initialization_timeout"] = int(timeout_s) + 60  # the watchdog speaks first
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # the runtime raises several types; all mean the same to a user
    raise DistributedError(
      f"could not join the multi-process job through {where} within {timeout_s} s: "
      f"{first_line(e)}. "
      f"{advice}"
    ) from None
  finally:
    watchdog.cancel()


def first_line(err: BaseException) -> str:
  """The first line of `err`'s message (at most 300 characters), or its type's name."""
  text = str(err).strip()
  return text.splitlines()[0][:300] if text else type(err).__name__


def config_digest(config) -> str:
  """A SHA-256 of the resolved config (a `config.Config`; every field, sorted): equal
  configs, equal digests."""
  return hashlib.sha256(config.to_json().encode()).hexdigest()


def check_same_config(config) -> None:
  """Raises ValueError when the processes of the job were started with different configs."""
  if jax.process_count() == 1:
    return
  digest = np.frombuffer(bytes.fromhex(config_digest(config)), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(digest))  # [processes, 32]
  differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
  if differ:
    raise ValueError(
      f"processes {differ} were started with a config that differs from process 0's (config "
      f"digest {bytes(every[differ[0]]).hex()[:12]} vs {bytes(every[0]).hex()[:12]}); start "
      "every process with the same command and overrides"
    )


def own_block(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[slice, ...]:
  """The block of a global array of `shape` under `sharding` that this process's devices hold:
  in each dimension the span of indices they hold (whole where the dimension is not split over
  processes). Raises ValueError where that span is not one of equal blocks of the dimension."""
  held = sharding.addressable_devices_indices_map(tuple(shape)).values()
  block = []
  for d, n in enumerate(shape):
    lo = min(i[d].indices(n)[0] for i in held)
    hi = max(i[d].indices(n)[1] for i in held)
    if n % (hi - lo) or lo % (hi - lo):
      raise ValueError(
        f"process {jax.process_index()} holds indices {lo}:{hi} of {n} in dimension {d}: not "
        "one of equal blocks"
      )
    block.append(slice(lo, hi))
  return tuple(block)


def shard_of(sharding: jax.sharding.Sharding, shape: tuple[int, ...], dim: int) -> tuple[int, int]:
  """(index, count): this process holds block `index` of `count` equal blocks of dimension
  `dim` (as a data pipeline's `shard_index`, `shard_count`)."""
  span = own_block(sharding, shape)[dim]
  size = span.stop - span.start
  return span.start // size, shape[dim] // size


def local_block(x: jax.Array) -> np.ndarray:
  """This process's block of `x` (`own_block`) as one host array; a fully addressable array
  is returned whole."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  block = own_block(x.sharding, x.shape)
  out = np.empty([s.stop - s.start for s in block], x.dtype)
  for shard in x.addressable_shards:  # copies over other axes are equal
    at = [i.indices(n) for i, n in zip(shard.index, x.shape, strict=True)]
    out[tuple(slice(a - s.start, b - s.start) for (a, b, _), s in zip(at, block, strict=True))] = (
      np.asarray(shard.data)
    )
  return out


def placed_like(values: dict, like: jax.Array, to_global) -> dict:
  """Host arrays {name: [rows...]} as float32 device arrays: in one process laid out as `like`
  (the layout a compile-only plan gave those inputs, so the program it compiled is the one
  called); across processes each process's block through `to_global`."""
  if jax.process_count() == 1:
    return {k: jax.device_put(np.asarray(v, np.float32), like.sharding) for k, v in values.items()}
  return {k: to_global(np.asarray(v, np.float32)) for k, v in values.items()}


def summed(values: np.ndarray) -> np.ndarray:
  """`values` summed over the processes (each process's own counts; a collective: every
  process must call it). On one process, `values` as they are."""
  if jax.process_count() == 1:
    return np.asarray(values)
  return np.sum(np.asarray(multihost_utils.process_allgather(np.asarray(values))), axis=0)


def host_values(tree):
  """`jax.device_get` that also reads arrays spread over several processes: those are
  gathered whole on every process (a collective: every process must call it)."""

  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.device_get(x)

  return jax.tree.map(get, tree)


# Seconds a process waits at a barrier for its peers: room for the slowest host to compile a
# large model's step; a peer that stops ends the wait sooner (`watch_peers`).
BARRIER_TIMEOUT_S = 3600


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
  """Waits until every process reaches `name` (no-op on one process). It waits in the
  coordination service, not in a device collective, so a wait of minutes is fine; raises
  DistributedError naming the barrier after `timeout_s`."""
  if jax.process_count() == 1:
    return
  client = _client()
  if client is None:
    multihost_utils.sync_global_devices(name)
    return
  try:
    client.wait_at_barrier(f"jaxrl_llm/{name}", int(timeout_s * 1000))
  except Exception as err:  # a JaxRuntimeError: DEADLINE_EXCEEDED or the service is gone
    raise DistributedError(
      f"process {jax.process_index()} of {jax.process_count()} waited {timeout_s:.0f} s at "
      f"'{name}' and not every process arrived ({str(err).splitlines()[0][:300]})"
    ) from None


def _same_program(a, b) -> bool:
  """Whether signatures `a` and `b` (`_signature`) compile to one program: the same
  structure, shapes and dtypes, and equivalent shardings (a step's output `P()` for its input
  `P(('fsdp', 'expert'))` on axes of size 1)."""
  if a[0] != b[0]:
    return False
  for (shape, dtype, x), (shape_b, dtype_b, y) in zip(a[1], b[1], strict=True):
    if shape != shape_b or dtype != dtype_b:
      return False
    if isinstance(x, jax.sharding.Sharding) and isinstance(y, jax.sharding.Sharding):
      if not x.is_equivalent_to(y, len(shape)):
        return False
    elif x != y:
      return False
  return True


def _signature(leaves: list, tree):
  """What decides a jitted program's compilation: the arguments' structure (`tree`), and their
  `leaves`' shapes, dtypes and shardings."""
  return tree, tuple(
    (np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "sharding", None)) for x in leaves
  )


_CACHE_HITS = [0]  # programs this process loaded from the persistent compilation cache


def _count_cache_hit(event: str, **_) -> None:
  """Counts JAX's persistent-cache hits (a `jax.monitoring` event listener)."""
  if event == "/jax/compilation_cache/cache_hits":
    _CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_count_cache_hit)


class Program:
  """A jitted program compiled ahead on its first run of each input signature
  (`lower(...).compile()`; the call then reuses it): under `sigterm.compiling(what)`, so a
  SIGTERM or Ctrl-C that comes during a compilation of minutes stops the run at once; in a
  multi-process job then a barrier, so its first run starts on every process at once.

  The processes must enter a program's first cross-process collective within gloo's 30 s
  rendezvous, which a compile may exceed: a persistent compilation cache holds process 0's
  executables only (on CPU each process's key differs), so after a relaunch process 0 loads
  the step while the others compile it. `loaded`: whether its last compilation was loaded from
  the persistent compilation cache. Every other attribute is the jitted function's."""

  def __init__(self, jitted, name: str, what: str):
    self.jitted, self.name, self.what, self.ready = jitted, name, what, []
    self.loaded = False

  def __call__(self, *args, **kwargs):
    """Runs the program; its first run of a signature compiles (then, in a job, waits at a
    barrier). Traced inside another transformation (`jax.eval_shape`, an outer `jit`), it is
    only traced: nothing is compiled."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return self.jitted(*args, **kwargs)  # traced inside another program: nothing to compile
    key = _signature(leaves, tree)
    if not any(_same_program(key, seen) for seen in self.ready):
      start, hits = time.monotonic(), _CACHE_HITS[0]
      with sigterm.compiling(self.what):
        self.jitted.lower(*args, **kwargs).compile()
      self.loaded = _CACHE_HITS[0] > hits
      if jax.process_count() > 1:
        compiled = time.monotonic()
        barrier(f"compiled/{self.name}/{len(self.ready)}")
        logging.info(
          "%s: compiled in %.1fs, then waited %.1fs for every process to compile it",
          self.name, compiled - start, time.monotonic() - compiled,
        )  # fmt: skip
      self.ready.append(key)
    return self.jitted(*args, **kwargs)

  def __getattr__(self, attr: str):
    return getattr(self.jitted, attr)


def program(jitted, name: str, what: str) -> Program:
  """`jitted` as a `Program` named `name` (its barriers' name) that compiles `what` (e.g. "the
  RL step": the line of a stop during its compilation)."""
  return Program(jitted, name, what)


# Why a process stopped, for its peers: `jaxrl_llm/stopped/<process>` = "<exit code> <line>".
_STOPPED = "jaxrl_llm/stopped/"
# Set by process 0 as it leaves a stopping job, and by each other process as it leaves after it.
_HOST_LEAVES, _LEAVING = "jaxrl_llm/host_leaves", "jaxrl_llm/leaving/"
# Exit codes of errors that every process may meet on its own (a config or mesh problem): a
# peer acts on their notice only after this many seconds, so each prints its own line first.
_OWN_ERROR_CODES, OWN_ERROR_GRACE_S = (2,), 20.0


def _client():
  """The coordination service's client of `jax.distributed` (None on one process)."""
  if jax.process_count() == 1:
    return None
  try:  # JAX has no public handle to it; multihost_utils and orbax read the same one
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client
  except (ImportError, AttributeError):  # moved: peers fall back to JAX's heartbeat
    return None


def _leave(
  client, code: int, wait_s: float = 5.0, margin_s: float = 0.2, line: str | None = None
) -> None:
  """Ends this process of a stopping job with exit `code`, in the order that keeps every
  process's one line its last (`line`, when given, goes to stderr just before the exit, since
  the main thread may log an update it was finishing while this waits). Process 0 hosts the
  coordination service, and JAX aborts a process that is alive when the service ends, so
  process 0 says it leaves, waits (at most `wait_s`) until every other process has said it
  leaves too, then leaves `margin_s` later; each other process, once process 0 has said so
  (or after `wait_s`), says it leaves and does.
  Leaving this close together also keeps a process waiting in a collective with one that is
  gone from aborting in it (CPU collectives can) before it leaves."""
  me, deadline = jax.process_index(), time.monotonic() + wait_s

  def wait_for(key: str) -> None:
    try:
      client.blocking_key_value_get(key, max(1, int((deadline - time.monotonic()) * 1000)))
    except Exception:  # not said in time, or the service is failing: leave anyway
      pass

  def say(key: str) -> None:
    try:
      client.key_value_set(key, "1", allow_overwrite=True)
    except Exception:
      pass

  if me == 0:
    say(_HOST_LEAVES)
    for index in range(1, jax.process_count()):
      wait_for(f"{_LEAVING}{index}")
    threading.Event().wait(margin_s)
  else:
    wait_for(_HOST_LEAVES)
    say(f"{_LEAVING}{me}")
  if line:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
  os._exit(code)


def announce_stop(code: int, line: str, linger_s: float = 5.0) -> None:
  """Tells the other processes of the job that this one stops with exit `code` and why (best
  effort), and ends this process once they have read it (`_leave`, waiting at most
  `linger_s`). Returns only on one process."""
  client = _client()
  if client is None:
    return
  try:
    client.key_value_set(f"{_STOPPED}{jax.process_index()}", f"{code} {line.strip()[:2000]}")
  except Exception:  # the service may be gone already: the peers learn from its heartbeats
    os._exit(code)
  _leave(client, code, linger_s)


def peer_stopped(
  entries: list[tuple[str, str]], me: int, processes: int, seen: dict, now: float
) -> str | None:
  """The line that stops process `me` of `processes` given the stop notices `entries` read
  from the service (`seen`: when each was first read), or None while none applies yet."""
  for key, value in sorted(entries):
    index = key.rsplit("/", 1)[-1]
    if index == str(me):
      continue
    code, _, line = value.partition(" ")
    first = seen.setdefault(key, now)
    if int(code) in _OWN_ERROR_CODES and now - first < OWN_ERROR_GRACE_S:
      continue
    return (
      f"error: process {index} of {processes} stopped ({line}); this process stops "
      "too: relaunch the same command on every process to resume"
    )
  return None


def watch_peers(interval_s: float = 0.5) -> threading.Thread | None:
  """Starts a daemon thread that ends this process (exit 1, one line) once another process of
  the job announced that it stopped, instead of waiting in a collective for it until JAX's
  heartbeat timeout aborts the job (`_leave`: process 0 leaves last). None on one process.

  The thread stops and is joined when the interpreter exits (before JAX shuts the job down): a
  daemon thread still inside the service's client then would be torn down mid-call, which
  aborts the process ("FATAL: exception not rethrown") after a run that succeeded.
  """
  client = _client()
  if client is None:
    return None
  me, processes = jax.process_index(), jax.process_count()
  stop = threading.Event()

  def watch() -> None:
    seen: dict = {}
    while not stop.wait(interval_s):
      try:
        entries = client.key_value_dir_get(_STOPPED)
      except Exception:  # the service is gone: JAX's own agent ends this process
        return
      line = peer_stopped(entries, me, processes, seen, time.monotonic())
      if line:
        _leave(client, 1, line=line)

  thread = threading.Thread(target=watch, name="watch_peers", daemon=True)
  thread.start()

  def halt() -> None:  # runs before JAX's own exit hook, which was registered at its import
    stop.set()
    thread.join(timeout=60)

  atexit.register(halt)
  return thread
