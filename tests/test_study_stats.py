"""The studies' statistics (experiments/study_stats.py): bootstrap intervals that cover the mean
they estimate, paired differences and the verdicts they support. The seed table over a real
pack's TensorBoard events is checked in tests/test_tools.py."""

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import study_stats


def test_the_interval_covers_the_true_mean_at_about_its_level():
  rng = np.random.default_rng(0)
  trials, n = 200, 16
  covered = 0
  for i in range(trials):
    x = rng.normal(0.5, 0.2, size=n)
    ci = study_stats.interval(x, seed=i)
    assert ci.low <= x.mean() <= ci.high and ci.n == n
    covered += ci.low <= 0.5 <= ci.high
  assert 0.85 <= covered / trials <= 0.99


def test_an_interval_narrows_with_more_seeds_and_collapses_on_one_value():
  rng = np.random.default_rng(1)
  wide = study_stats.interval(rng.normal(0, 1, 8))
  narrow = study_stats.interval(rng.normal(0, 1, 128))
  assert narrow.high - narrow.low < (wide.high - wide.low) / 2
  same = study_stats.interval([0.25] * 8)
  assert (same.mean, same.low, same.high) == (0.25, 0.25, 0.25)
  assert study_stats.interval([]).n == 0


@pytest.mark.parametrize(("shift", "word"), [(0.3, "reproduced"), (-0.3, "refuted"), (0.0, None)])
def test_paired_differences_give_the_verdict_their_interval_supports(shift, word):
  """Arms that share seeds: a shared per-seed effect cancels, so a shift far smaller than the
  spread between seeds is still found."""
  rng = np.random.default_rng(2)
  seed_effect = rng.normal(0, 1.0, 16)
  base = {s: float(seed_effect[s] + rng.normal(0, 0.05)) for s in range(16)}
  arm = {s: float(seed_effect[s] + shift + rng.normal(0, 0.05)) for s in range(16)}
  arm[99] = 5.0  # a seed the baseline lacks is not paired
  diff = study_stats.paired_difference(arm, base)
  assert diff.n == 16
  got = study_stats.verdict(diff, expected=+1)
  if word is None:
    assert diff.low < 0.1 and diff.high > -0.1
  else:
    assert got == word
  unpaired = study_stats.interval(list(arm.values())[:16])
  assert unpaired.high - unpaired.low > 5 * (diff.high - diff.low)


def test_compare_tables_holds_means_to_the_committed_intervals():
  import compare_tables

  committed = (
    "| arm | seeds | acc |\n|---|---|---|\n| a | 8 | 0.500 [0.400, 0.600] |\n\n"
    "| run | seed | acc |\n|---|---|---|\n| a,seed=0 | 0 | 0.5 |\n"
  )
  within = committed.replace("0.500 [0.400, 0.600]", "0.549 [0.450, 0.650]")
  problems, counts = compare_tables.compare(committed, within)
  assert not problems and counts == {"means": 1, "within": 1, "single": 3, "single_equal": 3}
  outside = committed.replace("0.500 [0.400, 0.600]", "0.651 [0.600, 0.700]").replace(
    "0.5 |", "0.6 |"
  )
  problems, counts = compare_tables.compare(committed, outside)
  assert len(problems) == 1 and "0.651" in problems[0] and counts["single_equal"] == 2
  problems, _ = compare_tables.compare(committed, committed.replace("| a | 8", "| b | 8"))
  assert problems and problems[0].startswith("missing")
  empty = committed.replace("0.500 [0.400, 0.600]", "- [-, -]")  # a metric an arm lacks
  problems, counts = compare_tables.compare(empty, empty)
  assert not problems and counts["means"] == 0 and counts["single_equal"] == 4
