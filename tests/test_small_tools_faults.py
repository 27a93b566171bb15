"""tools/make_arith.py, tools/trivial_answers.py, tools/launch_local.py and tools/memory_table.py
refuse a bad input with one `error:` line on stderr naming it, exit status 2, nothing on stdout
and nothing already written lost; these were tracebacks, usage blocks, silently accepted
values, a clobbered dataset, or a table that misreported."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import REPO

from jaxrl_llm.data import arith, file_task, records

sys.path.insert(0, str(REPO / "tools"))
import launch_local
import make_arith
import memory_table
import trivial_answers

ARITH = f"--config={REPO / 'configs' / 'smollm2_arith.py'}"


def _refused(capsys, code: int, says: str = "") -> str:
  """Asserts exit status 2, one `error:` line on stderr (holding `says`) and no stdout."""
  out, err = capsys.readouterr()
  assert code == 2, (code, out, err)
  assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
  assert says in err and out == "", (says, err, out)
  return err


# ---- make_arith ----------------------------------------------------------------------------


def test_make_arith_refuses_to_overwrite_a_dataset_unless_told(tmp_path, capsys):
  """A second write into the same OUT_DIR replaced the first dataset without a word."""
  out = tmp_path / "arith"
  assert make_arith.cli([str(out), "--n_train=20", "--n_eval=5", "--seed=1"]) == 0
  before = {f.name: f.read_text() for f in out.iterdir()}
  capsys.readouterr()
  code = make_arith.cli([str(out), "--n_train=30", "--n_eval=6", "--seed=2"])
  _refused(capsys, code, "already holds train.jsonl, eval.jsonl, trivial.json; pass --overwrite")
  assert {f.name: f.read_text() for f in out.iterdir()} == before
  assert make_arith.cli([str(out), "--n_train=30", "--n_eval=6", "--seed=2", "--overwrite"]) == 0
  assert len((out / "eval.jsonl").read_text().splitlines()) == 6


def test_make_arith_leaves_no_half_dataset_where_a_file_is_a_directory(tmp_path, capsys):
  """With eval.jsonl a directory, train.jsonl was replaced before the write failed, leaving a
  new train split beside the old trivial.json and a stray .partial file."""
  out = tmp_path / "arith"
  assert make_arith.cli([str(out), "--n_train=20", "--n_eval=5"]) == 0
  (out / "eval.jsonl").unlink()
  (out / "eval.jsonl").mkdir()
  train = (out / "train.jsonl").read_text()
  capsys.readouterr()
  code = make_arith.cli([str(out), "--n_train=30", "--n_eval=6", "--seed=3", "--overwrite"])
  _refused(capsys, code, "eval.jsonl: is a directory")
  assert (out / "train.jsonl").read_text() == train
  assert sorted(f.name for f in out.iterdir()) == ["eval.jsonl", "train.jsonl", "trivial.json"]


def test_make_arith_names_an_empty_out_dir(capsys):
  """`make_arith.py ""` said `[Errno 2] No such file or directory: ''`."""
  _refused(capsys, make_arith.cli(["", "--n_eval=2"]), "OUT_DIR is empty")


@pytest.mark.parametrize("sizes", [["--n_eval=5000000"], ["--n_train=100000000", "--n_eval=2"]])
def test_make_arith_refuses_a_count_that_would_draw_for_hours(tmp_path, capsys, sizes):
  """`--n_eval=5000000` (a digit too many) drew for about two hours before writing anything;
  now the bounds are said in one line at once."""
  code = make_arith.cli([str(tmp_path / "a"), *sizes])
  _refused(capsys, code, "need 0 <= n_train <= 1000000 and 1 <= n_eval <= 100000")
  assert not (tmp_path / "a").exists()


# ---- trivial_answers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
  """A small arithmetic dataset (train 60, eval 40)."""
  out = tmp_path_factory.mktemp("arith")
  arith.write_splits(str(out), n_train=60, n_eval=40, seed=1)
  return out


def _table(capsys, *argv) -> dict:
  assert trivial_answers.main([*argv, "--json"]) == 0, capsys.readouterr().err
  return json.loads(capsys.readouterr().out)


def test_trivial_answers_refuses_a_mistyped_config_flag_in_one_line(capsys):
  """`--configs=FILE` passed the `--config` prefix test and ended in absl's traceback."""
  code = trivial_answers.main([f"--configs={REPO / 'configs' / 'countdown.py'}"])
  _refused(capsys, code, "unknown flag --configs=")


