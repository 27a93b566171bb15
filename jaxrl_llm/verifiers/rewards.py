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
    fresh clock. Terms and their inputs must be picklable (top-level functions, or
    `functools.partial` of them). A call's clock starts when the pool hands it to its workers.
  * an `concurrent.futures.Executor` instance: used as is (thread semantics) and not shut down.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import multiprocessing
import os
import pickle
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


def _record_pid(queue) -> None:
  """Process-pool initializer: tells the parent this worker's pid (so it can be killed)."""
  queue.put(os.getpid())


class _Pool:
  """One executor plus what is needed to abandon (threads) or kill (processes) it."""

  def __init__(self, kind: str, max_workers: int):
    self.kind = kind
    self._pids_queue = None
    if kind == "thread":
      self.executor = cf.ThreadPoolExecutor(max_workers, thread_name_prefix="verifier")
    else:
      methods = multiprocessing.get_all_start_methods()
      ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
      self._pids_queue = ctx.SimpleQueue()
      self.executor = cf.ProcessPoolExecutor(
        max_workers, mp_context=ctx, initializer=_record_pid, initargs=(self._pids_queue,)
      )

  def kill(self) -> None:
    """Kills every worker process (process pools) and shuts the executor down without waiting."""
    if self._pids_queue is not None:
      self.executor.shutdown(wait=False, cancel_futures=True)
      while not self._pids_queue.empty():
        pid = self._pids_queue.get()
        try:
          os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
        except (ProcessLookupError, PermissionError, OSError):
          pass
    else:
      self.executor.shutdown(wait=False, cancel_futures=True)


def _call(fn: RewardFn, completion: str, reference: str) -> float:
  """Runs one verifier call (in a worker)."""
  return fn(completion, reference)


def score_batch(
  completions: Sequence[str],
  references: Sequence[str],
  *,
  terms: Mapping[str, RewardFn],
  timeout_s: float | None = 5.0,
  max_workers: int | None = None,
  executor: str | cf.Executor = "thread",
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """Scores every completion with every term → ({name: float32 [B]}, stats); never raises.

  Each `terms[name](completion, reference)` call that raises, returns a non-finite or
  non-numeric value, or runs longer than `timeout_s` (None: no limit) scores 0.0 and is counted
  in `verifier/errors/<name>` / `verifier/timeouts/<name>` (and the totals `verifier/errors`,
  `verifier/timeouts`). See the module docstring for the executors.
  """
  if len(completions) != len(references):
    raise ValueError(f"{len(completions)} completions but {len(references)} references")
  if isinstance(executor, str) and executor not in _EXECUTORS:
    raise ValueError(f"executor {executor!r} is not one of {_EXECUTORS} or an Executor")
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
    if isinstance(executor, cf.Executor):
      workers = max_workers or len(tasks)  # only used to size pools this function owns
    elif executor == "thread":
      workers = max_workers or min(32, (os.cpu_count() or 1) + 4)
    else:
      workers = max_workers or (os.cpu_count() or 1)
    workers = max(1, min(workers, len(tasks)))
    _run_tasks(
      tasks, completions, references, terms, timeout_s, workers, executor, scores, errors, timeouts
    )

  stats: dict[str, float] = {}
  for name in names:
    stats[f"verifier/errors/{name}"] = errors[name]
    stats[f"verifier/timeouts/{name}"] = timeouts[name]
  stats["verifier/errors"] = sum(errors.values())
  stats["verifier/timeouts"] = sum(timeouts.values())
  stats["verifier/seconds"] = time.monotonic() - start
  return scores, stats


def _run_tasks(
  tasks, completions, references, terms, timeout_s, workers, executor, scores, errors, timeouts
) -> None:
  """Submits, polls and collects (name, index) tasks, filling scores/errors/timeouts in place."""
  owned = isinstance(executor, str)
  kind = executor if owned else "thread"
  pool = _Pool(kind, workers) if owned else None
  ex = pool.executor if owned else executor
  logged: set[str] = set()

  def submit(task):
    name, i = task
    return ex.submit(_call, terms[name], completions[i], references[i])

  pending: dict[cf.Future, tuple[str, int]] = {submit(t): t for t in tasks}
  started: dict[cf.Future, float] = {}
  abandoned: list[cf.Future] = []  # timed-out thread calls still running
  poll = 0.01 if timeout_s is None else min(0.01, max(timeout_s / 20, 1e-3))
  try:
    while pending:
      done, _ = cf.wait(pending, timeout=poll, return_when=cf.FIRST_COMPLETED)
      for fut in done:
        name, i = pending.pop(fut)
        started.pop(fut, None)
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
      if timeout_s is None:
        continue
      now = time.monotonic()
      expired = []
      for fut in pending:
        if fut.running():
          t0 = started.setdefault(fut, now)
          if now - t0 > timeout_s:
            expired.append(fut)
      if not expired:
        continue
      for fut in expired:
        name, _ = pending.pop(fut)
        started.pop(fut, None)
        timeouts[name] += 1
        abandoned.append(fut)
      abandoned = [f for f in abandoned if not f.done()]
      if not owned:
        continue
      if kind == "process" or len(abandoned) >= workers:
        # Processes: kill the hung workers. Threads: every worker is stuck, so start afresh.
        # Either way, whatever has not finished is resubmitted with a fresh clock.
        rest = list(pending.values())
        pool.kill()
        pool = _Pool(kind, workers)
        ex = pool.executor
        abandoned = []
        started.clear()
        pending = {submit(t): t for t in rest}
  finally:
    if owned:
      if kind == "process" and not pending:
        pool.executor.shutdown(wait=True)
      else:  # hung or interrupted process calls are killed; threads are left to finish
        pool.kill()
