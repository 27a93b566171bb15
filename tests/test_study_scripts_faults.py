"""Bad inputs to the study scripts (experiments/compare_tables.py, summary.py, study_stats.py,
run_all.sh, real_arms.sh, study_env.sh): one `error:` line on stderr and exit 2, no traceback,
nothing saved overwritten; and the edges where they were silently wrong."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import sys

import pytest
from conftest import run_in_session
from scipy import stats

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import study_stats  # noqa: E402
import summary  # noqa: E402

TABLE = "| arm | seeds | acc |\n|---|---|---|\n| a | 8 | 0.500 [0.400, 0.600] |\n"


def _one_error(proc, *says):
  """Exit 2, one `error:` line on stderr naming each of `says`, no traceback."""
  err = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
  assert len(err) == 1 and err[0].startswith("error: "), proc.stderr
  assert all(s in err[0] for s in says), (says, err[0])


# compare_tables.py


def _compare(tmp_path, committed: str | bytes, new: str | bytes, *extra: str):
  paths = []
  for name, text in (("committed.md", committed), ("new.md", new)):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    paths.append(str(path))
  return run_in_session([sys.executable, str(EXPERIMENTS / "compare_tables.py"), *extra, *paths])


def test_compare_tables_refuses_a_file_that_is_not_text(tmp_path):
  """A binary NEW.md (not UTF-8) raised UnicodeDecodeError with a traceback."""
  _one_error(_compare(tmp_path, TABLE, b"\xff\xfe\x00 binary"), "new.md", "tables.md")


@pytest.mark.parametrize(
  "committed, new",
  [("", ""), ("not a table\n", "not a table\n"), (TABLE, "")],
  ids=["both_empty", "both_prose", "new_empty"],
)
def test_compare_tables_refuses_a_file_without_a_table(tmp_path, committed, new):
  """Two files without a Markdown table (e.g. an empty tables.md) passed with exit 0 ("0/0
  means within"): the check held nothing to anything."""
  name = "committed.md" if "|" not in committed else "new.md"
  _one_error(_compare(tmp_path, committed, new), name, "no Markdown table")


def test_compare_tables_summary_line_counts_the_missing_cells(tmp_path):
  """run_all.sh prints only the summary line: a new table lacking a committed row read
  "0/0 means within the committed interval's half-width" there, as if all were well."""
  new = TABLE.replace("| a | 8 |", "| b | 8 |")
  proc = _compare(tmp_path, TABLE, new)
  assert proc.returncode == 1
  assert "1 committed rows removed" in proc.stdout.strip().splitlines()[-1], proc.stdout


def test_compare_tables_reads_a_malformed_number_as_no_mean(tmp_path):
  """A cell `0.5.1 [0.4, 0.6]` (a hand edit, a merge) matched the mean pattern and float()
  raised ValueError with a traceback; it is now a cell that is not a mean."""
  proc = _compare(tmp_path, TABLE, TABLE.replace("0.500 [", "0.5.1 ["))
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert "'0.5.1 [0.400, 0.600]'" in proc.stdout


@pytest.mark.parametrize("which", ["committed.md", "new.md"])
def test_compare_tables_refuses_a_cell_whose_interval_is_inverted(tmp_path, which):
  """A committed `0.5 [0.6, 0.4]` (a hand edit, a merge) was reported out of tolerance
  `(±-0.1)`, exit 1, as if the study had changed: it is a malformed cell, named."""
  bad = TABLE.replace("0.500 [0.400, 0.600]", "0.5 [0.6, 0.4]")
  committed, new = (bad, TABLE) if which == "committed.md" else (TABLE, bad)
  proc = _compare(tmp_path, committed, new)
  _one_error(proc, which, "table 0, row 'a', column 'acc': '0.5 [0.6, 0.4]'", "low <= high")
  assert proc.stdout == ""


@pytest.mark.parametrize(
  "args", [[], ["one.md"], ["a.md", "b.md", "c.md"], ["--strict", "a.md", "b.md"], ["-x", "a.md"]]
)
def test_compare_tables_names_its_usage_in_an_error_line(tmp_path, args):
  """A wrong number of files, or an option beside two files (`--strict`), printed a `usage:`
  line with no `error:`; an option with one file (`-x a.md`) was read as a file name."""
  proc = run_in_session(
    [sys.executable, str(EXPERIMENTS / "compare_tables.py"), *args], cwd=tmp_path
  )
  _one_error(proc, "COMMITTED.md NEW.md")


# summary.py


@pytest.fixture
def study(tmp_path, monkeypatch):
  """An experiments folder under `tmp_path`: a study `s1` (run.sh, claims.json) and a README.md
  with the table's markers, summary.HERE pointed at it."""
  here = tmp_path / "experiments"
  claim = {"id": "c1", "claim": "a beats b", "a": {"arm": ["1"], "col": "eval/accuracy@final"},
           "b": {"arm": ["0"], "col": "eval/accuracy@final"}, "direction": "+"}  # fmt: skip
  spec = {"group_by": ["x"], "baseline": ["0"], "confirmation_seeds": "100-123", "claims": [claim]}
  (here / "s1").mkdir(parents=True)
  (here / "s1" / "run.sh").write_text("")
  (here / "s1" / "claims.json").write_text(json.dumps(spec))
  (here / "README.md").write_text(f"# x\n{summary.BEGIN}\nold\n{summary.END}\n")
  monkeypatch.setattr(summary, "HERE", str(here))
  return here


def _exits_2(capsys, call, *says):
  """`call()` exits 2 with one `error:` line on stderr naming each of `says`."""
  with pytest.raises(SystemExit) as e:
    call()
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2, e.value.code
  assert len(err) == 1 and err[0].startswith("error: "), err
  assert all(s in err[0] for s in says), (says, err)


HEADER = "| claim | statement | a − b | expected | difference | n | p | verdict |\n|---|\n"


def test_summary_refuses_a_confirmation_row_cut_short(study, capsys):
  """A claims-table row with fewer cells than its header raised IndexError with a traceback."""
  (study / "s1" / "confirmation.md").write_text(f"{HEADER}| c1 | a beats b |\n")
  _exits_2(capsys, lambda: summary.table(), "confirmation.md", "c1", "8 cells")


def test_summary_refuses_a_confirmation_that_is_not_text(study, capsys):
  """A confirmation.md that is not UTF-8 raised UnicodeDecodeError with a traceback."""
  (study / "s1" / "confirmation.md").write_bytes(b"\xff\xfe\x00")
  _exits_2(capsys, lambda: summary.confirmed("s1"), "confirmation.md")


@pytest.mark.parametrize("raw", [None, "", "# tools/trivial_answers.py\nno best here\n"])
def test_summary_refuses_a_missing_or_wrong_trivial_raw(study, capsys, raw):
  """A page's `trivial_raw` that is missing raised FileNotFoundError, an empty one IndexError
  (each with a traceback), and one without a `best` line exited 1, the --check's "stale"."""
  spec = json.loads((study / "s1" / "claims.json").read_text())
  (study / "s1" / "pg.claims.json").write_text(json.dumps({**spec, "trivial_raw": "triv.txt"}))
  if raw is not None:
    (study.parent / "triv.txt").write_text(raw)  # from the repository's root, HERE's parent
  _exits_2(capsys, summary._page_trivial_lines, "triv.txt")


@pytest.mark.parametrize("raw", [3, ["triv.txt"], None, ""])
def test_summary_refuses_a_trivial_raw_that_is_not_a_path(study, capsys, raw):
  """A page's `trivial_raw` that is a number, a list or null raised TypeError in os.path.join
  with a traceback, and "" read the repository's root as a file; now the claims file's check
  names it."""
  spec = json.loads((study / "s1" / "claims.json").read_text())
  (study / "s1" / "pg.claims.json").write_text(json.dumps({**spec, "trivial_raw": raw}))
  _exits_2(capsys, summary._page_trivial_lines, "pg.claims.json", "'trivial_raw' must be")


def test_summary_without_its_markers_exits_2_and_keeps_the_readme(study, capsys):
  """A README.md without the table's markers exited 1, which --check uses for "stale"."""
  (study / "README.md").write_text("# no markers\n")
  _exits_2(capsys, lambda: summary.main(["--check"]), "README.md", "markers")
  _exits_2(capsys, lambda: summary.main([]), "README.md", "markers")
  assert (study / "README.md").read_text() == "# no markers\n"


def test_summary_without_its_readme_exits_2(study, capsys):
  """A missing experiments/README.md raised FileNotFoundError with a traceback."""
  (study / "README.md").unlink()
  _exits_2(capsys, lambda: summary.main(["--check"]), "README.md")
  assert not (study / "README.md").exists()


# study_stats.py


def test_paired_count_test_drops_a_seed_without_a_finite_value():
  """`paired_test` drops seeds whose value is NaN; `paired_count_test` counted a NaN as above
  the threshold (a discordant seed and one more n): it now drops it too, and its p-value is
  scipy's exact binomial test of the finite seeds' discordant pairs."""
  nan = float("nan")
  arm = {0: nan, 1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0}
  base = {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: math.inf}
  count, p = study_stats.paired_count_test(arm, base, at_most=0.5)
  assert (count.n, count.a, count.b, count.only_a, count.only_b) == (3, 3, 0, 3, 0), count
  assert p == pytest.approx(stats.binomtest(3, 3, 0.5).pvalue)


@pytest.mark.parametrize(
  "x, cell",
  [(9.9996, "10.0"), (-9.9996, "-10.0"), (999.96, "1.00e+03"), (9.9994, "9.999"), (10.0, "10.0")],
)
def test_fmt_words_a_number_by_its_rounded_size(x, cell):
  """`fmt` chose the format before rounding: 9.9996 printed `10.000` (3 decimals at 10) and
  999.96 printed `1000.0` (not the exponent form from 1000), against its docstring."""
  assert study_stats.fmt(x) == cell


# run_all.sh, study_env.sh, real_arms.sh


def _studies(tmp_path, names=("a", "b")):
  """A copy of run_all.sh and study_env.sh beside fake studies that each print a table."""
  root = tmp_path / "experiments"
  root.mkdir()
  for script in ("run_all.sh", "study_env.sh", "compare_tables.py"):
    shutil.copy(EXPERIMENTS / script, root / script)
  for name in names:
    (root / name).mkdir()
    (root / name / "run.sh").write_text(f"#!/usr/bin/env bash\necho '| {name} |'\n")
  return root


@pytest.mark.parametrize(
  "env, args, says",
  [
    ({"STUDIES": "a nope"}, [], ["STUDIES", "'nope'", "a b"]),
    ({}, ["a"], ["got: a", "STUDIES="]),
    ({"CONFIRM": "yes"}, [], ["CONFIRM=yes", "0 | 1"]),
    ({"STUDIES": ""}, [], ["STUDIES is empty", "a b"]),
    ({"STUDIES": " \t"}, [], ["STUDIES is empty", "a b"]),
  ],
)
def test_run_all_refuses_a_bad_input_before_any_study_runs(tmp_path, env, args, says):
  """An unknown study in STUDIES was run and reported FAILED (exit 1) after the others ran; an
  argument (`run_all.sh a`, as if it picked a study) was ignored and every study ran; CONFIRM=yes
  ran the exploration alone, with no confirmation and no word; STUDIES="" (a selection left
  empty, say by a script) ran every study, hours of them."""
  root = _studies(tmp_path)
  env = {"ROOT_BASE": str(tmp_path / "out"), **env}
  _one_error(run_in_session(["bash", str(root / "run_all.sh"), *args], env=env), *says)
  assert not list(root.glob("*/tables.md*")), "a study ran"


def test_run_all_refuses_a_root_base_it_cannot_create(tmp_path):
  """ROOT_BASE under a file: mkdir failed, and every study ran and FAILED on its log's path."""
  root = _studies(tmp_path)
  (tmp_path / "file").write_text("")
  env = {"ROOT_BASE": str(tmp_path / "file" / "out")}
  _one_error(run_in_session(["bash", str(root / "run_all.sh")], env=env), "ROOT_BASE", "file/out")
  assert not list(root.glob("*/tables.md*"))


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_a_study_refuses_a_confirm_it_does_not_know(tmp_path, value):
  """A study's run.sh (through study_env.sh) read CONFIRM=yes as 0: hours of exploration and no
  confirmation.md, without a word."""
  root = _studies(tmp_path, names=("s",))
  (root / "s" / "run.sh").write_text(
    '#!/usr/bin/env bash\nset -euo pipefail\nsource "$(dirname "$0")/../study_env.sh"\necho ran\n'
  )
  proc = run_in_session(
    ["bash", str(root / "s" / "run.sh")], env={"CONFIRM": value, "ROOT": str(tmp_path / "o")}
  )
  _one_error(proc, f"CONFIRM={value}", "0 | 1")
  assert "ran" not in proc.stdout


@pytest.mark.parametrize(
  "env, args, says",
  [
    ({}, ["clip_higher", "gpu"], ["after STUDY: gpu", "SIZE="]),
    ({"STEPS": "abc"}, ["clip_higher"], ["STEPS=abc", "positive whole number"]),
    ({"STEPS": "0"}, ["clip_higher"], ["STEPS=0", "positive whole number"]),
    ({"SEEDS": "0 1"}, ["clip_higher"], ["SEEDS=0 1", "0,1,2,3"]),
    ({"TABLES_ONLY": "yes"}, ["clip_higher"], ["TABLES_ONLY=yes", "0 | 1"]),
    ({"EXTRA_SET": "rl.num_prompts"}, ["clip_higher"], ["EXTRA_SET=rl.num_prompts", "key=value"]),
    ({}, ["clip_hihger"], ["STUDY=clip_hihger", "clip_higher |"]),
  ],
)
def test_real_arms_refuses_a_bad_input_before_any_pack_trains(tmp_path, env, args, says):
  """An extra argument (`real_arms.sh clip_higher gpu`, for SIZE=gpu) was ignored and the CPU
  size trained; TABLES_ONLY=yes trained both packs (15 minutes) instead of printing the tables;
  STEPS=abc and SEEDS='0 1' reached tools/sweep.py, whose error went to a log and the script
  exited with no word on the terminal."""
  env = {"ROOT": str(tmp_path / "root" / "real"), **env}
  proc = run_in_session(["bash", str(EXPERIMENTS / "real_arms.sh"), *args], env=env, timeout=90)
  _one_error(proc, *says)
  assert not (tmp_path / "root").exists(), "it wrote under ROOT"


def test_real_arms_names_a_failed_pack_and_its_log(tmp_path):
  """A pack whose sweep fails (here its root is a file) ended the script with the sweep's exit
  status and nothing on the terminal: the reason was only in the pack's log."""
  (tmp_path / "real").mkdir()
  (tmp_path / "real" / "clip").write_text("")
  env = {"ROOT": str(tmp_path / "real"), "STEPS": "1"}
  proc = run_in_session(
    ["bash", str(EXPERIMENTS / "real_arms.sh"), "clip_higher"], env=env, timeout=90
  )
  _one_error(proc, "clip pack failed", "is a file", f"{tmp_path / 'real'}.clip.log")
  assert proc.stdout == ""


def test_a_failed_confirmation_table_keeps_the_committed_one(tmp_path):
  """Each study's run.sh wrote `seed_table.py ... > confirmation.md`: a seed_table that failed
  emptied the committed table. Now `write_if_ok` (study_env.sh) replaces it only on success."""
  table = tmp_path / "confirmation.md"
  table.write_text("committed\n")
  script = (
    f"source {EXPERIMENTS / 'study_env.sh'}; "
    f"write_if_ok {table} sh -c 'echo partial; exit 3'; echo rc=$?; "
    f"write_if_ok {table} echo new"
  )
  proc = run_in_session(["bash", "-c", script], env={"ROOT": str(tmp_path / "root")})
  assert "rc=3" in proc.stdout, proc
  assert (
    proc.stderr.strip()
    == f"error: {table} kept as it was: the command that writes it failed (exit 3)"
  )
  assert table.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == [table.name]
  for run in sorted(EXPERIMENTS.glob("*/run.sh")):  # every study writes it through write_if_ok
    text = run.read_text()
    assert 'confirmation.md"' not in text.replace('write_if_ok "$HERE/confirmation.md"', ""), run


@pytest.mark.parametrize("flag", ["-h", "--help"])
@pytest.mark.parametrize(
  "script, usage",
  [
    ("compare_tables.py", "python experiments/compare_tables.py COMMITTED.md NEW.md"),
    ("summary.py", "python experiments/summary.py --check"),
  ],
)
def test_a_study_scripts_help_prints_its_usage(tmp_path, flag, script, usage):
  """--help was refused as an unknown option (exit 2); it prints the docstring, exit 0."""
  proc = run_in_session([sys.executable, str(EXPERIMENTS / script), flag])
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr
  assert usage in proc.stdout
