"""The studies' statistics: 95% intervals of a mean over seeds, paired differences between arms
that share seeds, their p-values, and the verdict words they support.

An interval is Student's t interval of the mean, mean ± t_{0.975, n-1} · s / √n with s the
sample standard deviation (ddof=1): exact for normal per-seed values and close for the bounded,
mildly skewed ones the studies report (accuracies, rewards). tests/test_study_stats.py measures
its coverage by simulation at n = 8 and n = 32 seeds on a normal, an accuracy-like binomial
proportion and a Beta(2, 5) (a strongly skewed metric, e.g. exponential, would cover less: about
0.89 at 8 seeds). It replaced a BCa bootstrap, which covered only ~0.85-0.90 at 8 seeds.
Below `MIN_SEEDS` seeds no interval is claimed (low and high are NaN and a table cell says so);
an arm whose seeds all gave one value has that value as its interval.

A paired difference (`paired_test`) has the t interval of the per-seed differences and the
two-sided one-sample t-test's p-value. A paired count (`paired_count_test`: how many seeds of
each arm end at or below a threshold, e.g. a collapse onto a trivial answer) has the exact
McNemar test's p-value: the two-sided binomial test of the discordant seeds. `verdicts` words a
study's claims as one family: a claim is "reproduced" or "refuted" only when Holm–Bonferroni
(`holm`, family-wise alpha 0.05) rejects a zero difference over every claim passed in together,
else "inconclusive". `verdict` words a single claim from its interval alone, uncorrected.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
ALPHA = 1 - CONFIDENCE  # family-wise error rate of `holm` and `verdicts`
MIN_SEEDS = 3  # fewer seeds: a mean but no interval, and no verdict
TOO_FEW = "too few seeds"


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean over seeds and its t interval (low and high NaN with fewer than `MIN_SEEDS`)."""

  mean: float
  low: float
  high: float
  n: int

  def excludes_zero(self) -> int:
    """+1 if the whole interval is above 0, -1 if below, 0 if it holds 0 or there is none."""
    return 1 if self.low > 0 else -1 if self.high < 0 else 0

  def __str__(self) -> str:
    if self.n == 0:
      return f"{fmt(self.mean)} [{fmt(self.low)}, {fmt(self.high)}]"  # "- [-, -]": no values
    if self.n < MIN_SEEDS:
      return f"{fmt(self.mean)} (n={self.n}: too few seeds for an interval)"
    return f"{fmt(self.mean)} [{fmt(self.low)}, {fmt(self.high)}]"


