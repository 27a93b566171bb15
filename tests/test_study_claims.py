"""Pre-registered study claims (experiments/<study>/claims.json): declared before results, worded
by experiments/seed_table.py --claims with Holm's correction over the file's claims alone, on
seeds the declaration did not see; columns no claim names carry no verdict word."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import seed_table  # noqa: E402
import study_stats  # noqa: E402

STUDIES = sorted(p.parent.name for p in EXPERIMENTS.glob("*/run.sh"))


def _seeds(text: str) -> set[int]:
  low, high = (int(x) for x in text.split("-"))
  return set(range(low, high + 1))


def _write_runs(root: pathlib.Path, arms: dict[str, dict[str, np.ndarray]]) -> None:
  """Runs as the trainer leaves them: config.json and TensorBoard events, one per arm x seed,
  each tag's value at step 10 and (tag `x` only) its first value at step 1."""
  from jaxrl_llm import metrics

  for clip, tags in arms.items():
    for seed in range(len(next(iter(tags.values())))):
      run = root / f"clip={clip},seed={seed}"
      run.mkdir(parents=True)
      config = {"config": {"seed": seed, "objective": {"clip_high": float(clip)}}}
      (run / "config.json").write_text(json.dumps(config))
      writer = metrics.SummaryWriter(str(run))
      writer.scalars(1, {"policy/entropy": 1.0})
      writer.scalars(10, {tag: float(v[seed]) for tag, v in tags.items()})
      writer.close()


