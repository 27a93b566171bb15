"""The studies' statistics (experiments/study_stats.py): t intervals that cover the mean they
estimate, no interval below the minimum of seeds, paired differences with their p-values, Holm's
correction and the verdicts they support. The seed table over a real pack's TensorBoard events is
checked in tests/test_tools.py."""

import pathlib
import sys

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import study_stats

SIMULATED = 20_000  # samples of n seeds per case: coverage to about ±0.0016 (one s.e.)
DISTRIBUTIONS = {  # (draw(rng, shape), true mean, least coverage accepted at n=8, at n=32)
  "normal": (lambda rng, shape: rng.normal(0.5, 0.2, shape), 0.5, 0.94, 0.94),
  # an accuracy over 50 problems at 0.9: bounded, skewed towards 0
  "accuracy": (lambda rng, shape: rng.binomial(50, 0.9, shape) / 50, 0.9, 0.94, 0.94),
  # skewed (skewness 0.6): the t interval's true coverage at n=8 is 0.939 (1e6 samples), so a
  # 0.94 floor would sit on it and pass or fail by the draw; 0.93 there, 0.94 at n=32
  "beta(2,5)": (lambda rng, shape: rng.beta(2, 5, shape), 2 / 7, 0.93, 0.94),
}


@pytest.mark.parametrize("n", [8, 32])
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_the_interval_covers_the_true_mean_at_its_level(name, n):
  """The 95% interval holds the true mean in at least ~94% of simulated studies of n seeds,
  and not in (nearly) all of them: it is not merely wide."""
  draw, truth, floor8, floor32 = DISTRIBUTIONS[name]
  rng = np.random.default_rng([8, n, len(name)])
  x = draw(rng, (SIMULATED, n))
  mean, low, high = study_stats.t_intervals(x)
  coverage = float(np.mean((low <= truth) & (truth <= high)))
  assert (floor8 if n == 8 else floor32) <= coverage <= 0.96, coverage
  for row in range(5):  # `interval` is the same interval, one study at a time
    ci = study_stats.interval(x[row], seed=row)
    assert ci.n == n and ci.low <= ci.mean <= ci.high
    assert (ci.mean, ci.low, ci.high) == pytest.approx((mean[row], low[row], high[row]))
  s = x[0].std(ddof=1)
  half = stats.t.ppf(0.975, n - 1) * s / np.sqrt(n)
  assert (high[0] - low[0]) / 2 == pytest.approx(half)


def test_too_few_seeds_give_a_mean_but_no_interval_and_no_verdict():
  two = study_stats.interval([0.4, 0.6])
  assert two.n == 2 and two.mean == pytest.approx(0.5)
  assert np.isnan(two.low) and np.isnan(two.high) and two.excludes_zero() == 0
  assert str(two) == "0.500 (n=2: too few seeds for an interval)"
  assert study_stats.verdict(two, +1) == "too few seeds"
  same = study_stats.interval([0.25, 0.25])  # one value twice is still too few seeds
  assert np.isnan(same.low) and "too few seeds" in str(same)
  diff, p = study_stats.paired_test({0: 1.0, 1: 2.0}, {0: 0.0, 1: 0.5, 2: 9.0})
  assert diff.n == 2 and p == 1.0
  assert study_stats.verdicts([(diff, p, +1)]) == ["too few seeds"]
  three = study_stats.interval([0.4, 0.5, 0.6])
  assert three.n == study_stats.MIN_SEEDS and three.low < 0.5 < three.high


def test_holm_rejects_the_smallest_p_values_until_one_misses_its_threshold():
  # sorted: 0.005 <= 0.05/4, 0.01 <= 0.05/3, 0.03 > 0.05/2: stop; 0.04 is not rejected either
  assert study_stats.holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
  assert study_stats.holm([0.03]) == [True]  # a family of one is uncorrected
  assert study_stats.holm([0.03] * 2) == [False, False]
  assert study_stats.holm([0.02, 0.02]) == [True, True]  # 0.02 <= 0.025, then 0.02 <= 0.05
  assert study_stats.holm([0.001, float("nan")]) == [True, False]
  assert study_stats.holm([]) == []


