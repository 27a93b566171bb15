"""A robust batch scorer of reward terms over decoded completions (host side).

A reward term is any callable `fn(completion: str, reference: str) -> float` (the built-in ones are
`jaxrl_llm.data.verifiers.rewards`). `score_batch` runs every term on every (completion, reference)
pair in a pool of workers; a call that raises, returns something that is not a finite number, or
runs past `timeout_s` scores 0.0 for that term and is counted in the returned stats. Verifier
failures never raise out of `score_batch`. The built-in terms also refuse over-long or too deeply
nested input before parsing it (see `jaxrl_llm.data.verifiers.math`), so they stay fast on any
text.

Executors:
  * `'process'` (default): a `ProcessPoolExecutor` (forkserver/spawn start, never plain fork, so
    it is safe next to JAX's threads), so the time limit holds whatever a call does, even one
    stuck in C code holding its GIL. When a call times out, the pool's worker processes are
    killed (and waited for) and every call not yet finished is resubmitted to a fresh pool with
    a fresh clock. Terms must be picklable (top-level functions, or `functools.partial` of
    them). The pool is kept between batches with the same `max_workers`, so a training step
    does not pay for starting processes; it is replaced after a timeout or when a worker dies
    (e.g. a segfault: that batch's unfinished calls count as errors), and stopped at
    interpreter exit (or by `shutdown_workers()`). A batch that finds the kept pool busy (a
    concurrent `score_batch` in another thread) uses a pool of its own.
  * `'thread'`: a `ThreadPoolExecutor`, started for each batch. Cheap, and fine for verifiers
    that return. A Python thread cannot be killed: a call that times out is scored 0.0 and
    abandoned, but keeps running (and may hold the GIL) until it returns, and the interpreter
    waits for it at exit. When abandoned calls occupy every worker, the calls still queued move
    to a fresh pool.

A call's clock starts when a worker begins it, so queueing and worker start-up never count.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import itertools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxrl_llm.data.verifiers import workers
from jaxrl_llm.data.verifiers.rewards import RewardFn

logger = logging.getLogger(__name__)
_MAX_CHUNK = 8  # most calls sent to a process worker as one task

_EXECUTORS = ("thread", "process")
_CALL_IDS = itertools.count()  # unique across batches: a kept pool may report an old call late
_SHARED_LOCK = threading.Lock()  # held by the batch using the kept process pool
_shared_pool: _Pool | None = None  # the process pool kept between batches (under the lock)


def _gone(pid: int) -> bool:
  """Whether no process `pid` exists any more (a zombie still counts as existing)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except OSError:  # exists, but is not ours to signal
    return False
  return False


