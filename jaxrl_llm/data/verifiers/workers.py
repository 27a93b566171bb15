"""What runs inside a verifier worker (`scoring`'s process pool, or its threads): the calls
themselves, each failure turned into a short error text, and the worker's start-up (its
signals, and its end with the trainer)."""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Sequence

import numpy as np

from jaxrl_llm.data.verifiers.rewards import RewardFn

_EVENTS = None  # in a process-pool worker: the queue that reports pids and call starts


def init_worker(events) -> None:
  """Process-pool initializer: keeps the event queue and reports this worker's pid. SIGTERM
  ends a worker, whatever handler the process it was forked from had (a trainer's is a flag);
  Ctrl-C is the trainer's to take (it kills its workers), so a KeyboardInterrupt in a worker is
  a call's own failure; and a worker dies with the fork server that started it, which ends with
  the trainer (a hung call outlived a trainer killed with SIGKILL; `leave_fork_server`)."""
  global _EVENTS
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  die_with_parent()
  leave_fork_server()
  _EVENTS = events
  events.put(("pid", os.getpid()))


def leave_fork_server() -> None:
  """Closes this worker's copy of the fork server's keep-alive pipe, which a forkserver child
  inherits so that the server outlives its parent while children live: a hung call then kept
  the server, and so itself (`die_with_parent`), alive after the trainer was killed. Without
  the copy the server ends with the trainer, and its workers with it."""
  import multiprocessing.forkserver as forkserver

  server = getattr(forkserver, "_forkserver", None)
  fd = getattr(server, "_forkserver_alive_fd", None)
  if fd is not None:
    server._forkserver_alive_fd = None
    try:
      os.close(fd)
    except OSError:
      pass


def die_with_parent() -> None:
  """Linux: this process gets SIGKILL when its parent ends (prctl PR_SET_PDEATHSIG)."""
  try:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux
    pass


_ERROR_CHARS = 500  # most characters of a call's error kept (a 10 MB message slowed the run)


def said(e: BaseException) -> str:
  """`repr(e)`, cut to `_ERROR_CHARS` characters."""
  text = repr(e)
  if len(text) <= _ERROR_CHARS:
    return text
  return f"{text[:_ERROR_CHARS]}... ({len(text)} characters)"


Call = tuple[int, RewardFn, str, str]  # (call id, term, completion, reference)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def run_calls(events, calls: Sequence[Call]) -> list[tuple[int, float, str | None]]:
  """Runs calls in order, reporting each start on `events` → [(call id, value, error or None)].

  A call that raises or returns a non-numeric value (a string included) or one that is not
  finite in float32 (the rewards' dtype) gets value 0.0 and the error's repr (a string, so the
  list always pickles).
  """
  out = []
  for call_id, fn, completion, reference in calls:
    events.put(("start", call_id))
    try:
      raw = fn(completion, reference)
      if isinstance(raw, str | bytes):
        raise TypeError(f"reward {raw!r} is a string; return a number")
      value = float(raw)
      if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
        raise ValueError(f"reward {value} is not a finite float32")
      out.append((call_id, value, None))
    except (Exception, SystemExit) as e:  # sys.exit() in a verifier fails; the worker goes on
      out.append((call_id, 0.0, said(e)))
    except KeyboardInterrupt as e:  # the user's Ctrl-C reaches the main thread of the trainer
      if _EVENTS is None and threading.current_thread() is threading.main_thread():
        raise
      out.append((call_id, 0.0, said(e)))  # a call's own, in a worker
  return out


def calls_in_process(calls: Sequence[Call]) -> list[tuple[int, float, str | None]]:
  """`run_calls` in a process worker (its calls are unpickled before the first start)."""
  return run_calls(_EVENTS, calls)
