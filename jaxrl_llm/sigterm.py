"""SIGTERM from the entry point's first line: a flag, not a kill.

A scheduler may send SIGTERM while a run starts (imports, the build, a restore) or during its
warm start. `listen`, called before anything heavy is imported, makes the signal set a flag;
the run asks `seen()` at its next safe point and stops in one line (`run.preempt`), saving the
warm start's progress. Standard library only, so it can run first.

While XLA compiles, the main thread is inside one C++ call that may last minutes, and Python runs
no signal handler until it returns. `compiling` covers such a call: the C-level part of Python's
signal handling writes the signal's number to a wakeup socket, a watcher thread reads it, and a
SIGTERM or SIGINT (Ctrl-C) that comes while compiling ends the process at once through the hooks
of `closing` (a checkpointer's saves in flight finish) and `leaving` (the one line, the exit
status 128 + signal). Nothing is lost: while the run holds progress that no checkpoint has yet
(`unsaved`: a warm start's result, the steps since the last save), a compilation is not cut,
and the signal is taken after it, at the run's next safe point, which saves that progress.

The same watcher sets the flag at once whenever SIGTERM comes after `listen`: while the main
thread waits for a running program (inside C++ too), the threads serving the program's host
calls see `seen()` and cut their waits short (a hung host tool's calls are answered with the
error token), so the step ends and is saved within the scheduler's grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

_TERM = {"seen": False}
# What the main thread is compiling (None: nothing), the hooks of a stop during it, and the
# watcher's wakeup socket (made once).
# `stopping`: the watcher thread once it began ending the process (a signal during a compile).
_COMPILE: dict = {
  "what": None,
  "closers": [],
  "leave": None,
  "socket": None,
  "unsaved": False,
  "stopping": None,
}
CLOSE_TIMEOUT_S = 60.0  # the closers' time to finish before the process ends anyway


def _on_term(signum, frame) -> None:
  del signum, frame
  _TERM["seen"] = True


def listen() -> None:
  """SIGTERM sets the flag from now on, also while the main thread is inside a C++ call (main
  thread only; JAX's preemption service, started later in a multi-process job, installs its
  own handler over this one)."""
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_term)
    signal.set_wakeup_fd(_wakeup_socket(), warn_on_full_buffer=False)


def note() -> None:
  """Sets the flag (a handler of the training loop's that took over the signal)."""
  _TERM["seen"] = True


def seen() -> bool:
  """Whether SIGTERM came since `listen`."""
  return _TERM["seen"]


def unsaved(held: bool) -> None:
  """Says whether the run now holds progress that no checkpoint has (see `compiling`)."""
  _COMPILE["unsaved"] = held


def holding() -> bool:
  """Whether the run holds progress that no checkpoint has (as `unsaved` last said)."""
  return _COMPILE["unsaved"]


@contextlib.contextmanager
def compiling(what: str):
  """While inside (XLA compiling `what`, e.g. "the RL step"), SIGTERM or SIGINT ends the process
  at once: the `closing` hooks run, then the `leaving` hook (its line, its exit status; by
  default a line naming `what` and 128 + the signal). Elsewhere than in the main thread, where
  the signal has no Python handler (SIGTERM before `listen`), or while progress is `unsaved`,
  nothing changes."""
  if threading.current_thread() is not threading.main_thread() or _COMPILE["unsaved"]:
    yield
    return
  previous = signal.set_wakeup_fd(_wakeup_socket(), warn_on_full_buffer=False)
  _COMPILE["what"] = what
  try:
    yield
  except KeyboardInterrupt:  # Ctrl-C reached the main thread while it traced (Python code):
    if _claim():  # the same stop as the watcher's, from this thread
      _stop(signal.SIGINT, what)
    wait_for_the_exit()  # the watcher's stop is under way: its exit ends this thread
  finally:
    with _CLAIMING:  # past this, a signal is the main thread's to take, not the watcher's
      _COMPILE["what"] = None
    signal.set_wakeup_fd(previous)


@contextlib.contextmanager
def closing(close):
  """While inside, a stop during `compiling` first calls `close()` (e.g. waits for the saves
  in flight and closes the event files), newest hook first."""
  _COMPILE["closers"].append(close)
  try:
    yield
  finally:
    _COMPILE["closers"].remove(close)


@contextlib.contextmanager
def leaving(leave):
  """While inside, a stop during `compiling` ends through `leave(signum, what)`, which prints
  the stop's line and ends the process (e.g. `os._exit`)."""
  outer, _COMPILE["leave"] = _COMPILE["leave"], leave
  try:
    yield
  finally:
    _COMPILE["leave"] = outer


def _wakeup_socket() -> int:
  """The write end's descriptor of the watcher's socket pair (made, and the watcher started,
  on the first call)."""
  if _COMPILE["socket"] is None:
    read, write = socket.socketpair()
    write.setblocking(False)
    threading.Thread(target=_watch, args=(read,), name="sigterm-compiling", daemon=True).start()
    _COMPILE["socket"] = write
  return _COMPILE["socket"].fileno()


def _watch(read: socket.socket) -> None:
  """The watcher thread: a SIGTERM or SIGINT byte that comes while compiling ends the process;
  another SIGTERM sets the flag (the main thread's handler, when it runs, sets it too); any
  other byte is dropped."""
  while True:
    for signum in read.recv(64):
      what = _COMPILE["what"]
      if what is not None and signum in (signal.SIGTERM, signal.SIGINT):
        if _claim():  # not already stopping on the main thread
          _stop(signum, what)
      elif signum == signal.SIGTERM:
        note()


def wait_for_the_exit() -> None:
  """Waits for ever, a Ctrl-C included, for the stop under way on another thread to end the
  process (a second Ctrl-C must not unwind this thread while that stop's saves finish)."""
  while True:
    try:
      threading.Event().wait()
    except KeyboardInterrupt:
      continue


def stopping_elsewhere() -> bool:
  """Whether the watcher is ending the process (a signal came while compiling) from another
  thread than the caller's: the caller must not say a stop of its own (the compilation may
  have ended while the closers ran, and Ctrl-C's KeyboardInterrupt or the flag's safe point
  reached the main thread) but wait for the watcher's line and exit."""
  return _COMPILE["stopping"] not in (None, threading.get_ident())


_CLAIMING = threading.Lock()


def _claim() -> bool:
  """Makes the calling thread the one that stops (`_COMPILE["stopping"]`), unless one already
  is or the compilation has ended: False then. Under a lock, so that a Ctrl-C reaching both
  threads starts one stop, and a main thread past `compiling` stops on its own."""
  with _CLAIMING:
    if _COMPILE["stopping"] is not None or _COMPILE["what"] is None:
      return False
    _COMPILE["stopping"] = threading.get_ident()  # the stop's line is this thread's
    return True


def _stop(signum: int, what: str) -> None:
  """Runs the closers (for at most `CLOSE_TIMEOUT_S`), then leaves, by 128 + the signal even
  where the leaving hook fails (a closed stderr: `| tee` ended by the same Ctrl-C), since the
  other threads wait for this one's exit (`stopping_elsewhere`). The caller has `_claim`ed it."""
  try:  # all of it: a second Ctrl-C at any point still ends in the exit below
    leave = _COMPILE["leave"] or _leave  # in force at the signal (the main thread may leave it)
    if signum == signal.SIGTERM:
      note()

    closed = threading.Event()  # not Thread.join: a join a Ctrl-C cuts may say the thread ended

    def close_all():
      for close in reversed(list(_COMPILE["closers"])):
        try:
          close()
        except Exception as e:  # the stop goes on; the reason is printed
          print(f"warning: while stopping: {type(e).__name__}: {e}", file=sys.stderr)
      closed.set()

    threading.Thread(target=close_all, daemon=True).start()
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    while not closed.is_set() and time.monotonic() < deadline:
      try:
        closed.wait(deadline - time.monotonic())
      except KeyboardInterrupt:  # a second Ctrl-C (this is the main thread): the saves finish
        continue
    leave(signum, what)
  except BaseException as e:  # said where it still can be; the exit follows regardless
    with contextlib.suppress(BaseException):
      print(f"error: while stopping: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
  finally:
    os._exit(128 + signum)  # a hook that returned, or failed


def _leave(signum: int, what: str) -> None:
  """The default stop during compilation: one line, exit status 128 + the signal."""
  name = "SIGTERM" if signum == signal.SIGTERM else "SIGINT (Ctrl-C)"
  print(f"stopped by {name} while compiling {what}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(128 + signum)
