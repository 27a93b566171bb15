"""SIGTERM as a preemption notice: the loop saves the step it has just finished and stops.

A scheduler (Slurm, Kubernetes, a TPU or GPU VM being preempted) sends SIGTERM some seconds
before it kills the job. `Preemption` records the signal (the handler only sets a flag, so a
save in flight completes); the loop asks `requested(step)` after each RL step, saves that step
at once and raises `Preempted`, which the command line reports in one line (exit status 143).
With several processes they must stop at the same step: there the question goes to JAX's
preemption sync point (the coordination service learns of a SIGTERM sent to any process),
and to the local flag where that service is not running.
"""

from __future__ import annotations

import signal
import threading


class Preempted(Exception):
  """The run stopped on SIGTERM after saving `step` (relaunching the command resumes it)."""

  def __init__(self, step: int, directory: str):
    super().__init__(
      f"stopped by SIGTERM after step {step}: checkpoint {step} is saved in {directory}; "
      "relaunch the same command to resume"
    )
    self.step = step


class Preemption:
  """Context manager: SIGTERM sets a flag (main thread only; elsewhere nothing is installed)."""

  def __init__(self):
    self.signalled = False
    self._previous = None

  def __enter__(self) -> Preemption:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def _handle(self, signum, frame) -> None:
    del signum, frame
    self.signalled = True

  def requested(self, step: int) -> bool:
    """Whether to stop after `step`: the same answer on every process."""
    import jax

    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
      except Exception:  # no preemption service: the local flag (single-host semantics)
        return self.signalled
    return self.signalled
