"""The studies' statistics: bootstrap 95% intervals of a mean over seeds, paired differences
between arms that share seeds, and the verdict word an interval supports.

Intervals come from `scipy.stats.bootstrap` (BCa, 9,999 resamples, a fixed generator so a table
is reproduced exactly from the same per-seed values). An arm whose seeds all gave one value
has that value as its interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
RESAMPLES = 9_999


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean over seeds and its bootstrap interval."""

  mean: float
  low: float
  high: float
  n: int

  def excludes_zero(self) -> int:
    """+1 if the whole interval is above 0, -1 if below, 0 if it holds 0."""
    return 1 if self.low > 0 else -1 if self.high < 0 else 0

  def __str__(self) -> str:
    return f"{fmt(self.mean)} [{fmt(self.low)}, {fmt(self.high)}]"


def interval(values: Sequence[float], seed: int = 0) -> Interval:
  """The mean of `values` (one per seed) with its 95% BCa bootstrap interval."""
  x = np.asarray([v for v in values if v is not None and np.isfinite(v)], np.float64)
  if x.size == 0:
    return Interval(float("nan"), float("nan"), float("nan"), 0)
  mean = float(x.mean())
  if x.size == 1 or np.ptp(x) == 0:
    return Interval(mean, mean, mean, int(x.size))
  res = stats.bootstrap(
    (x,),
    np.mean,
    confidence_level=CONFIDENCE,
    n_resamples=RESAMPLES,
    method="BCa",
    rng=np.random.default_rng(seed),
  )
  low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
  if not (np.isfinite(low) and np.isfinite(high)):  # BCa degenerates on a few distinct values
    low, high = np.percentile(res.bootstrap_distribution, [2.5, 97.5]).tolist()
  return Interval(mean, low, high, int(x.size))


def paired_difference(arm: dict[int, float], base: dict[int, float], seed: int = 0) -> Interval:
  """arm - base over the seeds both have (each a {seed: value}), with its interval."""
  shared = sorted(set(arm) & set(base))
  return interval([arm[s] - base[s] for s in shared], seed)


def verdict(difference: Interval, expected: int) -> str:
  """The word a difference's interval supports for a claim that expects its sign `expected`
  (+1: the arm is higher than the baseline; -1: lower)."""
  side = difference.excludes_zero()
  if side == 0:
    return "inconclusive"
  return "reproduced" if side == expected else "refuted"


def fmt(x: float) -> str:
  """A table cell: 3 decimals, 1 at 10 or more, exponent form below 1e-3 or from 1000."""
  if not np.isfinite(x):
    return "-"
  a = abs(x)
  if a == 0:
    return "0"
  if a >= 1000 or a < 1e-3:
    return f"{x:.2e}"
  return f"{x:.3f}" if a < 10 else f"{x:.1f}"