def t_intervals(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(mean, low, high) of the 95% t interval over the last axis of `samples` (n >= 2 values
  each): vectorized, for `interval` and for simulating its coverage."""
  x = np.asarray(samples, np.float64)
  n = x.shape[-1]
  mean = x.mean(axis=-1)
  half = stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) * x.std(axis=-1, ddof=1) / math.sqrt(n)
  return mean, mean - half, mean + half


def interval(values: Sequence[float], seed: int = 0) -> Interval:
  """The mean of `values` (one per seed; None and non-finite ones dropped) with its 95% t
  interval. `seed` is accepted for callers of the bootstrap this replaced, and unused."""
  del seed
  x = np.asarray([v for v in values if v is not None and np.isfinite(v)], np.float64)
  n = int(x.size)
  if n == 0:
    return Interval(float("nan"), float("nan"), float("nan"), 0)
  mean = float(x.mean())
  if n < MIN_SEEDS:
    return Interval(mean, float("nan"), float("nan"), n)
  if np.ptp(x) == 0:
    return Interval(mean, mean, mean, n)
  _, low, high = t_intervals(x)
  return Interval(mean, float(low), float(high), n)


def _finite(v: float | None) -> bool:
  """Whether `v` is a value a statistic counts (not None, NaN or infinite)."""
  return v is not None and bool(np.isfinite(v))


def _paired(arm: dict[int, float], base: dict[int, float]) -> list[float]:
  return [arm[s] - base[s] for s in sorted(set(arm) & set(base))]


def paired_difference(arm: dict[int, float], base: dict[int, float], seed: int = 0) -> Interval:
  """arm - base over the seeds both have (each a {seed: value}), with its interval."""
  return interval(_paired(arm, base), seed)


def paired_test(arm: dict[int, float], base: dict[int, float]) -> tuple[Interval, float]:
  """arm - base over the seeds both have: its t interval and the two-sided one-sample t-test's
  p-value of a zero mean difference (1.0 with fewer than `MIN_SEEDS` seeds or all differences
  0; 0.0 when all differences are one nonzero value, whose interval is that value)."""
  diffs = _paired(arm, base)
  diff = interval(diffs)
  x = np.asarray([d for d in diffs if d is not None and np.isfinite(d)], np.float64)
  if diff.n < MIN_SEEDS or not np.any(x):
    return diff, 1.0
  if np.ptp(x) == 0:
    return diff, 0.0
  return diff, float(stats.ttest_1samp(x, 0.0).pvalue)


@dataclasses.dataclass(frozen=True)
class Count:
  """How many of `n` paired seeds end at or below a threshold in arm a and in arm b, and how
  many seeds are discordant each way (`only_a`: a at or below, b above; `only_b`: the reverse)."""

  a: int
  b: int
  n: int
  only_a: int
  only_b: int

  @property
  def mean(self) -> float:
    """The difference of the two shares, a − b (NaN without seeds)."""
    return (self.a - self.b) / self.n if self.n else float("nan")

  def __str__(self) -> str:
    return (
      f"{fmt(self.mean)} ({self.a} − {self.b} of {self.n} seeds; discordant "
      f"{self.only_a}:{self.only_b}, exact McNemar)"
    )


def paired_count_test(
  arm: dict[int, float], base: dict[int, float], at_most: float
) -> tuple[Count, float]:
  """The seeds both arms have (each a {seed: value}; a seed with a None or non-finite value in
  either arm dropped, as `paired_test` drops it) whose value is at most `at_most`, counted per
  arm, and the exact McNemar test's two-sided p-value of equal shares: a binomial test at 1/2 of
  the discordant seeds (1.0 without any)."""
  seeds = [s for s in sorted(set(arm) & set(base)) if _finite(arm[s]) and _finite(base[s])]
  a = [arm[s] <= at_most for s in seeds]
  b = [base[s] <= at_most for s in seeds]
  only_a = sum(x and not y for x, y in zip(a, b))
  only_b = sum(y and not x for x, y in zip(a, b))
  count = Count(sum(a), sum(b), len(seeds), only_a, only_b)
  if only_a + only_b == 0:
    return count, 1.0
  return count, float(stats.binomtest(only_a, only_a + only_b, 0.5).pvalue)


def holm(pvalues: Sequence[float], alpha: float = ALPHA) -> list[bool]:
  """Holm–Bonferroni: which of `pvalues` (one family) are rejected at family-wise `alpha`, in
  their own order. The k-th smallest (k from 0) is rejected when it and every smaller one are at
  most alpha / (m - k); a NaN p-value is never rejected."""
  p = np.asarray(pvalues, np.float64)
  p = np.where(np.isnan(p), 1.0, p)
  m = p.size
  rejected = [False] * m
  for k, i in enumerate(np.argsort(p, kind="stable")):
    if p[i] > alpha / (m - k):
      break
    rejected[int(i)] = True
  return rejected


def verdicts(tests: Sequence[tuple[Interval | Count, float, int]]) -> list[str]:
  """The word each claim (difference or paired count, p-value, expected sign +1 or -1)
  supports, corrected for the whole family passed in: "reproduced" or "refuted" (by the
  difference's sign) only where `holm` rejects a zero difference, else "inconclusive"; "too few
  seeds" below `MIN_SEEDS`. Pass all of a study's claims at once: claims worded in separate
  calls are not corrected for one another."""
  rejected = holm([p for _, p, _ in tests])
  words = []
  for (diff, _, expected), reject in zip(tests, rejected, strict=True):
    if diff.n < MIN_SEEDS:
      words.append(TOO_FEW)
    elif not reject:
      words.append("inconclusive")
    else:
      words.append("reproduced" if np.sign(diff.mean) == expected else "refuted")
  return words


def verdict(difference: Interval, expected: int) -> str:
  """The word a difference's interval supports for a single claim that expects its sign
  `expected` (+1: the arm is higher than the baseline; -1: lower). Uncorrected for multiple
  comparisons: a study with several claims words them together with `verdicts`."""
  if difference.n < MIN_SEEDS:
    return TOO_FEW
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
  if round(a, 1) >= 1000 or a < 1e-3:  # by the size it prints at: 999.96 is 1.00e+03
    return f"{x:.2e}"
  return f"{x:.3f}" if round(a, 3) < 10 else f"{x:.1f}"  # 9.9996 is 10.0