def _arms(shift: float, n: int = 8) -> tuple[dict[int, float], dict[int, float]]:
  """A baseline and an arm whose per-seed differences are `shift` plus a fixed noise of mean 0
  and standard deviation 1, so the paired t statistic is shift·√n."""
  z = np.random.default_rng(3).normal(size=n)
  z = (z - z.mean()) / z.std(ddof=1)
  seed_effect = np.random.default_rng(4).normal(0, 5, n)
  base = {s: float(seed_effect[s]) for s in range(n)}
  return {s: base[s] + shift + float(z[s]) for s in range(n)}, base


def test_verdicts_correct_a_marginal_effect_for_the_family_of_claims():
  n = 8
  marginal = stats.t.ppf(1 - 0.03 / 2, n - 1) / np.sqrt(n)  # uncorrected p = 0.03
  clear, p_clear = study_stats.paired_test(*_arms(3.0))
  weak, p_weak = study_stats.paired_test(*_arms(marginal))
  assert p_clear < 1e-4 and p_weak == pytest.approx(0.03)
  assert study_stats.verdict(weak, +1) == "reproduced"  # alone and uncorrected, it would be
  nulls = [study_stats.paired_test(*_arms(shift)) for shift in (0.0, 0.2, -0.3)]
  family = [(clear, p_clear, +1), (weak, p_weak, +1), *[(d, p, +1) for d, p in nulls]]
  assert study_stats.verdicts(family) == ["reproduced", *["inconclusive"] * 4]
  assert study_stats.verdicts([(weak, p_weak, +1)]) == ["reproduced"]  # a family of one
  assert study_stats.verdicts([(clear, p_clear, -1), (weak, p_weak, -1)]) == ["refuted"] * 2
  none, p_none = study_stats.paired_test({0: 1, 1: 2, 2: 3}, {0: 1, 1: 2, 2: 3})
  assert p_none == 1.0 and (none.low, none.high) == (0, 0)
  constant, p_constant = study_stats.paired_test({0: 2, 1: 3, 2: 4}, {0: 1, 1: 2, 2: 3})
  assert p_constant == 0.0 and study_stats.verdicts([(constant, p_constant, +1)]) == ["reproduced"]


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


def test_the_paired_count_test_is_exact_mcnemar_and_holds_its_level():
  """Counts of seeds at or below a threshold: 6 seeds discordant one way and none the other
  give the exact McNemar p-value 2 / 2**6; simulated studies of 16 paired seeds with equal
  collapse rates reject at most 5% of the time, and a collapse rate of 0.5 against 0 is found
  in most of them."""
  arm = {s: (0.0 if s < 6 else 0.4) for s in range(16)}
  base = {s: 0.4 for s in range(16)}
  count, p = study_stats.paired_count_test(arm, base, at_most=0.05)
  assert (count.a, count.b, count.n, count.only_a, count.only_b) == (6, 0, 16, 6, 0)
  assert p == pytest.approx(2 / 2**6) and count.mean == pytest.approx(6 / 16)
  assert study_stats.verdicts([(count, p, 1)]) == ["reproduced"]
  assert study_stats.verdicts([(count, p, -1)]) == ["refuted"]
  assert study_stats.paired_count_test(base, base, at_most=0.05)[1] == 1.0
  assert "6 − 0 of 16 seeds" in str(count)
  rng = np.random.default_rng(16)

  def rejections(rate_a, rate_b, studies=4000):
    a, b = rng.random((studies, 16)) < rate_a, rng.random((studies, 16)) < rate_b
    hits = 0
    for x, y in zip(a, b):
      _, p = study_stats.paired_count_test(dict(enumerate(1.0 - x)), dict(enumerate(1.0 - y)), 0.0)
      hits += p <= study_stats.ALPHA
    return hits / studies

  assert rejections(0.3, 0.3) <= study_stats.ALPHA
  assert rejections(0.5, 0.0) >= 0.8


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
  assert problems and problems[0].startswith("removed: table 0, row 'a'")
  empty = committed.replace("0.500 [0.400, 0.600]", "- [-, -]")  # a metric an arm lacks
  problems, counts = compare_tables.compare(empty, empty)
  assert not problems and counts["means"] == 0 and counts["single_equal"] == 4
  few = committed.replace("0.500 [0.400, 0.600]", str(study_stats.interval([0.4, 0.6])))
  problems, counts = compare_tables.compare(few, few)  # n < MIN_SEEDS: no interval to hold to
  assert not problems and counts["means"] == 0 and counts["single_equal"] == 4


