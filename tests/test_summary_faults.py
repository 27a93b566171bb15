"""experiments/summary.py refuses, in one `error:` line and exit 2, a claims file its cross-study
table cannot be read from honestly: a claim edited, added or removed after its confirmation (its
verdict would stand beside another claim, or its Holm family be another), a claims file without
`confirmation_seeds`, and a `testbed` that is not settings over configs/countdown.py. Each runs
the real summary.py on a copy of experiments/ in tmp_path."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
  """A repository for summary.py under tmp_path: a copy of experiments/ (no figures) beside
  links to the code, configs and docs it reads; returns the copy's experiments folder."""
  ignore = shutil.ignore_patterns("*.png", "__pycache__", "*.new")
  shutil.copytree(REPO / "experiments", tmp_path / "experiments", ignore=ignore)
  for name in ("jaxrl_llm", "configs", "docs"):
    (tmp_path / name).symlink_to(REPO / name)
  return tmp_path / "experiments"


def _summary(experiments: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  """The copy's summary.py run with `args`."""
  return subprocess.run(
    [sys.executable, str(experiments / "summary.py"), *args],
    capture_output=True, text=True, timeout=300, cwd=experiments.parent,
  )  # fmt: skip


def _one_error(proc: subprocess.CompletedProcess) -> str:
  """The single `error:` line of a refused run (exit 2, no traceback), without its prefix."""
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
  return lines[0].removeprefix("error: ")


EDITS = {
  # the baseline's collapse, confirmed as "-" (and reproduced), flipped to "+"
  "sign": (
    lambda claims: claims[0].update(direction="+"),
    "claim 'baseline-entropy-collapse': its expected sign reads '-' in "
    "experiments/clip_higher/confirmation.md but '+' in experiments/clip_higher/claims.json now",
  ),
  "cols": (
    lambda claims: [claims[1][x].update(col="policy/entropy@100") for x in "ab"],
    "claim 'entropy-early': its a − b reads '0.28 policy/entropy@50 − 0.2 policy/entropy@50' in "
    "experiments/clip_higher/confirmation.md but '0.28 policy/entropy@100 − 0.2 "
    "policy/entropy@100' in experiments/clip_higher/claims.json now",
  ),
  "statement": (
    lambda claims: claims[3].update(claim=claims[3]["claim"].replace("higher", "lower")),
    "claim 'accuracy-final': its statement reads 'Clip-higher (eps_high = 0.28) ends with highe…' "
    "in experiments/clip_higher/confirmation.md but 'Clip-lower (eps_high = 0.28) ends with lower "
    "…' in experiments/clip_higher/claims.json now",
  ),
  "added": (
    lambda claims: claims.append({**claims[3], "id": "accuracy-50"}),
    "claim 'accuracy-50' of experiments/clip_higher/claims.json is not in the claims table of "
    "experiments/clip_higher/confirmation.md (added or renamed since",
  ),
  "removed": (
    lambda claims: claims.pop(),
    "the claims table of experiments/clip_higher/confirmation.md words claim 'accuracy-final', "
    "which experiments/clip_higher/claims.json no longer declares",
  ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_claim_edited_after_its_confirmation_is_refused(tmp_path, edit):
  """clip_higher's claims.json edited after its confirmation.md (a sign flipped, a column
  changed, a statement reworded, a claim added or removed): both the normal run and --check
  refuse in one line naming the study, the claim and what differs, and the README's table is
  left as it was (the old verdict is never printed beside the new claim)."""
  experiments = _copy(tmp_path)
  path = experiments / "clip_higher" / "claims.json"
  spec = json.loads(path.read_text())
  change, want = EDITS[edit]
  change(spec["claims"])
  path.write_text(json.dumps(spec, indent=2))
  readme = (experiments / "README.md").read_text()
  for args in (["--check"], []):
    line = _one_error(_summary(experiments, *args))
    assert line.startswith(f"study clip_higher: {want}"), line
    assert line.endswith(
      "a claim changed since needs a new confirmation on fresh seeds, or restore "
      "experiments/clip_higher/claims.json"
    ), line
  assert (experiments / "README.md").read_text() == readme


def _new_study(experiments: pathlib.Path, **changes) -> pathlib.Path:
  """A study `newstudy` (a run.sh, no confirmation yet) whose claims.json is clip_higher's with
  `changes` (a value None: that field left out); returns its claims.json."""
  (experiments / "newstudy").mkdir()
  (experiments / "newstudy" / "run.sh").write_text("#!/usr/bin/env bash\n")
  spec = json.loads((experiments / "clip_higher" / "claims.json").read_text())
  spec.update(changes)
  spec = {k: v for k, v in spec.items() if v is not None}
  path = experiments / "newstudy" / "claims.json"
  path.write_text(json.dumps(spec, indent=2))
  return path


def test_a_claims_file_without_confirmation_seeds_is_one_error_line(tmp_path):
  """A new study's claims.json without `confirmation_seeds` (which its "not yet confirmed"
  row names) is one line naming the file and the field, for --check and the normal run."""
  experiments = _copy(tmp_path)
  path = _new_study(experiments, confirmation_seeds=None)
  for args in (["--check"], []):
    assert _one_error(_summary(experiments, *args)) == (
      f"{path}: missing 'confirmation_seeds'; want the fresh seeds its confirmation trains, "
      'a string "A-B" (e.g. "100-123")'
    )


TESTBED_WANT = (
  'want a JSON object {"section.field": value, ...} of settings over configs/countdown.py, each '
  'a field it has at a value it allows (e.g. {"task.name": "addition", "task.digits": 3}); no '
  "testbed: countdown"
)


@pytest.mark.parametrize(
  ("testbed", "why"),
  [
    ({"digits": 3}, "testbed setting 'digits' is no section.field"),
    ({"task.digitz": 3}, "testbed {\"task.digitz\": 3}: 'task.digitz': section 'task' has no"),
    ("addition", "'testbed' is \"addition\""),
  ],
  ids=["no-section", "unknown-field", "not-an-object"],
)
def test_a_malformed_testbed_is_one_error_line(tmp_path, testbed, why):
  """A claims.json `testbed` that is no settings object over configs/countdown.py (a field
  without its section, a field the config lacks, a string) is one line naming the file, the
  setting and what a testbed may be."""
  experiments = _copy(tmp_path)
  path = _new_study(experiments, testbed=testbed)
  line = _one_error(_summary(experiments, "--check"))
  assert line.startswith(f"{path}: {why}") and line.endswith(TESTBED_WANT), line


def test_a_claims_table_without_the_columns_the_summary_reads_is_one_error_line(tmp_path):
  """clip_higher's confirmation.md cut to its first four columns (the statement, sign and
  difference still match claims.json): an IndexError traceback at the n column."""
  experiments = _copy(tmp_path)
  path = experiments / "clip_higher" / "confirmation.md"
  lines = []
  for line in path.read_text().split("\n"):
    if line.startswith("| claim | statement |") or (lines and lines[-1].startswith("|")):
      cells = [c.strip() for c in line.strip().strip("|").split("|")[:4]]
      line = "| " + " | ".join(cells) + " |" if line else line
    lines.append(line)
  path.write_text("\n".join(lines))
  line = _one_error(_summary(experiments, "--check"))
  assert line.startswith(
    f"{path.relative_to(tmp_path) if False else path}: the claims table's header is "
  ), line
  assert line.endswith(
    "seed_table.py --claims prints | claim | statement | a − b | expected | difference | n | p | "
    "verdict |"
  ), line