def test_trivial_answers_refuses_an_override_of_the_wrong_type_in_one_line(capsys):
  """`--config.task.numbers=abc` ended in absl's IllegalFlagValueError traceback."""
  code = trivial_answers.main([f"--config={REPO / 'configs' / 'countdown.py'}", "--config.task.numbers=abc"])  # fmt: skip
  _refused(capsys, code, "--config.task.numbers=abc")


@pytest.mark.parametrize(
  "line, says",
  [
    ('{"prompt": "x"', "eval.jsonl:2: not valid JSON"),  # was "line 2 column 1", no file
    ('{"prompt": "y", "answer": "4"}', "eval.jsonl:2: record has no field 'operands'"),  # KeyError
    ('{"prompt": "y", "answer": "4", "operands": 5}', "operands=5; want a non-empty list"),
    ('{"prompt": "y", "answer": "z", "operands": [1, 2]}', "answer='z'; want an integer"),
  ],
)
def test_trivial_answers_names_a_malformed_eval_record(tmp_path, capsys, arith_dir, line, says):
  """A bad second record was a traceback (KeyError, TypeError) or an error naming neither the
  file nor the record."""
  first = (arith_dir / "eval.jsonl").read_text().splitlines()[0]
  (tmp_path / "eval.jsonl").write_text(f"{first}\n{line}\n")
  code = trivial_answers.main([ARITH, f"--config.data.eval_files={tmp_path / 'eval.jsonl'}"])
  _refused(capsys, code, says)


def test_trivial_answers_reads_comma_separated_eval_files_as_the_trainer_does(
  tmp_path, capsys, arith_dir
):
  """`data.eval_files=a.jsonl,b.jsonl` (two files to the trainer) was opened as one path."""
  lines = (arith_dir / "eval.jsonl").read_text().splitlines(keepends=True)
  (tmp_path / "a.jsonl").write_text("".join(lines[:25]))
  (tmp_path / "b.jsonl").write_text("".join(lines[25:]))
  files = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
  table = _table(capsys, ARITH, f"--config.data.eval_files={files}")
  whole = arith.trivial_baselines([json.loads(x) for x in lines])
  assert table["n"] == 40 and table["best"] == whole["best"]


def test_trivial_answers_scores_the_eval_fraction_split_without_eval_files(capsys, arith_dir):
  """Without data.eval_files the trainer holds out data.eval_fraction of the train files; the
  tool said the (empty) eval files held no arithmetic records."""
  args = [f"--config.data.train_files={arith_dir / 'train.jsonl'}", "--config.data.eval_files="]
  table = _table(capsys, ARITH, *args, "--config.data.eval_fraction=0.25")
  loaded = records.load_records(str(arith_dir / "train.jsonl"), metadata_fields=("operands",))
  held = records.train_eval_split(loaded, eval_fraction=0.25, seed=file_task.SPLIT_KEY)[1]
  assert 0 < table["n"] == len(held) < 60
  assert table["best"] == arith.trivial_baselines(held)["best"]


# ---- launch_local --------------------------------------------------------------------------


def test_launch_local_without_a_command_or_with_help(capsys):
  """No `--`: the usage on stdout, exit 2, no `error:`; `--help` was the same, exit 2."""
  _refused(capsys, launch_local.main(["--processes=2"]), "no command: give it after `--`")
  assert launch_local.main(["--help"]) == 0
  assert capsys.readouterr().out.startswith("Rehearse a multi-host run")


@pytest.mark.parametrize(
  "flags, says",
  [
    (["--processes=0"], "--processes=0 --devices_per_process=4: both must be >= 1"),
    (["--processes=two"], "argument --processes: invalid int value: 'two'"),
    (["--bogus=1"], "unrecognized arguments: --bogus=1"),
    (["--port=-1"], "--port=-1: want 0 (a free one) or a port in [1, 65535]"),  # was accepted
    (["--port=70000"], "--port=70000"),  # was accepted
  ],
)
def test_launch_local_refuses_a_bad_flag_in_one_line(capsys, flags, says):
  """Argparse's usage block and `launch_local.py: error:` on two lines, or a port no process
  can listen on passed to every process."""
  _refused(capsys, launch_local.main([*flags, "--", sys.executable, "-c", "pass"]), says)