class _Pool:
  """One executor plus the queue its workers report call starts (and process pids) on."""

  def __init__(self, kind: str, max_workers: int):
    self.kind = kind
    self.max_workers = max_workers
    self.pids: list[int] = []
    self.broken = False  # a process pool that lost a worker, or refused a call
    if kind == "thread":
      self.events = queue.SimpleQueue()
      self.executor = cf.ThreadPoolExecutor(max_workers, thread_name_prefix="verifier")
    else:
      ctx = workers.process_context()
      self.events = ctx.SimpleQueue()
      self.executor = cf.ProcessPoolExecutor(
        max_workers, mp_context=ctx, initializer=workers.init_worker, initargs=(self.events,)
      )

  def submit(self, calls: Sequence[workers.Call]) -> cf.Future:
    """Submits calls as one task; a pool that cannot take it (broken) yields a failed future."""
    try:
      if self.kind == "thread":
        return self.executor.submit(workers.run_calls, self.events, calls)
      return self.executor.submit(workers.calls_in_process, calls)
    except Exception as e:
      self.broken = True
      fut = cf.Future()
      fut.set_exception(e)
      return fut

  def started_calls(self) -> list[int]:
    """Ids of the calls that started since the last look (records process pids on the way)."""
    out = []
    while not self.events.empty():
      kind, value = self.events.get()
      if kind == "pid":
        self.pids.append(value)
      else:
        out.append(value)
    return out

  def worker_pids(self) -> list[int]:
    """Pids of this process pool's workers, as far as known (reported or spawned)."""
    self.started_calls()
    spawned = getattr(self.executor, "_processes", None) or {}
    return sorted(set(self.pids) | set(list(spawned)))

  def close(self, *, kill: bool, wait_s: float = 1.0) -> None:
    """Shuts the executor down; with `kill`, without waiting, and process workers are killed.
    Killed workers are waited for (at most `wait_s`), and the executor's manager thread (at most
    5 s more; it holds the queues, whose semaphores a process leaving sooner leaks)."""
    if not kill:
      self.executor.shutdown(wait=True)
    else:
      pids = self.worker_pids() if self.kind == "process" else []
      manager = getattr(self.executor, "_executor_manager_thread", None)  # gone after shutdown
      self.executor.shutdown(wait=False, cancel_futures=True)
      for pid in pids:
        try:
          os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
        except OSError:  # already gone
          pass
      deadline = time.monotonic() + wait_s
      while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if not _gone(pid)]
        if pids:
          time.sleep(0.002)
      if manager is not None and manager is not threading.current_thread():
        manager.join(timeout=5.0)  # it ends once it sees its workers gone
    if self.kind == "process":
      self.events.close()  # its workers are gone; free the pipe now rather than at collection


def _checkout(kind: str, workers: int) -> tuple[_Pool, bool]:
  """A pool for one batch and whether it is the kept process pool (then the lock is held).

  Processes: the kept pool when it is free (started, or replaced when it has another worker
  count or is broken); a private pool when another batch is using it. Threads: always private.
  """
  global _shared_pool
  if kind != "process" or not _SHARED_LOCK.acquire(blocking=False):
    return _Pool(kind, workers), False
  try:
    pool = _shared_pool
    if pool is not None and (pool.broken or pool.max_workers != workers):
      _shared_pool = None
      pool.close(kill=True)
      pool = None
    if pool is None:
      pool = _shared_pool = _Pool(kind, workers)
  except BaseException:
    _SHARED_LOCK.release()
    raise
  return pool, True


def _checkin(pool: _Pool, *, shared: bool, kill: bool) -> None:
  """Ends a batch: a kept pool stays for the next one unless `kill` (then it is killed)."""
  global _shared_pool
  if not shared:
    pool.close(kill=kill)
    return
  try:
    if kill or pool.broken:
      _shared_pool = None
      pool.close(kill=True)
    else:
      _shared_pool = pool
  finally:
    _SHARED_LOCK.release()


def worker_pids() -> list[int]:
  """Pids of the kept verifier worker processes (empty when there is no kept pool)."""
  with _SHARED_LOCK:
    return [] if _shared_pool is None else _shared_pool.worker_pids()


def shutdown_workers(timeout_s: float | None = None) -> None:
  """Stops the kept verifier worker processes (the next process batch starts new ones).

  Waits for a batch using them to end first, at most `timeout_s` (None: as long as it takes);
  past that they are killed anyway (at interpreter exit, after 1 s).
  """
  global _shared_pool
  locked = _SHARED_LOCK.acquire(timeout=-1 if timeout_s is None else timeout_s)
  try:
    pool, _shared_pool = _shared_pool, None
    if pool is not None:
      pool.close(kill=True)
  finally:
    if locked:
      _SHARED_LOCK.release()


atexit.register(shutdown_workers, timeout_s=1.0)


def _default_workers(kind: str) -> int:
  """The default pool size: usable CPUs (+4 for threads), at most 32."""
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    cpus = os.cpu_count() or 1
  return min(32, cpus + 4) if kind == "thread" else min(32, cpus)


