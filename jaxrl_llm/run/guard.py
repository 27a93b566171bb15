"""The loop's guards. Non-finite: skipped optimiser updates are counted, and a run of them stops
the run before any non-finite state is saved. Verifiers: a host reward term failing on every
call for several steps in a row stops the run before the step is saved."""

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
    self.consecutive = self.total = self.updates = 0
    self.last_finite: dict[str, float] = {}

  def update(self, step: int, skipped: int, updates: int) -> None:
    """Adds one step's `skipped` of its `updates`; raises once `limit` in a row were skipped."""
    self.total, self.updates = self.total + skipped, self.updates + updates
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

  def any_applied(self, span: tuple[int, int], prefix: str = "") -> None:
    """Raises NonFiniteError when every optimiser update of steps `span` (this invocation's:
    first, last) was skipped: a run that learned nothing does not end as if it had."""
    if self.updates and self.total == self.updates:
      raise NonFiniteError(
        f"{prefix}{self.phase} steps {span[0] + 1}..{span[1]}: all {self.updates} optimiser "
        "updates had a non-finite loss, gradient or update and were skipped, so nothing was "
        "learned; the checkpoints hold the last finite state. Lower the learning rate, keep "
        "optim.grad_clip > 0, or check the model's and the sampler's settings"
      )

  def finite_metrics(self, scalars: dict[str, float]) -> None:
    """Remembers `scalars` of a logged step if they are all finite (shown when stopping)."""
    if all(np.isfinite(v) for v in scalars.values()):
      self.last_finite = dict(scalars)


class VerifierError(RuntimeError):
  """The run stopped: a host reward term failed on every call for too many steps in a row."""


class VerifierGuard:
  """Stops the run (VerifierError) once a host reward term has failed (raised, returned no
  finite number, or timed out) on every one of a step's `calls` completions for `limit` steps
  in a row: its reward was 0 throughout, so nothing was learned from it. `limit` 0: never.
  `prefix` starts the message (a packed run's name)."""

  def __init__(self, limit: int, calls: int, timeout_s: float, prefix: str = ""):
    self.limit, self.calls, self.timeout_s, self.prefix = limit, calls, timeout_s, prefix
    self.streak: dict[str, int] = {}

  def update(self, step: int, metrics) -> None:
    """Adds one step's verifier counts (`verifier/errors/<term>`, `verifier/timeouts/<term>`;
    none on the in-graph path); raises once a term's streak reaches `limit`."""
    prefix = "verifier/errors/"
    for name in [k[len(prefix) :] for k in metrics if k.startswith(prefix)]:
      errors = int(metrics[prefix + name])
      timeouts = int(metrics[f"verifier/timeouts/{name}"])
      whole = errors + timeouts >= self.calls
      self.streak[name] = self.streak.get(name, 0) + 1 if whole else 0
      if self.limit and self.streak[name] >= self.limit:
        raise VerifierError(
          f"{self.prefix}rl step {step}: reward term {name!r} failed on all {self.calls} completions in "
          f"each of the last {self.streak[name]} steps (train.max_failed_verifier_steps="
          f"{self.limit}; this step: {errors} errors, {timeouts} timeouts past "
          f"data.verifier_timeout_s={self.timeout_s:g}), so it rewarded nothing; its first "
          "error is logged above. Checkpoints saved so far are kept. Fix the verifier (or the "
          "package it needs), raise data.verifier_timeout_s, or set "
          "train.max_failed_verifier_steps=0 to train on regardless"
        )
