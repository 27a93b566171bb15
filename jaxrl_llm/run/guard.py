"""The non-finite guard of the loop: skipped optimiser updates are counted, and a run of them
stops the run before any non-finite state is saved."""

from __future__ import annotations

import numpy as np
from absl import logging


class NonFiniteError(RuntimeError):
  """The run stopped: too many consecutive optimiser updates were non-finite."""


class SkipGuard:
  """Counts optimiser updates the step skipped for a non-finite loss, gradient or update, and
  stops the run (NonFiniteError) after `limit` consecutive ones."""

  def __init__(self, limit: int, phase: str):
    self.limit, self.phase = limit, phase
    self.consecutive = self.total = 0
    self.last_finite: dict[str, float] = {}

  def update(self, step: int, skipped: int, updates: int) -> None:
    """Adds one step's `skipped` of its `updates`; raises once `limit` in a row were skipped."""
    self.total += skipped
    self.consecutive = self.consecutive + skipped if skipped == updates else skipped
    if skipped:
      logging.warning(
        "%s step %d: %d of %d optimiser updates skipped (non-finite loss, gradient or update)",
        self.phase,
        step,
        skipped,
        updates,
      )
    if self.consecutive >= self.limit:
      shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(self.last_finite.items())[:12])
      raise NonFiniteError(
        f"{self.phase} step {step}: {self.consecutive} consecutive optimiser updates had a "
        f"non-finite loss, gradient or update and were skipped (train.max_skipped_updates="
        f"{self.limit}); parameters and optimiser state are those of the last finite update "
        f"and no non-finite state was saved. Last finite metrics: {shown or 'none logged'}. "
        "Lower the learning rate, keep optim.grad_clip > 0, or use float32 parameters."
      )

  def finite_metrics(self, scalars: dict[str, float]) -> None:
    """Remembers `scalars` of a logged step if they are all finite (shown when stopping)."""
    if all(np.isfinite(v) for v in scalars.values()):
      self.last_finite = dict(scalars)
