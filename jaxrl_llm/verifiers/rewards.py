"""Reward functions over decoded completions and a robust batch scorer (host side).

A reward term is any callable `fn(completion: str, reference: str) -> float`. `score_batch` runs
every term on every (completion, reference) pair in a pool of workers; a call that raises, returns
something that is not a finite number, or runs past `timeout_s` scores 0.0 for that term and is
counted in the returned stats. Verifier failures never raise out of `score_batch`.

Executors:
  * `'thread'` (default): a `ThreadPoolExecutor`. Cheap, and fine for verifiers that return. A
    Python thread cannot be killed: a call that times out is scored 0.0 and abandoned, but keeps
    running in its thread until it returns (and the interpreter waits for it at exit). When
    abandoned calls occupy every worker, the calls still queued move to a fresh pool.
  * `'process'`: a `ProcessPoolExecutor` (forkserver/spawn start, never plain fork, so it is safe
    next to JAX's threads). For verifiers that may hang: when a call times out, the pool's worker
    processes are killed and every call not yet finished is resubmitted to a fresh pool with a
    fresh clock. Terms must be picklable (top-level functions, or `functools.partial` of
    them). A worker that dies (e.g. a segfault) breaks the pool: its unfinished calls count
    as errors. Each batch starts its own workers, which costs a fraction of a second.

A call's clock starts when a worker begins it, so queueing and worker start-up never count.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import multiprocessing
import os
import pickle
import queue
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxrl_llm.verifiers import math as vmath

logger = logging.getLogger(__name__)
RewardFn = Callable[[str, str], float]
_FORMAT_TEMPLATES = ("boxed", "think", "gsm8k")
_THINK_RE = re.compile(r"^\s*<think>(?P<think>.*?)</think>(?P<answer>.*)$", re.DOTALL)

# ---------------------------------------------------------------------------------------------
# Reward functions
# ---------------------------------------------------------------------------------------------


def reference_answer(reference: str) -> str:
  """The answer inside a reference: its last `\\boxed{}`, else after `####`, else all of it."""
  boxed = [b for b in vmath.extract_boxed(reference) if b]
  if boxed:
    return boxed[-1]
  gsm = vmath.extract_gsm8k(reference)
  return gsm if gsm is not None else reference.strip()


def correctness_reward(
  completion: str, reference: str, *, extract: str = "auto", backend: str = "builtin"
) -> float:
  """1.0 when the answer extracted from `completion` is equivalent to `reference`, else 0.0."""
  pred = vmath.extract_answer(completion, extract)
  if pred is None:
    return 0.0
  return float(vmath.is_equivalent(pred, reference_answer(reference), backend=backend))


def format_reward(completion: str, *, template: str = "boxed") -> float:
  """1.0 when `completion` follows `template` ('boxed', 'think' or 'gsm8k'), else 0.0.

  'boxed': exactly one non-empty `\\boxed{}`. 'think': starts with one `<think>...</think>`
  block followed by a non-empty answer. 'gsm8k': exactly one `####` followed by an answer.
  """
  if template not in _FORMAT_TEMPLATES:
    raise ValueError(f"format template {template!r} is not one of {_FORMAT_TEMPLATES}")
  if template == "boxed":
    boxed = vmath.extract_boxed(completion)
    return float(len(boxed) == 1 and bool(boxed[0]))
  if template == "think":
    if completion.count("<think>") != 1 or completion.count("</think>") != 1:
      return 0.0
    m = _THINK_RE.match(completion)
    return float(m is not None and bool(m["think"].strip()) and bool(m["answer"].strip()))
  return float(completion.count("####") == 1 and vmath.extract_gsm8k(completion) is not None)


# Two-argument, top-level (hence picklable) forms for the registry and `score_batch`.


def math_correct(completion: str, reference: str) -> float:
  """`correctness_reward` with extraction 'auto' (last boxed → `####` → last number)."""
  return correctness_reward(completion, reference, extract="auto")


def math_correct_boxed(completion: str, reference: str) -> float:
  """`correctness_reward` reading only the last `\\boxed{}` answer."""
  return correctness_reward(completion, reference, extract="boxed")


def gsm8k_correct(completion: str, reference: str) -> float:
  """`correctness_reward` reading only the answer after `####`."""
  return correctness_reward(completion, reference, extract="gsm8k")


def math_verify_correct(completion: str, reference: str) -> float:
  """`correctness_reward` judged by the optional `math-verify` package."""
  return correctness_reward(completion, reference, extract="auto", backend="math_verify")


def math_format_boxed(completion: str, reference: str | None = None) -> float:
  """`format_reward(template='boxed')`; `reference` is ignored."""
  del reference
  return format_reward(completion, template="boxed")


def think_format(completion: str, reference: str | None = None) -> float:
  """`format_reward(template='think')`; `reference` is ignored."""
  del reference
  return format_reward(completion, template="think")


def gsm8k_format(completion: str, reference: str | None = None) -> float:
  """`format_reward(template='gsm8k')`; `reference` is ignored."""
  del reference
  return format_reward(completion, template="gsm8k")


# ---------------------------------------------------------------------------------------------
# Batch scoring
# ---------------------------------------------------------------------------------------------

_EXECUTORS = ("thread", "process")
_WORKER_EVENTS = None  # in a process-pool worker: the queue that reports pids and call starts


def _init_worker(events) -> None:
  """Process-pool initializer: keeps the event queue and reports this worker's pid."""
  global _WORKER_EVENTS
  _WORKER_EVENTS = events
  events.put(("pid", os.getpid()))