def test_launch_local_names_a_command_that_cannot_start(tmp_path, capsys):
  """A missing program was FileNotFoundError's traceback."""
  code = launch_local.main(["--processes=2", "--", str(tmp_path / "no_such_program")])
  _refused(capsys, code, "cannot start")


def test_launch_local_reports_a_signal_as_a_shell_does(capsys):
  """A process killed by SIGKILL made the job exit -9 (247 to a shell) instead of 137."""
  code = launch_local.main(["--processes=1", "--", "sh", "-c", "kill -9 $$"])
  assert code == 137, capsys.readouterr()


# ---- memory_table --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "flags, says",
  [
    (["--shapes=qwen9"], "unknown shape 'qwen9'"),  # no `error:`
    (["--targets=cpux:1"], "starts with cpu:, gpu: or tpu:"),  # no `error:`
    (["--targets=cpu:x"], "cpu:N wants a device count N >= 1, not 'x'"),  # traceback
    (["--targets=cpu:0"], "cpu:N wants a device count N >= 1, not '0'"),  # traceback
    (["--targets=cpu:1:fsdp=2"], "= 2 devices, but 1 are available"),  # traceback
    (["--targets=cpu:2:runs=2"], "give --runs=N too"),  # traceback
    (["--bogus"], "unrecognized arguments: --bogus"),  # usage block
    (["--runs=abc"], "invalid int value: 'abc'"),  # usage block
    (["--new_tokens=-5"], "--new_tokens=-5: want >= 0"),  # traceback
    (["--prompt_len=-1"], "--prompt_len=-1: want >= 0"),  # compiled
    (["--runs=-1"], "--runs=-1: want >= 0"),  # compiled
    (["--capacity_gib=0"], "--capacity_gib=0.0: want a number of GiB > 0"),  # "fits: no"
    (["--capacity_gib=nan"], "--capacity_gib=nan"),  # traceback
    (["--guard=held,cached"], "--guard=held,cached: unknown form 'cached'"),
    (["--set=model.bogus=1"], "unknown config field 'model.bogus'"),  # traceback
    (["--set=model.d_model=abc"], "--config.model.d_model=abc: invalid literal"),  # traceback
    # The compile's own device checks: a traceback after `[1/1] compiling ...`.
    (["--targets=cpu:3"], "on target 'cpu:3': invalid config: mesh.fsdp=3 does not divide"),
    (["--targets=cpu:8:fsdp=3"], "'cpu:8:fsdp=3': invalid config: mesh.fsdp=3 does not divide"),
    (["--targets=cpu:2,cpu:3:model=3"], "on target 'cpu:3:model=3': invalid config:"),
    (["--targets=cpu:8:fsdp=4:fsdp=2"], "axis 'fsdp' given twice"),  # the last one won
    (["--guard=held,held"], "--guard=held,held: form 'held' given twice"),  # planned twice
  ],
)
def test_memory_table_refuses_a_bad_argument_before_compiling(capsys, monkeypatch, flags, says):
  """Every bad argument is named before the first compile, in one `error:` line."""
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main adds fake devices
  shapes = [] if any(f.startswith("--shapes=") for f in flags) else ["--shapes=dense-e64-twin"]
  _refused(capsys, memory_table.main([*shapes, *flags]), says)  # --shapes given once


def test_memory_table_markdown_does_not_call_an_unknown_capacity_a_miss():
  """A row whose device reports no capacity (`fits` None) read `no` in the fits column."""
  row = {"shape": "s", "target": "gpu:1", "mesh": {"fsdp": 1}, "argument_gib": 1.0}
  row.update(temp_gib=1.0, peak_estimate_gib=2.0, capacity_gib=None, fits=None)
  assert memory_table.markdown([row]).splitlines()[-1].endswith("| – | unknown |")
