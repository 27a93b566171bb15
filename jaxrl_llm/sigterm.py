"""SIGTERM from the entry point's first line: a flag, not a kill.

A scheduler may send SIGTERM while a run starts (imports, the build, a restore) or during its
warm start. `listen`, called before anything heavy is imported, makes the signal set a flag;
the run asks `seen()` at its next safe point and stops in one line (`run.preempt`), saving the
warm start's progress. Standard library only, so it can run first.
"""

from __future__ import annotations

import signal
import threading

_TERM = {"seen": False}


def _on_term(signum, frame) -> None:
  del signum, frame
  _TERM["seen"] = True


def listen() -> None:
  """SIGTERM sets the flag from now on (main thread only; JAX's preemption service, started
  later in a multi-process job, installs its own handler over this one)."""
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_term)


def note() -> None:
  """Sets the flag (a handler of the training loop's that took over the signal)."""
  _TERM["seen"] = True


def seen() -> bool:
  """Whether SIGTERM came since `listen`."""
  return _TERM["seen"]