def test_claims_are_worded_over_their_own_family_and_other_columns_are_exploratory(tmp_path):
  """Two declared claims (the baseline's entropy falls; the fix raises accuracy) are worded
  with their paired p-values; a third column is printed as exploratory with no verdict, and a
  comparison no claim names gets no word either."""
  rng = np.random.default_rng(5)
  acc = rng.normal(0.3, 0.02, 8)
  arms = {
    "0.2": {"policy/entropy": 0.4 + rng.normal(0, 0.02, 8), "eval/accuracy": acc},
    "0.28": {"policy/entropy": 0.6 + rng.normal(0, 0.02, 8), "eval/accuracy": acc + 0.05},
  }
  for tags in arms.values():
    tags["eval/pass@4"] = tags["eval/accuracy"] + 0.3
  _write_runs(tmp_path / "runs", arms)
  claims = {
    "declared": "before", "group_by": ["objective.clip_high"], "baseline": ["0.2"],
    "exploration_seeds": "0-31", "confirmation_seeds": "100-123",
    "claims": [
      {"id": "collapse", "claim": "the baseline's entropy falls",
       "a": {"arm": ["0.2"], "col": "policy/entropy@final"},
       "b": {"arm": ["0.2"], "col": "policy/entropy@1"}, "direction": "-"},
      {"id": "fix", "claim": "clip-higher raises accuracy",
       "a": {"arm": ["0.28"], "col": "eval/accuracy@final"},
       "b": {"arm": ["0.2"], "col": "eval/accuracy@final"}, "direction": "+"},
    ],
  }  # fmt: skip
  path = tmp_path / "claims.json"
  path.write_text(json.dumps(claims))
  cmd = [sys.executable, str(EXPERIMENTS / "seed_table.py"), f"--root={tmp_path / 'runs'}"]
  cmd += [f"--claims={path}", "--cols=eval/pass@4@final"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
  assert "eval/pass@4@final (exploratory)" in out
  worded = [line for line in out.splitlines() if line.startswith("| collapse") or "| fix" in line]
  assert len(worded) == 2 and all(line.rstrip(" |").endswith("reproduced") for line in worded)
  difference_rows = [line for line in out.splitlines() if line.startswith("| 0.28 |")]
  assert difference_rows and not any(
    w in difference_rows[-1] for w in ("reproduced", "refuted", "inconclusive")
  )
  bad = dict(claims, claims=[{**claims["claims"][0], "direction": "up"}])
  path.write_text(json.dumps(bad))
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: {path}: claim collapse")


def test_a_count_claim_counts_seeds_at_or_below_its_threshold(tmp_path):
  """A declared count (`"count": {"at_most": X}`): per arm, the seeds whose column is at most X,
  worded with the exact McNemar test over real TensorBoard events; a malformed count is one
  error line."""
  base = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.4, 0.5])  # 6 of 8 seeds at 0
  _write_runs(
    tmp_path / "runs", {"0.2": {"eval/accuracy": base}, "0.0": {"eval/accuracy": base * 0 + 0.3}}
  )
  claim = {
    "id": "fewer", "claim": "fewer seeds collapse without the term",
    "a": {"arm": ["0.0"], "col": "eval/accuracy@final"},
    "b": {"arm": ["0.2"], "col": "eval/accuracy@final"},
    "direction": "-", "count": {"at_most": 0.047},
  }  # fmt: skip
  claims = {"declared": "before", "group_by": ["objective.clip_high"], "baseline": ["0.2"]}
  path = tmp_path / "claims.json"
  path.write_text(json.dumps({**claims, "claims": [claim]}))
  cmd = [sys.executable, str(EXPERIMENTS / "seed_table.py"), f"--root={tmp_path / 'runs'}"]
  out = subprocess.run([*cmd, f"--claims={path}"], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  (row,) = [line for line in out.stdout.splitlines() if line.startswith("| fewer |")]
  assert "-0.750 (0 − 6 of 8 seeds; discordant 0:6, exact McNemar)" in row
  assert "| 0.031 | reproduced |" in row and "seeds with 0.0 eval/accuracy@final <= 0.047" in row
  path.write_text(json.dumps({**claims, "claims": [{**claim, "count": {"below": 1}}]}))
  proc = subprocess.run([*cmd, f"--claims={path}"], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.strip() == (
    f'error: {path}: claim fewer: `count` wants {{"at_most": a finite number}}'
  )


@pytest.mark.parametrize("study", STUDIES)
def test_every_study_declares_its_claims_on_fresh_seeds(study):
  """Each study's claims.json parses, names the baseline's failure and the fix's effect on
  columns of the form TAG@WHAT, and confirms on seeds none of its exploration used."""
  spec = seed_table.load_claims(EXPERIMENTS / study / "claims.json")
  assert 2 <= len(spec["claims"]) <= 4
  assert not _seeds(spec["confirmation_seeds"]) & _seeds(spec["exploration_seeds"])
  assert len(_seeds(spec["confirmation_seeds"])) >= 24
  baseline = spec["baseline"]
  assert any(c["a"]["arm"] == c["b"]["arm"] == baseline for c in spec["claims"]), "no failure"
  assert any(c["a"]["arm"] != baseline and c["b"]["arm"] == baseline for c in spec["claims"])
  run_sh = (EXPERIMENTS / study / "run.sh").read_text()
  assert "--claims=" in run_sh and "CONFIRM" in run_sh


def _first_commit(path: pathlib.Path, holding: str | None = None) -> int | None:
  """Unix time of the first commit that added `path` (with `holding`: the first whose `path`
  holds that text), None when git has none."""
  select = ["--diff-filter=A"] if holding is None else [f"-S{holding}"]
  proc = subprocess.run(
    ["git", "log", *select, "--format=%ct", "--", str(path)],
    cwd=REPO, capture_output=True, text=True,
  )  # fmt: skip
  times = proc.stdout.split()
  return int(times[-1]) if proc.returncode == 0 and times else None


@pytest.mark.parametrize("study", STUDIES)
def test_a_studys_claims_were_committed_before_its_confirmation(study):
  """Where a study holds confirmation results (confirmation.md), its claims.json entered the
  history in an earlier commit: the declaration did not see them."""
  confirmation = EXPERIMENTS / study / "confirmation.md"
  if not confirmation.exists():
    assert "CONFIRM" in (EXPERIMENTS / study / "run.sh").read_text()
    return
  declared, confirmed = (
    _first_commit(EXPERIMENTS / study / "claims.json"),
    _first_commit(confirmation),
  )
  assert declared is not None and confirmed is not None and declared < confirmed


PAGE_CLAIMS = sorted(EXPERIMENTS.glob("*/*.claims.json"))


@pytest.mark.parametrize("claims", PAGE_CLAIMS, ids=[p.name for p in PAGE_CLAIMS])
def test_a_pages_claims_were_committed_before_its_results(claims):
  """A study page's own claims (<study>/<page>.claims.json beside <page>.md, e.g. a real-model
  comparison) parse, the page names them, and they entered the history before the page held
  results: where <page>.md has `## Results`, an earlier commit added the claims."""
  spec = seed_table.load_claims(claims)
  assert spec["claims"] and spec["declared"]
  page = claims.with_name(claims.name.removesuffix(".claims.json") + ".md")
  assert page.exists() and claims.name in page.read_text()
  if "## Results" not in page.read_text():
    return
  declared, results = _first_commit(claims), _first_commit(page, holding="## Results")
  assert declared is not None and results is not None and declared < results


def test_holm_over_a_claims_file_is_the_family_of_that_file():
  """The claims table corrects over the declared claims only: a claim with p 0.03 among two is
  reproduced (0.03 <= 0.05 / 1 after the first), not among five."""
  strong = study_stats.Interval(0.1, 0.05, 0.15, 8)
  marginal = study_stats.Interval(0.02, 0.001, 0.04, 8)
  two = study_stats.verdicts([(strong, 1e-5, 1), (marginal, 0.03, 1)])
  five = study_stats.verdicts([(strong, 1e-5, 1), (marginal, 0.03, 1)] + [(marginal, 0.5, 1)] * 3)
  assert two == ["reproduced", "reproduced"] and five[1] == "inconclusive"


def test_the_cross_study_table_is_the_one_summary_py_generates():
  """experiments/README.md's cross-study table is what experiments/summary.py writes from the
  studies' claims and confirmations, and their pages' own (and the testbed's best trivial
  answer) now."""
  proc = subprocess.run(
    [sys.executable, str(EXPERIMENTS / "summary.py"), "--check"],
    capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  readme = (EXPERIMENTS / "README.md").read_text()
  assert readme.count("| [") >= sum(
    len(seed_table.load_claims(EXPERIMENTS / s / "claims.json")["claims"]) for s in STUDIES
  )
  for claims in PAGE_CLAIMS:  # a page's own claims get rows too, linked to the page
    page = f"({claims.parent.name}/{claims.name.removesuffix('.claims.json')}.md)"
    assert readme.count(page) >= len(seed_table.load_claims(claims)["claims"]), page
  rows = [line for line in readme.splitlines() if line.startswith("| [")]
  reproduced = sum(line.rstrip().endswith("| **reproduced** |") for line in rows)
  top = (REPO / "README.md").read_text()  # the project README's count is the table's
  assert f"tested on fresh seeds: {reproduced} of {len(rows)} reproduced" in top


def test_a_bar_inside_a_claim_keeps_every_table_cell_in_its_column(tmp_path, monkeypatch):
  """A claim worded with bars of its own (KL(p||q)) is printed by seed_table.py with them
  escaped, read back by summary.py with its p-value and verdict in their columns (also from a
  table printed before the escaping), and every row of the cross-study table has its 7 cells."""
  import summary

  rng = np.random.default_rng(3)
  _write_runs(
    tmp_path / "runs",
    {"0.2": {"kl": rng.normal(1, 0.01, 8)}, "0.28": {"kl": rng.normal(2, 0.01, 8)}},
  )
  claim = {"id": "kl", "claim": "KL(pi||ref) grows", "a": {"arm": ["0.28"], "col": "kl@final"},
           "b": {"arm": ["0.2"], "col": "kl@final"}, "direction": "+"}  # fmt: skip
  spec = {"group_by": ["objective.clip_high"], "baseline": ["0.2"], "claims": [claim]}
  (tmp_path / "claims.json").write_text(json.dumps(spec))
  cmd = [sys.executable, str(EXPERIMENTS / "seed_table.py"), f"--root={tmp_path / 'runs'}"]
  out = subprocess.run([*cmd, f"--claims={tmp_path / 'claims.json'}"], capture_output=True,
                       text=True, timeout=120, check=True).stdout  # fmt: skip
  (row,) = [line for line in out.splitlines() if line.startswith("| kl |")]
  assert "KL(pi\\|\\|ref) grows" in row and len(summary._cells(row)) == 8
  header = "| claim | statement | a − b | expected | difference | n | p | verdict |"
  (tmp_path / "study").mkdir()
  monkeypatch.setattr(summary, "HERE", str(tmp_path))
  for printed in (row, row.replace("\\|", "|")):  # escaped, and as printed before escaping
    (tmp_path / "study" / "confirmation.md").write_text(f"{header}\n|---|\n{printed}\n")
    cells = summary.confirmed("study")["kl"]
    assert len(cells) == 8 and cells[5] == "8" and cells[7] == "reproduced", cells
  readme = (EXPERIMENTS / "README.md").read_text()
  rows = [line for line in readme.splitlines() if line.startswith("| [")]
  assert rows and all(len(summary._cells(line)) == 7 for line in rows)


NUMBER = r"(?<![\w.])[-−]?\d+\.\d+(?:e[-−]?\d+)?"


@pytest.mark.parametrize("study", STUDIES)
def test_every_number_in_a_studys_results_is_in_a_table_its_script_printed(study):
  """Each decimal number of a study README's results (from `## Results` on) appears in the
  markdown its scripts printed (tables.md, confirmation.md, exact_bias.md): no
  number transcribed by hand or left from an earlier run."""
  import re

  text = (EXPERIMENTS / study / "README.md").read_text()
  assert "## Results" in text
  results = text.split("## Results", 1)[1]
  printed = " ".join(
    p.read_text() for p in (EXPERIMENTS / study).glob("*.md") if p.name != "README.md"
  ).replace("−", "-")
  missing = [n for n in re.findall(NUMBER, results) if n.replace("−", "-") not in printed]
  assert not missing, f"{study}/README.md: {missing} appear in no printed table"