def _check_arguments(completions, references, terms, executor: str) -> None:
  """`score_batch`'s ValueError for unequal lengths, an unknown executor, or a term that
  cannot pickle for 'process'."""
  if len(completions) != len(references):
    raise ValueError(f"{len(completions)} completions but {len(references)} references")
  if executor not in _EXECUTORS:
    raise ValueError(f"executor {executor!r} is not one of {_EXECUTORS}")
  if executor == "process":
    for name, fn in terms.items():
      if said := workers.unpicklable(fn):
        raise ValueError(
          f"reward term {name!r} cannot be pickled ({said}); executor='process' needs top-level "
          "functions (or functools.partial of them), or pass executor='thread'"
        )


def score_batch(
  completions: Sequence[str],
  references: Sequence[str],
  *,
  terms: Mapping[str, RewardFn],
  timeout_s: float | None = 5.0,
  max_workers: int | None = None,
  executor: str = "process",
  fill: float = 0.0,
  said: set[str] | None = None,
  label: str = "reward term",
  stop: Callable[[], bool] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """Scores every completion with every term → ({name: float32 [B]}, stats); never raises.
  A failed call scores `fill` (0.0; NaN tells failures apart, as the host tools do).

  Each `terms[name](completion, reference)` call that raises, returns a non-finite or
  non-numeric value, or runs longer than `timeout_s` (None: no limit) scores 0.0 and is counted
  in `verifier/errors/<name>` / `verifier/timeouts/<name>` (and the totals `verifier/errors`,
  `verifier/timeouts`). `executor` is 'process' (default: hung calls are killed; terms must
  pickle) or 'thread' (see the module docstring); `max_workers` defaults to the usable CPUs
  (at most 32). Bad arguments, and terms that cannot pickle for 'process', raise ValueError.
  A term's first failure is logged as `<label> <name> failed ...` unless `said` (a set kept
  across batches: once a run) holds its name; a term logged is added to `said`.
  When `stop()` turns true (e.g. `sigterm.seen`: the run is stopping), the calls not finished
  are cut: killed, scored `fill`, and counted in `verifier/cut` (a key only given with `stop`);
  once it is true, no call starts.
  """
  _check_arguments(completions, references, terms, executor)
  batch = len(completions)
  names = list(terms)
  scores = {name: np.full((batch,), fill, np.float32) for name in names}
  errors = dict.fromkeys(names, 0)
  timeouts = dict.fromkeys(names, 0)
  tasks = [(name, i) for name in names for i in range(batch)]
  start, cut = time.monotonic(), 0
  if tasks:
    workers = max(1, max_workers or _default_workers(executor))
    if executor == "thread":  # a thread pool is private to the batch: no idle threads
      workers = min(workers, len(tasks))
    runner = _Runner(
      completions, references, terms, timeout_s, workers, executor, label, said, stop=stop
    )
    cut = runner.run(tasks, scores, errors, timeouts)

  stats: dict[str, float] = {}
  for name in names:
    stats[f"verifier/errors/{name}"] = errors[name]
    stats[f"verifier/timeouts/{name}"] = timeouts[name]
  stats["verifier/errors"] = sum(errors.values())
  stats["verifier/timeouts"] = sum(timeouts.values())
  stats["verifier/seconds"] = time.monotonic() - start
  if stop is not None:
    stats["verifier/cut"] = cut
  return scores, stats


_WORKER_ENDED = (
  "the worker process running it ended (os._exit, a crash or a kill); its calls in that batch "
  "count as errors and the pool is replaced"
)


class _Runner:
  """The submit / collect / time-out loop behind `score_batch`."""

  def __init__(
    self, completions, references, terms, timeout_s, workers, kind, label, said, stop=None
  ):
    self.completions, self.references, self.terms = completions, references, terms
    self.label = label  # what a term is called when it fails
    self.logged: set[str] = set() if said is None else said  # terms whose failure was said
    self.timeout_s, self.workers, self.kind = timeout_s, workers, kind
    self.done: queue.SimpleQueue = queue.SimpleQueue()  # (future, call ids) of finished tasks
    self.previous: dict[int, int] = {}  # call id → the call before it in the same task
    self.stop: Callable[[], bool] | None = stop  # true: cut the calls not finished
    self.cut = 0  # calls cut by `stop`

  def _submit_all(self, pool: _Pool, tasks) -> dict[int, tuple[cf.Future, tuple[str, int]]]:
    """Submits (name, index) tasks under fresh call ids → {call id: (its future, task)}.

    Threads get one call per task; processes up to `_MAX_CHUNK`, while keeping about four
    tasks per worker (fewer round trips, same parallelism). Each call still reports its own
    start, so each has its own clock.
    """
    size = 1
    if pool.kind == "process":
      size = max(1, min(_MAX_CHUNK, len(tasks) // (4 * pool.max_workers)))
    pending = {}
    for lo in range(0, len(tasks), size):
      chunk = tasks[lo : lo + size]
      ids = [next(_CALL_IDS) for _ in chunk]
      calls = [
        (c, self.terms[name], self.completions[i], self.references[i])
        for c, (name, i) in zip(ids, chunk)
      ]
      fut = pool.submit(calls)
      for c, task in zip(ids, chunk):
        pending[c] = (fut, task)
      self.previous.update(zip(ids[1:], ids[:-1]))
      fut.add_done_callback(lambda f, ids=ids: self.done.put((f, ids)))
    return pending

  def run(self, tasks, scores, errors, timeouts) -> int:
    """Runs every task, filling `scores`, `errors` and `timeouts` in place → the calls cut."""
    self.scores, self.errors, self.timeouts = scores, errors, timeouts
    self.returned: set[str] = set()  # terms with a call that came back (a value or an error)
    if self.stop is not None and self.stop():  # stopping: no call starts
      return len(tasks)
    self.pending: dict = {}  # call id -> (its future, (name, index))
    self.abandoned: list[cf.Future] = []  # timed-out thread calls that are still running
    self.pool, shared = _checkout(self.kind, self.workers)
    try:
      self.pending = self._submit_all(self.pool, tasks)
      if self.pool.broken and shared:  # the kept pool died while idle: start afresh once
        self.pool.close(kill=True)
        self.pool = _Pool(self.kind, self.workers)
        self.pending = self._submit_all(self.pool, [task for _, task in self.pending.values()])
      self._wait()
    finally:
      # Hung or interrupted process calls are killed (and a kept pool with them); thread calls
      # are left to finish. An idle kept pool stays for the next batch.
      if self.kind == "thread":
        self.pool.close(kill=True)
      else:
        kill = bool(self.pending or self.abandoned or self.cut)
        _checkin(self.pool, shared=shared, kill=kill)
    return self.cut

  def _wait(self) -> None:
    """Collects results until no call is pending, timing the calls that run.

    `started` holds the calls running now, with the time the parent saw each start; a call
    that returned stays pending until its task's results arrive, but is no longer timed.
    """
    timeout_s = self.timeout_s
    self.started: dict[int, float] = {}  # running call id → when the parent saw it start
    poll = 0.02 if timeout_s is None else min(0.02, max(timeout_s / 20, 1e-3))
    next_check = time.monotonic() + poll
    while self.pending:
      self._collect(self._finished(next_check))
      now = time.monotonic()
      if now < next_check:
        continue
      next_check = now + poll
      for call_id in self.pool.started_calls():
        if call_id in self.pending:
          self.started.setdefault(call_id, now)
          # The call before it in its task has returned: its clock stops.
          self.started.pop(self.previous.pop(call_id, -1), None)
      if timeout_s is not None:
        self._expire(now)
      if self.stop is not None and self.pending and self.stop():
        self.cut, self.pending = len(self.pending), {}  # scored `fill`; the pool is killed

  def _finished(self, until: float) -> list[tuple[cf.Future, list[int]]]:
    """The (future, call ids) of the tasks that finished, waiting for one until `until`."""
    try:
      finished = [self.done.get(timeout=max(until - time.monotonic(), 0.0))]
      while not self.done.empty():
        finished.append(self.done.get())
    except queue.Empty:
      finished = []
    return finished

  def _collect(self, finished: list[tuple[cf.Future, list[int]]]) -> None:
    """Records the results of finished tasks: scores, or errors (logged once per term)."""
    for fut, ids in finished:
      if not any(c in self.pending for c in ids):  # a task from a pool that was given up
        continue
      try:
        results = fut.result()
      except BaseException as e:  # the task as a whole failed (or was cancelled)
        if isinstance(e, KeyboardInterrupt):
          raise
        said = workers.said(e)
        if isinstance(e, cf.BrokenExecutor):
          self.pool.broken = True  # a worker died: the pool is replaced after this batch
          said = _WORKER_ENDED
        results = [(c, 0.0, said) for c in ids]
      for call_id, value, error in results:
        if call_id not in self.pending:
          continue
        _, (name, i) = self.pending.pop(call_id)
        self.started.pop(call_id, None)
        self.returned.add(name)
        if error is None:
          self.scores[name][i] = value
          continue
        self.errors[name] += 1
        if name not in self.logged:
          self.logged.add(name)
          logger.warning(
            "%s %r failed on item %d (its first failure; all are counted in "
            "verifier/errors/%s): %s", self.label, name, i, name, error,
          )  # fmt: skip

  def _give_up(self) -> None:
    """A term whose first 2 x workers calls of the batch all hung (none came back) hangs on
    every call: its calls not finished are not waited for (each scores `fill` and counts as a
    timeout), so a broken term costs a step about two time limits, not one per call."""
    hung = {n for n, k in self.timeouts.items() if k >= 2 * self.workers} - self.returned
    dropped = [c for c, (_, (name, _)) in self.pending.items() if name in hung]
    for call_id in dropped:
      _, (name, _) = self.pending.pop(call_id)
      self.started.pop(call_id, None)
      self.timeouts[name] += 1
      if f"{name}/hung" in self.logged:
        continue
      self.logged.add(f"{name}/hung")  # said once a run, as a first failure is
      logger.warning(
        "%s %r hung on its first %d calls of this batch: its other calls are not waited for "
        "(scored as failed, counted in verifier/timeouts/%s)", self.label, name,
        2 * self.workers, name,
      )  # fmt: skip

  def _expire(self, now: float) -> None:
    """Times out the calls running longer than `timeout_s`: each scores 0.0 and is counted."""
    expired = [
      c
      for c, t0 in self.started.items()
      if now - t0 > self.timeout_s and not self.pending[c][0].done()
    ]
    if not expired:
      return
    for call_id in expired:
      fut, (name, i) = self.pending.pop(call_id)
      del self.started[call_id]
      self.timeouts[name] += 1
      self.abandoned.append(fut)
      if name not in self.logged:  # its first failure, a timeout as an error, is said once
        self.logged.add(name)
        logger.warning(
          "%s %r timed out on item %d (it ran past %g s: scored as failed, and counted in "
          "verifier/timeouts/%s; calls that hang are waited for %g s each, %d at a time, and a "
          "term whose first %d calls of a batch all hang is not waited for again in it)",
          self.label, name, i, self.timeout_s, name, self.timeout_s, self.workers,
          2 * self.workers,
        )  # fmt: skip
    self._give_up()
    self.abandoned = [f for f in self.abandoned if not f.done()]
    if self.kind == "process" or len(self.abandoned) >= self.workers:
      # Processes: kill the hung workers. Threads: every worker is stuck, so start afresh.
      # Either way, whatever has not finished is resubmitted under a fresh clock (calls
      # that shared a task with a hung call run again: their results died with it).
      rest = [task for _, task in self.pending.values()]
      self.pool.close(kill=True)
      self.pool = _Pool(self.kind, self.workers)
      self.pending = self._submit_all(self.pool, rest)
      self.started.clear()
      self.abandoned = []
