"""What runs inside a verifier worker (`scoring`'s process pool, or its threads): the calls
themselves, each failure turned into a short error text, and the worker's start-up (its
signals, and its end with the trainer), with what a process worker can receive
(`unpicklable`) and the fork server it starts from (`process_context`)."""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import pickle
import signal
import sys
import threading
import types
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


def process_context():
  """The forkserver context (spawn where there is none), preloading what workers import.

  A forkserver worker runs the parent's `__main__` again (as `__mp_main__`) before its first
  call, and so imports what it imports. When this process's fork server has not started yet,
  this module and, where the worker will run the main module again, every module of this
  package the process has loaded (the trainer's bring jax) join the server's preload list, the
  main module itself excepted (its body runs again in each worker and would define its flags
  twice). A worker then starts in milliseconds, which matters when a pool is replaced after a
  timeout or a worker's death: each replacement took 1.2 s, 43 s a step for a host tool that
  ends its worker. The list's own `__main__` entry does not do this: the fork server looks
  for a `main_path` its preparation data never holds (CPython 3.11 and 3.12).
  """
  if "forkserver" not in multiprocessing.get_all_start_methods():
    return multiprocessing.get_context("spawn")
  ctx = multiprocessing.get_context("forkserver")
  server = getattr(forkserver, "_forkserver", None)
  if server is not None and getattr(server, "_forkserver_pid", 0) is None:  # not started
    preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
    main_module = sys.modules.get("__main__")
    main = getattr(getattr(main_module, "__spec__", None), "name", None)
    if main is None:  # a script's main runs again in a worker, interactive input does not
      rerun = hasattr(main_module, "__file__")
    else:  # `python -m M` runs again, `M/__main__.py` (pytest's) does not
      rerun = main != "__main__" and not main.endswith(".__main__")
    package = __name__.split(".")[0]
    ours = [n for n in list(sys.modules) if n == package or n.startswith(package + ".")]
    loaded = sorted(n for n in ours if n != main) if rerun else []
    wanted = [name for name in [*loaded, __name__] if name not in preload]
    if wanted:
      ctx.set_forkserver_preload([*preload, *dict.fromkeys(wanted)])
  return ctx


def unpicklable(fn: RewardFn) -> str | None:
  """Why the worker processes could not receive `fn` (pickle's words), or None. A function is
  pickled by reference, which resolves only once the module defining it has run (a decorator
  runs before), so its qualified name and module are checked instead of pickling it."""
  if isinstance(fn, types.FunctionType):
    if "<" in fn.__qualname__:  # <lambda>, or a function nested in another's <locals>
      return f"{fn.__qualname__} is not a module-level function"
    if fn.__module__ not in sys.modules:  # e.g. defined in the config file itself
      return f"its module {fn.__module__!r} cannot be imported"
    return None
  try:
    pickle.dumps(fn)
  except Exception as e:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
  return None