def test_compare_tables_compares_every_row_of_a_table_grouped_by_two_fields():
  """Rows that share their first cell (`0.2 | 0.7`, `0.2 | 1.0`) are told apart by the next:
  every mean is compared, and a changed first row fails (only the last row of each first value
  was compared before, so an arm going from 0.03 to 0.9 passed)."""
  import compare_tables

  committed = "| clip | temp | seeds | acc |\n|---|---|---|---|\n" + "".join(
    f"| {c} | {t} | 8 | 0.0{i} [0.0{i}0, 0.0{i}9] |\n"
    for i, (c, t) in enumerate([(c, t) for c in ("0.2", "0.28") for t in ("0.7", "1.0")], 1)
  )
  problems, counts = compare_tables.compare(committed, committed)
  assert not problems and counts["means"] == 4
  changed = committed.replace(
    "| 0.2 | 0.7 | 8 | 0.01 [0.010, 0.019] |", "| 0.2 | 0.7 | 8 | 0.9 [0.85, 0.95] |"
  )
  assert changed != committed
  problems, _ = compare_tables.compare(committed, changed)
  assert len(problems) == 1 and "'0.2 | 0.7'" in problems[0], problems


def test_the_seed_table_corrects_its_verdicts_over_the_table(tmp_path):
  """experiments/seed_table.py over runs written as the trainer writes them (config.json and
  TensorBoard events): of two claims, a clear effect is reproduced, and an effect whose own
  interval excludes zero but whose p-value does not survive Holm over the table's claims is
  inconclusive."""
  import json
  import subprocess

  from jaxrl_llm import metrics

  rng = np.random.default_rng(3)
  base = rng.normal(0.5, 0.05, 8)
  u = rng.normal(0, 1, 8)
  u = (u - u.mean()) / u.std(ddof=1)  # differences of t = 2.6 on 7 degrees of freedom: p 0.035
  marginal = base + 0.02 * (2.6 / np.sqrt(8) + u)
  t, p = study_stats.paired_test(dict(enumerate(marginal)), dict(enumerate(base)))
  arms = {"0.2": base, "0.28": base + 0.2 + rng.normal(0, 0.01, 8), "0.4": marginal}
  for clip, values in arms.items():
    for seed, v in enumerate(values):
      run = tmp_path / f"clip={clip},seed={seed}"
      run.mkdir()
      config = {"config": {"seed": seed, "objective": {"clip_high": float(clip)}}}
      (run / "config.json").write_text(json.dumps(config))
      writer = metrics.SummaryWriter(str(run))
      writer.scalars(10, {"eval/accuracy": float(v), "policy/entropy": float(v)})
      writer.close()
  script = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "seed_table.py"
  cmd = [sys.executable, str(script), f"--root={tmp_path}", "--group_by=objective.clip_high"]
  cmd += ["--cols=eval/accuracy@final,policy/entropy@final", "--baseline=0.2"]
  cmd += ["--expect=eval/accuracy@final:+,policy/entropy@final:+"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
  rows = {line.split("|")[1].strip(): line for line in out.splitlines() if "p=" in line}
  assert t.low > 0 and 0.025 < p < 0.05  # alone, it would be "reproduced"
  assert rows["0.28"].count("reproduced") == 2
  assert rows["0.4"].count("inconclusive") == 2 and "reproduced" not in rows["0.4"]


def _runs(root: pathlib.Path, arms: dict[str, list[float | None]]) -> None:
  """Runs as the trainer writes them (config.json, TensorBoard events): one per arm and seed,
  `eval/accuracy` logged at step 10 (not at all for a None)."""
  import json

  from jaxrl_llm import metrics

  for clip, values in arms.items():
    for seed, v in enumerate(values):
      run = root / f"clip={clip},seed={seed}"
      run.mkdir(parents=True)
      config = {"config": {"seed": seed, "objective": {"clip_high": float(clip)}}}
      (run / "config.json").write_text(json.dumps(config))
      writer = metrics.SummaryWriter(str(run))
      writer.scalars(10, {"policy/entropy": 1.0} | ({} if v is None else {"eval/accuracy": v}))
      writer.close()


@pytest.mark.parametrize(
  "args, says",
  [
    (["--cols=eval/accuracy"], "error: column 'eval/accuracy' is not TAG@WHAT"),
    (["--cols=eval/accuracy@fnal"], "error: column 'eval/accuracy@fnal': @fnal is none of"),
    (["--cols=eval/acuracy@final"], "error: column 'eval/acuracy@final': no run logged the tag"),
    (["--cols=eval/accuracy@final", "--expect=eval/accuracy@final"], "error: --expect="),
    (["--group_by=objective.clip_hgh"], "error: group_by field 'objective.clip_hgh' is in no"),
    (["--claims=CLAIMS", "--direction="], "error: CLAIMS: claim c: want keys"),
    (["--claims=CLAIMS", "--arm=0.20"], "error: CLAIMS: arm 0.20 is no arm"),
    (["--claims=MISSING"], "error: MISSING: No such file or directory"),
    (["--claims=CLAIMS", "--truncate"], "error: CLAIMS: "),
  ],
)
def test_the_seed_table_refuses_what_it_cannot_word_in_one_line(tmp_path, args, says):
  """A malformed column, a tag or field no run has, an --expect without its sign, a claim with
  no direction or an arm that is not there, a claims file missing or cut short: one `error:`
  line and no table (they were tracebacks, or tables of `- [-, -]` worded "too few seeds" with
  exit status 0, or, for a misspelt --group_by, every run in one arm)."""
  import json
  import subprocess

  _runs(tmp_path / "runs", {"0.2": [0.5, 0.6, 0.55], "0.28": [0.7, 0.8, 0.75]})
  claim = {"id": "c", "claim": "x", "direction": "+"}
  claim |= {"a": {"arm": ["0.28"], "col": "eval/accuracy@final"}}
  claim |= {"b": {"arm": ["0.2"], "col": "eval/accuracy@final"}}
  for flag in [a for a in args if a.startswith(("--direction=", "--arm="))]:
    key, value = flag[2:].split("=")
    claim |= {"direction": value} if key == "direction" else {"a": {**claim["a"], "arm": [value]}}
  text = json.dumps({"group_by": ["objective.clip_high"], "baseline": ["0.2"], "claims": [claim]})
  claims = tmp_path / "claims.json"
  claims.write_text(text[:40] if "--truncate" in args else text)
  argv = [a for a in args if not a.startswith(("--direction=", "--arm=", "--truncate"))]
  argv = [
    a.replace("CLAIMS", str(claims)).replace("MISSING", str(tmp_path / "no.json")) for a in argv
  ]
  if not any(a.startswith("--claims") for a in argv):  # the defaults a case does not give
    given = {a.split("=")[0] for a in argv}
    defaults = ["--group_by=objective.clip_high", "--cols=eval/accuracy@final"]
    argv = [d for d in defaults if d.split("=")[0] not in given] + argv
  script = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "seed_table.py"
  cmd = [sys.executable, str(script), f"--root={tmp_path / 'runs'}", *argv]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  said = says.replace("CLAIMS", str(claims)).replace("MISSING", str(tmp_path / "no.json"))
  assert proc.returncode != 0 and proc.stdout == "", proc.stdout
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
  assert proc.stderr.startswith(said), proc.stderr


def test_a_mean_over_fewer_seeds_than_its_arm_says_its_n(tmp_path):
  """A run that logged no value for a column leaves that cell over fewer seeds: the cell says
  its n (the seeds column counts the arm's runs, and it read as if every seed were in it)."""
  import subprocess

  _runs(tmp_path, {"0.2": [0.5, 0.6, 0.55, 0.52], "0.28": [0.7, None, 0.75, 0.72]})
  script = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "seed_table.py"
  cmd = [sys.executable, str(script), f"--root={tmp_path}", "--group_by=objective.clip_high"]
  cmd += ["--cols=eval/accuracy@final,policy/entropy@final"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
  rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| 0.")}
  assert rows["0.28"].count("(n=3)") == 1 and "| 4 |" in rows["0.28"], rows["0.28"]
  assert "(n=" not in rows["0.2"], rows["0.2"]
