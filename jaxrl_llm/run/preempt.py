"""SIGTERM as a preemption notice: the loop saves the step it has just finished and stops.

A scheduler (Slurm, Kubernetes, a TPU or GPU VM being preempted) sends SIGTERM some seconds
before it kills the job. `Preemption` records the signal (the handler only sets a flag, so a
save in flight completes); the loop asks `requested(step)` after each RL step, saves that step
at once and raises `Preempted`, which the command line reports in one line (exit status 143).
With several processes they must stop at the same step: there the question goes to JAX's
preemption sync point (the coordination service learns of a SIGTERM sent to any process),
and to the local flag where that service is not running.

SIGINT (Ctrl-C) raises KeyboardInterrupt as usual (`CtrlC`), and again after the step when a
library swallowed it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from jaxrl_llm import sigterm
from jaxrl_llm.checkpoint_manifest import COMMIT_FILE


class Preempted(Exception):
  """The run stopped on SIGTERM after saving `step` (relaunching the command resumes it);
  `said` replaces the message (a stop before the first RL step)."""

  def __init__(self, step: int, directory: str, said: str = ""):
    super().__init__(
      said
      or f"stopped by SIGTERM after step {step}: checkpoint {step} is saved in {directory}; "
      "relaunch the same command to resume"
    )
    self.step = step


def none_saved(directory: str) -> bool:
  """Whether `directory` is a local run folder with no committed step (one holding orbax's commit
  marker), of the run or of its warm start (`sft/checkpoints`); a remote one, or one that
  cannot be listed, counts as having some."""
  if "://" in directory:
    return False
  for folder in ("checkpoints", os.path.join("sft", "checkpoints")):
    steps = os.path.join(directory, folder)
    try:
      if any(
        name.isdigit() and os.path.exists(os.path.join(steps, name, COMMIT_FILE))
        for name in os.listdir(steps)
      ):
        return False
    except FileNotFoundError:
      continue
    except OSError:
      return False
  return True


def kept(directory: str) -> str:
  """The end of a SIGTERM's stop line for a run whose checkpoints are in `directory`: that they
  are kept and resume, or (a local folder with no committed step) that none was saved yet."""
  if none_saved(directory):
    return f"no checkpoint was saved yet in {directory}; relaunch the same command to start"
  return f"the checkpoints in {directory} are kept; relaunch the same command to resume"


def sigint_line(workdir: str, what: str | None = None, every_process: bool = False) -> str:
  """Ctrl-C's stop line: what was compiling, if anything, and that the committed checkpoints
  are intact, or that none was saved yet (`every_process`: the relaunch is a job's)."""
  every = " on every process" if every_process else ""
  during = f"stopped by SIGINT (Ctrl-C){' while compiling ' + what if what else ''}"
  if none_saved(workdir):
    where = f"no checkpoint was saved yet in {workdir}"
    return f"{during}: {where}; relaunch the same command{every} to start"
  return (
    f"{during}: the checkpoints committed before it are intact in {workdir}; relaunch the same "
    f"command{every} to resume"
  )


def stop_if_asked(where: str, directory: str, step: int = 0, settle=None) -> None:
  """Raises `Preempted` saying the run stopped `where` (nothing more to save) when SIGTERM
  came since `sigterm.listen`; `settle()` first (e.g. waiting for a save in flight, so that
  the line can say it is kept)."""
  if sigterm.seen():
    if settle is not None:
      settle()
    raise Preempted(
      step,
      directory,
      f"stopped by SIGTERM {where}: {kept(directory)}",
    )


class _SignalFlag:
  """Context manager: signal `signum` (a subclass's) sets `signalled` (main thread only;
  elsewhere nothing is installed)."""

  signum: signal.Signals

  def __init__(self):
    self.signalled = False
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(self.signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(self.signum, self._previous)

  def _handle(self, signum, frame) -> None:
    del signum, frame
    self.signalled = True
    if self.signum == signal.SIGTERM:
      sigterm.note()


class CtrlC(_SignalFlag):
  """SIGINT raises KeyboardInterrupt where the main thread is, as Python's own handler does,
  and is remembered: the loop raises it again after the step (`check`) when it was lost (Python
  drops an exception raised in a finalizer or a gc callback, and some libraries catch every
  exception; a Ctrl-C lost there let the run go on to its last step and exit 0)."""

  signum = signal.SIGINT

  def __enter__(self):
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a background job: leave it so
      return self
    super().__enter__()
    if self._previous is not None:  # installed (main thread): `__exit__` puts the hook back
      self._unraisable = sys.unraisablehook
      sys.unraisablehook = self._unraisable_hook
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      sys.unraisablehook = self._unraisable
    super().__exit__(*exc)

  def _unraisable_hook(self, unraisable) -> None:
    """Passes on what Python could not raise, except the KeyboardInterrupt of a Ctrl-C that
    `check` raises again: the run's last line says it stopped, without a traceback."""
    if not (self.signalled and isinstance(unraisable.exc_value, KeyboardInterrupt)):
      self._unraisable(unraisable)

  def _handle(self, signum, frame) -> None:
    self.signalled = True
    signal.default_int_handler(signum, frame)

  def check(self) -> None:
    """Raises KeyboardInterrupt if SIGINT came since `__enter__`."""
    if self.signalled:
      raise KeyboardInterrupt


class Preemption(_SignalFlag):
  """Context manager: SIGTERM sets a flag (main thread only; elsewhere nothing is installed).
  In a multi-process job with JAX's preemption service nothing is installed either: the
  service's own SIGTERM handler tells the coordination service, which a handler of ours would
  replace (the processes then never learn of the signal and train on)."""

  signum = signal.SIGTERM

  def __enter__(self):
    self.service = _preemption_service()
    if not self.service:
      super().__enter__()
    return self

  def requested(self, step: int) -> bool:
    """Whether to stop after `step`: the same answer on every process."""
    if self.service:
      from jax.experimental import multihost_utils

      return bool(multihost_utils.reached_preemption_sync_point(step))
    return self.signalled or sigterm.seen()


def _preemption_service() -> bool:
  """Whether this is a multi-process job with JAX's preemption service (on by default)."""
  import jax

  if jax.process_count() < 2 or not jax.distributed.is_initialized():
    return False
  return bool(jax.config.jax_enable_preemption_service)


class StopSignals:
  """Context manager around a training loop: `Preemption` (SIGTERM) and `CtrlC` (SIGINT)."""

  def __enter__(self):
    self.preemption, self.ctrl_c = Preemption().__enter__(), CtrlC().__enter__()
    return self

  def __exit__(self, *exc) -> None:
    self.ctrl_c.__exit__(*exc)
    self.preemption.__exit__(*exc)

  def after_step(self, done: int, end: int, ckpt, stored, **save) -> None:
    """After step `done` of a loop ending at `end`: KeyboardInterrupt after a Ctrl-C; after a
    SIGTERM (unless `done` is the last step, saved anyway) saves `stored` as step `done` in
    `ckpt` (`save`: its data iterator and meta), waits for the save and raises `Preempted`."""
    self.ctrl_c.check()
    if self.preemption.requested(done) and done < end:
      ckpt.save(done, stored, force=True, **save)
      ckpt.wait()
      raise Preempted(done, str(ckpt.directory))