def _call_in_process(call_id: int, fn: RewardFn, completion: str, reference: str) -> float:
  """Runs one call in a process worker, first reporting that it started (after unpickling)."""
  _WORKER_EVENTS.put(("start", call_id))
  return fn(completion, reference)


def _call_in_thread(events, call_id: int, fn: RewardFn, completion: str, reference: str) -> float:
  """Runs one call in a thread worker, first reporting that it started."""
  events.put(("start", call_id))
  return fn(completion, reference)


class _Pool:
  """One executor plus the queue its workers report call starts (and process pids) on."""

  def __init__(self, kind: str, max_workers: int):
    self.kind = kind
    self.pids: list[int] = []
    if kind == "thread":
      self.events = queue.SimpleQueue()
      self.executor = cf.ThreadPoolExecutor(max_workers, thread_name_prefix="verifier")
    else:
      methods = multiprocessing.get_all_start_methods()
      ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
      self.events = ctx.SimpleQueue()
      self.executor = cf.ProcessPoolExecutor(
        max_workers, mp_context=ctx, initializer=_init_worker, initargs=(self.events,)
      )

  def submit(self, call_id: int, fn: RewardFn, completion: str, reference: str) -> cf.Future:
    """Submits one call; a pool that cannot take it (broken) yields a failed future instead."""
    try:
      if self.kind == "thread":
        return self.executor.submit(
          _call_in_thread, self.events, call_id, fn, completion, reference
        )
      return self.executor.submit(_call_in_process, call_id, fn, completion, reference)
    except Exception as e:
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

  def close(self, *, kill: bool) -> None:
    """Shuts the executor down; with `kill`, without waiting, and process workers are killed."""
    if not kill:
      self.executor.shutdown(wait=True)
      return
    self.executor.shutdown(wait=False, cancel_futures=True)
    if self.kind == "process":
      self.started_calls()
      for pid in self.pids:
        try:
          os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
        except OSError:  # already gone
          pass


