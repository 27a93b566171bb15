"""experiments/seed_table.py refuses a bad input with one `error:` line naming it, exit status 2,
and (where the check can be made before any table) nothing on stdout; these were tracebacks,
exit status 1, silently ignored flags or inputs read as something else."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import seed_table  # noqa: E402

RUNS = REPO / "docs" / "cpu_runs" / "smollm2_calc"
COL = "eval/accuracy@final"
CLAIM = {
  "id": "acc", "claim": "calc beats none", "direction": "+",
  "a": {"arm": ["arithmetic_inline"], "col": COL}, "b": {"arm": ["none"], "col": COL},
}  # fmt: skip
SPEC = {"group_by": ["sampling.tool"], "baseline": ["none"], "claims": [CLAIM]}


@pytest.fixture
def root(tmp_path):
  """Four exported runs (two arms of sampling.tool, seeds 1 and 2): config.json, scalars.json."""
  for name in ("calc_s1", "none_s1", "calc_s2", "none_s2"):
    (tmp_path / "runs" / name).mkdir(parents=True)
    for f in ("config.json", "scalars.json"):
      shutil.copy(RUNS / name / f, tmp_path / "runs" / name / f)
  return tmp_path / "runs"


def _refused(capsys, root, *argv):
  """Runs seed_table on `root` and asserts exit 2 with one `error:` line; (stdout, stderr)."""
  with pytest.raises(SystemExit) as e:
    seed_table.main([f"--root={root}", *argv])
  out, err = capsys.readouterr()
  assert e.value.code == 2, (e.value.code, err)
  assert err.startswith("error: ") and err.strip().splitlines() == [err.strip()], err
  return out, err


def _claims(tmp_path, spec):
  path = tmp_path / "claims.json"
  path.write_text(json.dumps(spec))
  return path


@pytest.mark.parametrize(
  "change, says",
  [
    ({"claims": ["x"]}, '"claims" must be a list of claim objects'),
    ({"claims": {"acc": CLAIM}}, '"claims" must be a list of claim objects'),
    ({"claims": []}, '"claims" is empty'),
    ({"baseline": "none"}, "'baseline' must be a list of strings"),
    ({"group_by": "sampling.tool"}, "'group_by' must be a list of strings"),
    ({"claims": [{**CLAIM, "a": {"arm": "arithmetic_inline", "col": COL}}]}, "must be a list of"),
    ({"claims": [CLAIM, {**CLAIM, "direction": "-"}]}, "claim id 'acc' twice"),
    (
      {"claims": [{**CLAIM, "count": {"at_most": True}}]},
      '`count` wants {"at_most": a finite number}',
    ),
    ({"baseline": ["none", "0.2"]}, "'baseline' wants 1 value(s), one per group_by"),
    ({"claims": [{**CLAIM, "b": {"arm": ["none", "x"], "col": COL}}]}, "`arm` wants 1 value(s)"),
  ],
)
def test_a_malformed_claims_file_is_one_error_line(tmp_path, root, capsys, change, says):
  """A claims list that is no list of objects, or empty; a group_by, baseline or arm that is a
  string (it was split into characters); a claim id twice (two members of the Holm family); a
  boolean count threshold; a baseline or arm of another length than group_by (it was "no arm")."""
  path = _claims(tmp_path, {**SPEC, **change})
  out, err = _refused(capsys, root, f"--claims={path}")
  assert out == "" and err.startswith(f"error: {path}: ") and says in err, err


@pytest.mark.parametrize("text", ['{"config": {"seed": 1', '{"cfg": {"seed": 1}}', "[1]"])
def test_a_run_whose_config_does_not_read_is_named(root, capsys, text):
  """A config.json cut short, without its "config" key, or of another shape."""
  (root / "calc_s2" / "config.json").write_text(text)
  out, err = _refused(capsys, root, "--group_by=sampling.tool", f"--cols={COL}")
  assert out == "" and f"{root / 'calc_s2' / 'config.json'}: not the trainer's" in err, err


@pytest.mark.parametrize("seed", ["x", [1], 0.7, True, None])
def test_a_seed_that_is_no_whole_number_is_named(root, capsys, seed):
  """A seed "x" or [1] was an int() traceback; 0.7 and true were read as seeds 0 and 1."""
  path = root / "calc_s2" / "config.json"
  record = json.loads(path.read_text())
  record["config"]["seed"] = seed
  path.write_text(json.dumps(record))
  out, err = _refused(capsys, root, "--group_by=sampling.tool", f"--cols={COL}")
  assert out == "" and err.strip() == (
    f"error: run {root / 'calc_s2'}: its config.json's seed={seed!r} is not a whole number"
  ), err


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_scalar_is_named_not_dropped(root, capsys, bad):
  """A NaN value (it silently dropped the seed from @final) or an infinity (it made the arm's
  mean infinite) names the run, tag and step."""
  path = root / "calc_s1" / "scalars.json"
  scalars = json.loads(path.read_text())
  scalars["eval/accuracy"][1][1] = bad
  path.write_text(json.dumps(scalars))
  out, err = _refused(capsys, root, "--group_by=sampling.tool", f"--cols={COL}")
  step = scalars["eval/accuracy"][1][0]
  assert out == "" and "calc_s1" in err and "'eval/accuracy'" in err and f"step {step}" in err


def test_a_nan_in_a_tag_no_column_reads_leaves_the_table(root, capsys):
  """A NaN elsewhere in a run (a diverged step's grad norm) does not stop the columns' table."""
  path = root / "calc_s1" / "scalars.json"
  scalars = json.loads(path.read_text())
  scalars["optim/grad_norm"][0][1] = float("nan")
  path.write_text(json.dumps(scalars))
  seed_table.main([f"--root={root}", "--group_by=sampling.tool", f"--cols={COL}", "--per_seed"])
  assert "| calc_s1 | 1 | 0.438 |" in capsys.readouterr().out


def test_a_run_without_scalars_is_named(root, capsys):
  """A run folder with a config.json and no scalars (it counted as a seed of `-` cells)."""
  (root / "none_s2" / "scalars.json").unlink()
  out, err = _refused(capsys, root, "--group_by=sampling.tool", f"--cols={COL}")
  assert out == "" and "none_s2" in err and "no scalars" in err, err


def test_no_runs_exits_2(tmp_path, capsys):
  """A root with no run (it returned 1)."""
  out, err = _refused(capsys, tmp_path, "--group_by=sampling.tool", f"--cols={COL}")
  assert out == "" and "no runs" in err


@pytest.mark.parametrize(
  "args, says",
  [
    (["--csv=FILE/rows.csv"], "FILE is a file, not a directory"),
    (["--csv=TMP"], "is a directory; give a file path"),
    (["--baseline=calc"], "--baseline=calc is no arm; arms: arithmetic_inline, none"),
    ([f"--expect={COL}:+,{COL}:-", "--baseline=none"], f"--expect names {COL} twice"),
    (["--cols=eval/accuracy@avg:300-100"], "@avg:300-100 has A > B"),
    ([f"--expect={COL}:+"], "--expect needs --baseline: its signs are of each arm minus the"),
    (["--grup_by=x"], "error: unrecognized arguments: --grup_by=x"),
    (["--csv="], "--csv= is empty; give a file or leave it out"),
    (["--claims="], "--claims= is empty; give a file or leave it out"),
    ([f"--cols={COL},{COL}"], f"--cols names {COL} twice; give each once"),
    (["--root=ROOT"], "--root names one folder twice"),
    (["--root=FILE"], "FILE: not a directory; give the folder holding the runs"),
  ],
)
def test_a_bad_flag_is_refused_before_any_table(tmp_path, root, capsys, args, says):
  """A --csv path that cannot be written and a --baseline that is no arm (found after tables
  printed), an --expect naming a column twice (the last won), @avg:A-B with A > B (every cell
  `-`)."""
  (tmp_path / "FILE").write_text("")
  args = [
    a.replace("FILE", str(tmp_path / "FILE"))
    .replace("TMP", str(tmp_path))
    .replace("ROOT", str(root))
    for a in args
  ]
  says = says.replace("FILE", str(tmp_path / "FILE"))
  cols = [] if any(a.startswith("--cols") for a in args) else [f"--cols={COL}"]
  out, err = _refused(capsys, root, "--group_by=sampling.tool", *cols, *args)
  assert out == "" and says in err, err


@pytest.mark.parametrize("flag", ["--group_by=sampling.tool", "--baseline=arithmetic_inline"])
def test_claims_refuses_the_flags_it_declares(tmp_path, root, capsys, flag):
  """--group_by or --baseline beside --claims (they were silently overridden by the file)."""
  path = _claims(tmp_path, SPEC)
  out, err = _refused(capsys, root, f"--claims={path}", flag)
  assert out == "" and f"{flag.split('=')[0]} and --claims" in err, err


def _cut_at(root, run, last_step):
  """Run `run`'s scalars as if it had stopped after `last_step`."""
  path = root / run / "scalars.json"
  scalars = json.loads(path.read_text())
  cut = {t: [[s, v] for s, v in series if s <= last_step] for t, series in scalars.items()}
  path.write_text(json.dumps({t: series for t, series in cut.items() if series}))


@pytest.mark.parametrize(
  "col, says",
  [
    ("eval/accuracy@final", "ends at step 30 of its train.num_steps=60; column 'eval/accuracy@f"),
    ("eval/accuracy@avg", "would read it as finished"),
    ("eval/accuracy@60", "ends at step 30; column 'eval/accuracy@60' reads step 60"),
    ("eval/accuracy@avg:40-60", "reads step 60"),
  ],
)
def test_a_run_that_stopped_early_is_named_not_read_as_finished(root, capsys, col, says):
  """A run that stopped at step 30 of 60: its step-30 value was read as its @final, its @60
  and its share of @avg:40-60 (or it left the window's arm with too few seeds), paired with
  runs that finished, with exit 0."""
  _cut_at(root, "calc_s2", 30)
  out, err = _refused(capsys, root, "--group_by=sampling.tool", f"--cols={col}")
  assert out == "" and "calc_s2" in err and says in err, err
  seed_table.main([f"--root={root}", "--group_by=sampling.tool", "--cols=eval/accuracy@30"])
  assert "eval/accuracy@30" in capsys.readouterr().out  # a step every run reached: a table


def test_arms_of_other_lengths_each_end_at_their_own_end_and_seeds_of_one_arm_must_agree(
  root, capsys
):
  """Arms that differ in train.num_steps (a study comparing 150 updates with 300) each read
  @final at their own end; they were refused as runs that stopped early. Within one arm, a tag
  that ends earlier in one seed than in another is still refused."""
  for run in ("none_s1", "none_s2"):
    _cut_at(root, run, 30)
    path = root / run / "config.json"
    record = json.loads(path.read_text())
    record["config"]["train"]["num_steps"] = 30
    path.write_text(json.dumps(record))
  seed_table.main([f"--root={root}", "--group_by=sampling.tool", f"--cols={COL}"])
  out = capsys.readouterr().out
  none = json.loads((root / "none_s1" / "scalars.json").read_text())["eval/accuracy"]
  assert none[-1][0] == 30 and "| none | 2 |" in out, out
  path = root / "calc_s2" / "scalars.json"
  scalars = json.loads(path.read_text())
  scalars["eval/accuracy"] = [p for p in scalars["eval/accuracy"] if p[0] <= 30]
  path.write_text(json.dumps(scalars))
  out, err = _refused(capsys, root, "--group_by=sampling.tool", f"--cols={COL}")
  assert out == "" and "calc_s2" in err and "in one arm" in err, err


def test_a_run_without_a_group_by_field_is_named_not_made_an_arm(root, capsys):
  """A run whose config.json lacks the group_by field others have: it became an arm "None"."""
  path = root / "calc_s2" / "config.json"
  record = json.loads(path.read_text())
  del record["config"]["sampling"]["tool"]
  path.write_text(json.dumps(record))
  out, err = _refused(capsys, root, "--group_by=sampling.tool", f"--cols={COL}")
  assert out == "" and "calc_s2" in err and "has no 'sampling.tool'" in err, err


@pytest.mark.parametrize(
  "claims, says",
  [
    ([{**CLAIM, "count": {"at_most": float("nan")}}], '`count` wants {"at_most": a finite'),
    ([{**CLAIM, "id": ""}, {**CLAIM, "id": ""}], "claim id '' twice"),
    ([{**CLAIM, "id": " "}], "`id` and `claim` must be non-empty strings"),
    ([{**CLAIM, "b": CLAIM["a"]}], "`a` and `b` are the same arm and column"),
  ],
)
def test_a_claim_that_can_decide_nothing_is_refused(tmp_path, root, capsys, claims, says):
  """A NaN count threshold (every count 0: "inconclusive"), two claims with an empty id (one
  row overwrote the other in the summary), a claim of a column against itself (0 [0, 0])."""
  path = _claims(tmp_path, {**SPEC, "claims": claims})
  out, err = _refused(capsys, root, f"--claims={path}")
  assert out == "" and says in err, err