def score_batch(
  completions: Sequence[str],
  references: Sequence[str],
  *,
  terms: Mapping[str, RewardFn],
  timeout_s: float | None = 5.0,
  max_workers: int | None = None,
  executor: str = "thread",
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """Scores every completion with every term → ({name: float32 [B]}, stats); never raises.

  Each `terms[name](completion, reference)` call that raises, returns a non-finite or
  non-numeric value, or runs longer than `timeout_s` (None: no limit) scores 0.0 and is counted
  in `verifier/errors/<name>` / `verifier/timeouts/<name>` (and the totals `verifier/errors`,
  `verifier/timeouts`). `executor` is 'thread' or 'process' (see the module docstring);
  `max_workers` defaults to the executor's usual size. Bad arguments raise ValueError.
  """
  if len(completions) != len(references):
    raise ValueError(f"{len(completions)} completions but {len(references)} references")
  if executor not in _EXECUTORS:
    raise ValueError(f"executor {executor!r} is not one of {_EXECUTORS}")
  if executor == "process":
    for name, fn in terms.items():
      try:
        pickle.dumps(fn)
      except Exception as e:
        raise ValueError(
          f"reward term {name!r} cannot be pickled ({e}); executor='process' needs top-level "
          "functions (or functools.partial of them)"
        ) from e

  batch = len(completions)
  names = list(terms)
  scores = {name: np.zeros((batch,), np.float32) for name in names}
  errors = dict.fromkeys(names, 0)
  timeouts = dict.fromkeys(names, 0)
  tasks = [(name, i) for name in names for i in range(batch)]
  start = time.monotonic()
  if tasks:
    if executor == "thread":
      workers = max_workers or min(32, (os.cpu_count() or 1) + 4)
    else:
      workers = max_workers or (os.cpu_count() or 1)
    workers = max(1, min(workers, len(tasks)))
    runner = _Runner(completions, references, terms, timeout_s, workers, executor)
    runner.run(tasks, scores, errors, timeouts)

  stats: dict[str, float] = {}
  for name in names:
    stats[f"verifier/errors/{name}"] = errors[name]
    stats[f"verifier/timeouts/{name}"] = timeouts[name]
  stats["verifier/errors"] = sum(errors.values())
  stats["verifier/timeouts"] = sum(timeouts.values())
  stats["verifier/seconds"] = time.monotonic() - start
  return scores, stats


class _Runner:
  """The submit / collect / time-out loop behind `score_batch`."""

  def __init__(self, completions, references, terms, timeout_s, workers, kind):
    self.completions, self.references, self.terms = completions, references, terms
    self.timeout_s, self.workers, self.kind = timeout_s, workers, kind
    self.done: queue.SimpleQueue[int] = queue.SimpleQueue()  # ids of finished calls
    self.next_id = 0

  def _submit_all(self, pool: _Pool, tasks) -> dict[int, tuple[cf.Future, tuple[str, int]]]:
    """Submits (name, index) tasks under fresh call ids; finished ids arrive on `self.done`."""
    pending = {}
    for name, i in tasks:
      call_id = self.next_id
      self.next_id += 1
      fut = pool.submit(call_id, self.terms[name], self.completions[i], self.references[i])
      pending[call_id] = (fut, (name, i))
      fut.add_done_callback(lambda _, c=call_id: self.done.put(c))
    return pending

  def run(self, tasks, scores, errors, timeouts) -> None:
    """Runs every task, filling `scores`, `errors` and `timeouts` in place."""
    timeout_s, kind = self.timeout_s, self.kind
    pool = _Pool(kind, self.workers)
    pending = self._submit_all(pool, tasks)
    started: dict[int, float] = {}  # running call id → when the parent saw it start
    abandoned: list[cf.Future] = []  # timed-out thread calls that are still running
    logged: set[str] = set()
    poll = 0.02 if timeout_s is None else min(0.02, max(timeout_s / 20, 1e-3))
    next_check = time.monotonic() + poll
    try:
      while pending:
        try:
          call_ids = [self.done.get(timeout=max(next_check - time.monotonic(), 0.0))]
          while not self.done.empty():
            call_ids.append(self.done.get())
        except queue.Empty:
          call_ids = []
        for call_id in call_ids:
          if call_id not in pending:  # a call from a pool that was given up
            continue
          fut, (name, i) = pending.pop(call_id)
          started.pop(call_id, None)
          try:
            value = float(fut.result())
            if not math.isfinite(value):
              raise ValueError(f"non-finite reward {value}")
            scores[name][i] = value
          except Exception as e:
            errors[name] += 1
            if name not in logged:
              logged.add(name)
              logger.warning("reward term %r failed on item %d: %r", name, i, e)
        now = time.monotonic()
        if now < next_check:
          continue
        next_check = now + poll
        for call_id in pool.started_calls():
          if call_id in pending:
            started.setdefault(call_id, now)
        if timeout_s is None:
          continue
        expired = [
          c for c, t0 in started.items() if now - t0 > timeout_s and not pending[c][0].done()
        ]
        if not expired:
          continue
        for call_id in expired:
          fut, (name, _) = pending.pop(call_id)
          del started[call_id]
          timeouts[name] += 1
          abandoned.append(fut)
        abandoned = [f for f in abandoned if not f.done()]
        if kind == "process" or len(abandoned) >= self.workers:
          # Processes: kill the hung workers. Threads: every worker is stuck, so start afresh.
          # Either way, whatever has not finished is resubmitted under a fresh clock.
          rest = [task for _, task in pending.values()]
          pool.close(kill=True)
          pool = _Pool(kind, self.workers)
          pending = self._submit_all(pool, rest)
          started.clear()
          abandoned = []
    finally:
      # Hung or interrupted process calls are killed; thread calls are left to finish.
      pool.close(kill=bool(pending or abandoned) or kind == "thread")
