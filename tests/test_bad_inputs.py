"""Bad inputs to the trainer and its tools: each is one `error: ...` line with exit status 2,
refused before anything is written."""

import os
import pathlib
import subprocess
import sys

import pytest
from conftest import REPO, cli_env

sys.path.insert(0, str(REPO / "tools"))
import compare
import sweep

from jaxrl_llm.config import ConfigError

CONFIG = f"--config={REPO / 'configs' / 'default.py'}"


def _main(*args):
  """Runs the trainer's command line as a user would; (exit status, stderr's lines)."""
  cmd = [sys.executable, "-m", "jaxrl_llm.main", CONFIG, *args]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.slow
def test_a_seed_outside_its_range_is_one_line_before_the_workdir_is_made(tmp_path):
  """A seed must be in [0, 2**32): refused at config parse (it was a numpy traceback after
  the workdir's checkpoints/ and log.txt were made, and a dry run said it fits). The command
  line's four ways for one seed; the parse for each."""
  from conftest import tiny_config

  from jaxrl_llm.config import parse

  for seed in (-1, 2**32, 99999999999999999999):
    with pytest.raises(ConfigError) as e:
      parse(tiny_config(seed=seed))
    assert str(e.value) == f"invalid config: seed={seed} must be in [0, 2**32)"
  seed, workdir = "4294967296", tmp_path / "run"
  code, err = _main(f"--workdir={workdir}", f"--config.seed={seed}")
  assert (code, err) == (2, [f"error: invalid config: seed={seed} must be in [0, 2**32)"])
  assert not workdir.exists()
  code, err = _main("--dry_run", f"--config.seed={seed}")
  assert (code, err) == (2, [f"error: invalid config: seed={seed} must be in [0, 2**32)"])
  for where in (f"--workdir={workdir}", "--dry_run"):  # --debug: the traceback, the same status
    code, err = _main(where, f"--config.seed={seed}", "--debug")
    assert code == 2 and "Traceback (most recent call last):" in err, err
    assert err[-1].endswith(f"invalid config: seed={seed} must be in [0, 2**32)"), err
  assert not workdir.exists()


def test_a_refused_launch_in_an_existing_workdir_says_why_in_its_log_too(tmp_path):
  """A bad config in a workdir that exists (a relaunch): the workdir stays, nothing else is
  written, and log.txt holds the error line after the launch's header (it held the header
  alone, which read like a launch that ended without a word)."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "notes.txt").write_text("mine")
  code, err = _main(f"--workdir={workdir}", "--config.seed=-1")
  line = "error: invalid config: seed=-1 must be in [0, 2**32)"
  assert (code, err) == (2, [line])
  assert sorted(p.name for p in workdir.iterdir()) == ["log.txt", "notes.txt"]
  log = (workdir / "log.txt").read_text().strip().splitlines()
  assert log[0].startswith("### ") and log[-1].endswith(line), log


def test_a_refused_launch_removes_the_parent_folders_it_made_and_only_those(tmp_path):
  """--workdir=new/deeper/run with a bad config: the folders the launch made for it go with the
  workdir (`new/` and `new/deeper/` were left behind, empty); a parent that was there stays."""
  there = tmp_path / "there"
  there.mkdir()
  line = "error: model.checkpoint='/nonexistent' is not a directory"
  for workdir in (tmp_path / "new" / "deeper" / "run", there / "made" / "run"):
    code, err = _main(f"--workdir={workdir}", "--config.model.checkpoint=/nonexistent")
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]
  assert list(there.iterdir()) == []


def test_a_sweep_over_a_bad_seed_is_refused_before_any_run(tmp_path, capsys):
  """--seeds=0,-1 (packed or not) is one line up front; the good seed was trained then died."""
  root = tmp_path / "sweep"
  for extra in ([], ["--packed"]):
    assert sweep.main([CONFIG, f"--root={root}", "--seeds=0,-1", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: grid point seed=-1: invalid config: seed=-1 must be in [0, 2**32)"]
  assert sweep.main([CONFIG, f"--root={root}", "--seeds=0,a"]) == 2  # named as --config.seed=a
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: --seeds='0,a': 'a' is not a whole number; give seeds as 0,1,2"], err
  assert not root.exists()


@pytest.mark.slow
def test_a_host_tool_that_cannot_be_imported_is_one_config_line(tmp_path):
  """sampling.tool=host:M:F naming no importable callable is refused at config parse in one
  line, exit 2, no workdir made (it was a 30-line traceback from building the sampler)."""
  workdir = tmp_path / "run"
  code, err = _main(f"--workdir={workdir}", "--config.sampling.tool=host:nosuchmod:f")
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith("error: invalid config: sampling.tool='host:nosuchmod:f': cannot ")
  assert "No module named 'nosuchmod'" in err[0] and "allowed: host:<module>:<function>" in err[0]
  assert not workdir.exists()
  code, err = _main("--dry_run", "--config.sampling.tool=host:os:sep")  # not a callable
  assert code == 2 and len(err) == 1 and "os.sep is a str, not a callable" in err[0], err


@pytest.mark.parametrize("gib", ["nan", "inf", "-1", "0"])
def test_dry_run_refuses_a_memory_capacity_that_is_not_a_positive_number(gib):
  """--device_memory_gib must be finite and > 0 (nan was a traceback, -1 'does NOT fit in
  -1024.0 MiB')."""
  code, err = _main("--dry_run", f"--device_memory_gib={gib}")
  assert code == 2 and len(err) == 1, err
  assert (
    err[0].startswith("error: --device_memory_gib=") and "must be a finite number > 0" in err[0]
  )


def test_a_dry_run_names_a_missing_data_file_in_one_line(tmp_path, capsys):
  """A dry run (the trainer's, a packed sweep's) of a prompt-file run whose file is missing:
  the run's one line naming `data.train_files`, exit 2 (both were a 40-line traceback, exit 1;
  only a bad config value was one line)."""
  missing = tmp_path / "none.jsonl"
  line = f"error: data.train_files='{missing}': Dataset file {missing} does not exist."
  files = [f"--config.data.train_files={missing}", "--config.sft.steps=0"]
  assert _main("--dry_run", *files) == (2, [line])
  root = tmp_path / "pack"
  argv = [CONFIG, f"--root={root}", "--seeds=0,1", "--packed", "--dry_run"]
  assert sweep.main([*argv, f"--set=data.train_files={missing}", "--set=sft.steps=0"]) == 2
  err = capsys.readouterr().err
  assert err.strip().splitlines() == [line], err
  assert not root.exists()


def test_a_missing_workdir_is_one_line():
  """No --workdir (and no --dry_run): one line and exit 2, not 39 lines of usage and exit 1."""
  assert _main() == (2, ["error: --workdir is required (a directory; not needed with --dry_run)"])


def test_a_stray_argument_is_one_line_before_the_workdir_is_made(tmp_path):
  """A word that is not a flag (an unquoted space, a field without --config.): one line and
  exit 2, not the whole usage text and exit 1."""
  workdir = tmp_path / "run"
  code, err = _main(f"--workdir={workdir}", "train.num_steps=5")
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith("error: unexpected arguments ['train.num_steps=5']; allowed: "), err
  assert not workdir.exists()


@pytest.mark.parametrize(
  "args,want",
  [
    (  # absl said `Unknown command line flag 'config.task.name'` with a hint about the type
      ["--config.task.name=countdown"],
      "error: --config.task.name=countdown overrides a config, and no --config=FILE names one "
      "(e.g. --config=configs/default.py before it)",
    ),
    (  # absl said "The flag 'config.train.num_steps' is defined twice"; the tool read the last
      ["--config=configs/default.py", "--config=configs/countdown.py", "--config.seed=1"],
      "error: --config is given 2 times (configs/default.py, configs/countdown.py); a run reads "
      "one config: give one --config=FILE[:SETTING] and set fields with "
      "--config.SECTION.FIELD=VALUE",
    ),
  ],
  ids=["override-without-config", "two-configs"],
)
def test_a_config_flag_fault_is_one_line_in_the_trainer_and_the_tool(tmp_path, args, want):
  """An override without a config, and two config files: the same line from the trainer and
  from tools/trivial_answers.py (the same check), making no workdir."""
  workdir = tmp_path / "run"
  trainer = [sys.executable, "-m", "jaxrl_llm.main", f"--workdir={workdir}"]
  tool = [sys.executable, str(REPO / "tools" / "trivial_answers.py")]
  for cmd in (trainer, tool):
    run = dict(cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    proc = subprocess.run([*cmd, *args], **run)
    assert (proc.returncode, proc.stdout, proc.stderr.strip().splitlines()) == (2, "", [want])
  assert not workdir.exists()


def test_the_config_may_follow_a_space_and_a_later_override_wins():
  """`--config FILE` (a space, which absl takes) read as no config named, and two files so
  given slipped past the two-config line. A field given twice takes the last value (absl's
  rule, docs/running.md), so a script may append overrides to a base command line."""
  from jaxrl_llm import launch
  from jaxrl_llm.config import ConfigError, command_line

  base = ["main", "--config", "configs/default.py"]
  command_line.check_overrides([*base, "--config.seed=5", "--config.objective.clip_low", "-0.5"])
  with pytest.raises(ConfigError, match=r"--config is given 2 times \(configs/default.py, "):
    command_line.check_overrides([*base, "--config", "configs/dapo.py"])
  got = launch.parse_config([*base, "--config.seed=1", "--config.seed", "2"])
  assert got.seed == 2


def test_a_mistyped_config_prefix_is_one_line_naming_the_form(tmp_path):
  """`--confg.train.num_steps=2` read absl's `Unknown command line flag 'confg.train.num_steps'`
  with no word of the --config.SECTION.FIELD form; a negative value given apart (`-0.5`) is
  not taken for such a flag."""
  workdir = tmp_path / "run"
  base = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  run = dict(cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
  proc = subprocess.run([*base, f"--workdir={workdir}", "--confg.train.num_steps=2"], **run)
  assert (proc.returncode, proc.stdout, proc.stderr.strip().splitlines()) == (2, "", [
    "error: --confg.train.num_steps=2: no flag confg.*; config fields are set as "
    "--config.SECTION.FIELD=VALUE (e.g. --config.train.num_steps=100)"
  ])  # fmt: skip
  assert not workdir.exists()
  from jaxrl_llm.config import command_line

  command_line.check_overrides(
    ["main", "--config=configs/default.py", "--config.objective.clip_low", "-0.5"]
  )


def test_a_checkpoints_file_in_the_workdir_is_one_line_and_is_kept(tmp_path):
  """`W/checkpoints` a file, not a folder: one line naming it at start-up (it was a
  NotADirectoryError traceback from the checkpointer, exit 1), and the file is left as it was."""
  workdir = tmp_path / "w"
  workdir.mkdir()
  (workdir / "checkpoints").write_text("mine")
  code, err = _main(f"--workdir={workdir}")
  assert code == 2 and len(err) == 1, err
  assert err[0] == (
    f"error: --workdir={workdir}: {workdir / 'checkpoints'} is a file, not a directory; move it "
    "away (the run keeps its checkpoints there) or give another directory"
  )
  assert (workdir / "checkpoints").read_text() == "mine"


def test_a_hugging_face_model_folder_as_the_workdir_is_refused_and_left_as_it_was(tmp_path):
  """--workdir naming a model's folder: its config.json was read as a run record without a
  config (a missing "config" passed as empty), and the run wrote its checkpoints, log and
  records into the model's folder. Now one line before anything is written there; another
  JSON object without "config" is still a damaged run record."""
  import shutil

  from jaxrl_llm.run import changes

  model = pathlib.Path(
    shutil.copytree(REPO / "tests" / "fixtures" / "hf" / "llama", tmp_path / "m")
  )
  before = sorted(p.name for p in model.iterdir())
  code, err = _main(f"--workdir={model}")
  assert (code, err) == (
    2,
    [
      f"error: --workdir={model}: a Hugging Face model's config.json, not a run record: this "
      "folder holds a model; give the run a --workdir of its own (model.checkpoint may name this "
      "folder)"
    ],
  )
  assert sorted(p.name for p in model.iterdir()) == before
  with pytest.raises(ConfigError, match=r"a Hugging Face model's config\.json"):
    changes.newest_record(str(model))  # a remote workdir's check
  (tmp_path / "w").mkdir()
  (tmp_path / "w" / "config.json").write_text('{"seed": 1}')
  with pytest.raises(ConfigError, match='not an object with a "config" object'):
    changes.newest_record(str(tmp_path / "w"))


def test_a_negative_completion_budget_is_one_reason_not_two(tmp_path):
  """max_new_tokens=-1 names itself only: the turn budget's check (turn_tokens <= T) said
  "allowed: 0 (off) to -1" for a turn budget nobody set."""
  code, err = _main(f"--workdir={tmp_path / 'run'}", "--config.sampling.max_new_tokens=-1")
  assert (code, err) == (2, ["error: invalid config: sampling.max_new_tokens=-1 must be >= 0"])


def test_compare_refuses_a_csv_path_it_cannot_write_before_reading_runs(tmp_path, capsys):
  """--csv naming a directory, a path under a file or a URL: one line, exit 2 (the first two
  were IsADirectoryError / NotADirectoryError tracebacks after the table was printed)."""
  (tmp_path / "f").write_text("x")
  cases = {
    str(tmp_path): "is a directory; give a file path",
    str(tmp_path / "f" / "x.csv"): f"cannot be written: its folder {tmp_path / 'f'} is a file",
    "gs://bucket/x.csv": "is a URL; give a local file path",
  }  # a missing folder is made (test_plot_compare_faults.py)
  for path, says in cases.items():
    assert compare.main([f"--root={tmp_path}", f"--csv={path}"]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --csv={path}: {says}"), err
    assert out.out == ""  # refused before any run is read or printed
  assert (tmp_path / "f").read_text() == "x"
  flags = {  # the table's width, and a tag asked to be best both ways
    "--width=-5": "error: --width=-5 must be >= 0 (0: one block)",
    "--minimize=eval/*": "error: 'eval/*' is in both --minimize and --maximize; name it in one",
  }
  for flag, says in flags.items():
    assert compare.main([f"--root={tmp_path}", flag, "--maximize=eval/*,x"]) == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [says] and out.out == ""


def test_a_sweep_root_that_cannot_be_made_is_one_line(tmp_path, capsys):
  """A --root whose folder cannot be created (here under /proc) is refused up front, as the
  trainer refuses such a --workdir; it was a FileNotFoundError traceback from os.makedirs."""
  if not (sys.platform.startswith("linux") and __import__("os").path.isdir("/proc")):
    pytest.skip("needs Linux's /proc")
  assert sweep.main([CONFIG, "--root=/proc/nope", "--grid=seed=0,1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --root=/proc/nope: cannot create it"), err
  for root in (tmp_path / ("n" * 300), tmp_path / "a" / ("n" * 300)):  # a name too long
    assert sweep.main([CONFIG, f"--root={root}", "--grid=seed=0,1"]) == 2  # was a traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --root={root}: cannot create it: "), err
    assert "has 300 bytes, over the 255 a name may have there" in err[0], err
  for bad in ("-1", "0", "nan"):  # how often a running run's line shows
    assert sweep.main([CONFIG, f"--root={tmp_path}", "--grid=seed=0,1", f"--progress_s={bad}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --progress_s must be a number of seconds > 0, got {float(bad)}"], err
  assert not list(tmp_path.iterdir())  # nothing started
  # The check leaves nothing behind where it could make the folders.
  assert sweep.main([CONFIG, f"--root={tmp_path / 'a' / 'b'}", "--seeds=0", "--dry_run"]) == 0
  assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_resuming_after_a_prompt_file_changed_is_refused_naming_the_file(tmp_path):
  """A prompt file replaced at the same path (other records) is a changed data setting: the
  resume is refused in one line naming the file, nothing written; train.resume_changed resumes.
  A record written before the files' hashes were kept still resumes."""
  import json

  from conftest import tiny_config
  from text_fixtures import math_file_run, write_math_jsonl

  from jaxrl_llm.config import ConfigError, parse
  from jaxrl_llm.run import changes, train_and_evaluate

  overrides, _ = math_file_run(tmp_path)
  overrides |= {"train.num_steps": 2, "train.eval_every": 2, "train.checkpoint_every": 2}
  workdir, data = str(tmp_path / "run"), overrides["data.train_files"]
  train_and_evaluate(parse(tiny_config(**overrides)), workdir)
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert list(saved["data_files"]) == [data, changes.TOKENIZER]
  assert saved["data_files"][data]["bytes"] > 0
  unset = saved["config"]["objective"]["clip_high"] is None  # the objective's default: as used
  assert unset and saved["resolved"]["objective.clip_high"] == 0.2
  write_math_jsonl(data, n=40)  # other contents, same path
  more = overrides | {"train.num_steps": 3, "train.eval_every": 3, "train.checkpoint_every": 3}
  listing = sorted(p.name for p in (tmp_path / "run").iterdir())
  with pytest.raises(ConfigError) as err:
    train_and_evaluate(parse(tiny_config(**more)), workdir)
  line = str(err.value)
  assert "\n" not in line and f"data file {data}: " in line, line
  assert "--config.train.resume_changed=True" in line
  assert sorted(p.name for p in (tmp_path / "run").iterdir()) == listing
  assert sweep.committed_steps(workdir) == [2]
  # An older record, without the files' hashes: nothing to compare, the resume goes on.
  kept = (tmp_path / "run" / "config.json").read_text()
  del saved["data_files"]
  (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
  assert changes.changed_data(parse(tiny_config(**more)), workdir) == []
  (tmp_path / "run" / "config.json").write_text(kept)
  # Told to: it resumes, and records the files it now reads.
  train_and_evaluate(parse(tiny_config(**more, **{"train.resume_changed": True})), workdir)
  assert sweep.committed_steps(workdir)[-1] == 3
  resumed = json.loads((tmp_path / "run" / "config.resume-2.json").read_text())
  assert resumed["data_files"][data] != json.loads(kept)["data_files"][data]


def test_a_resume_reads_the_same_prompt_files_under_other_paths_and_names_a_new_split(
  tmp_path, monkeypatch
):
  """The same prompt file named by a relative path (or moved, or matched by a glob) was refused
  as a change of `data.train_files`, the line saying one file was gone and another new; now
  only bytes and order count. Held-out files added to prompt files split by
  `data.eval_fraction` changed the records that train without a word; now that is a change."""
  import shutil

  from conftest import tiny_config
  from text_fixtures import math_file_run, write_math_jsonl

  from jaxrl_llm.config import parse
  from jaxrl_llm.run import changes, train_and_evaluate

  overrides, _ = math_file_run(tmp_path)
  overrides |= {"train.num_steps": 1, "train.eval_every": 1, "train.checkpoint_every": 1}
  workdir = str(tmp_path / "run")
  train_and_evaluate(parse(tiny_config(**overrides)), workdir)
  moved = tmp_path / "moved"
  moved.mkdir()
  shutil.copy(overrides["data.train_files"], moved / "math.jsonl")
  monkeypatch.chdir(tmp_path)
  for spelt in ("math.jsonl", "./math.jsonl", str(moved / "math.jsonl"), str(moved / "m*.jsonl")):
    cfg = parse(tiny_config(**overrides | {"data.train_files": spelt}))
    assert changes.changed_learner(cfg, workdir) == changes.changed_data(cfg, workdir) == []
  write_math_jsonl(moved / "math.jsonl", n=40)  # other bytes under the new path: a change
  cfg = parse(tiny_config(**overrides | {"data.train_files": str(moved / "math.jsonl")}))
  assert [line.split(":")[0] for line in changes.changed_data(cfg, workdir)] == [
    f"data file {overrides['data.train_files']}",
    f"data file {moved / 'math.jsonl'}",
  ]
  held = str(tmp_path / "held.jsonl")
  write_math_jsonl(held, n=8)
  cfg = parse(tiny_config(**overrides | {"data.eval_files": held}))
  assert changes.changed_learner(cfg, workdir) == [
    f"data.eval_files: '' → {held!r} (the held-out share data.eval_fraction=0.25 is no longer "
    "split off the train files: other records train)"
  ]


def test_a_resume_that_reads_the_prompts_through_another_vocabulary_is_named(tmp_path):
  """The run record keeps the prompts' tokenizer's vocabulary (tokens and ids, wherever the
  tokenizer lies): a resume with a tokenizer of other ids is a changed data setting, named
  with both sizes (it resumed without a word, the policy reading prompts through ids it never
  learned); the same tokenizer copied elsewhere is no change; an older record without the
  vocabulary compares nothing."""
  import json
  import shutil

  from conftest import tiny_config
  from text_fixtures import build_bpe_tokenizer, math_file_run

  from jaxrl_llm.config import parse
  from jaxrl_llm.run import changes

  overrides, _ = math_file_run(tmp_path)
  config = parse(tiny_config(**overrides))
  run = tmp_path / "run"
  run.mkdir()
  saved = {"config": json.loads(config.to_json()), "data_files": changes.data_files(config)}
  (run / "config.json").write_text(json.dumps(saved))
  assert saved["data_files"][changes.TOKENIZER]["tokens"] > 0
  moved = shutil.copytree(overrides["data.tokenizer"], tmp_path / "elsewhere")
  assert (
    changes.changed_data(
      parse(tiny_config(**{**overrides, "data.tokenizer": str(moved)})), str(run)
    )
    == []
  )
  other = build_bpe_tokenizer(tmp_path / "other", vocab_size=300, eos_token="<|im_end|>")
  changed = changes.changed_data(
    parse(tiny_config(**{**overrides, "data.tokenizer": str(other)})), str(run)
  )
  was = saved["data_files"][changes.TOKENIZER]["tokens"]
  assert len(changed) == 1 and changed[0].startswith(f"tokenizer vocabulary: {was} tokens, "), (
    changed
  )
  del saved["data_files"][changes.TOKENIZER]
  (run / "config.json").write_text(json.dumps(saved))
  assert (
    changes.changed_data(
      parse(tiny_config(**{**overrides, "data.tokenizer": str(other)})), str(run)
    )
    == []
  )


def _checkpoint_with_context(folder, positions: int, **fields):
  """The tiny qwen2 fixture copied into `folder` with max_position_embeddings=`positions` (and
  the config.json `fields` given)."""
  import json
  import shutil

  fixture = REPO / "tests" / "fixtures" / "hf" / "qwen2"
  shutil.copytree(fixture, folder)
  config = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(
    json.dumps(config | {"max_position_embeddings": positions, **fields})
  )
  return folder


def test_a_prompt_and_completion_longer_than_the_checkpoints_context_are_refused(tmp_path):
  """With model.checkpoint, the prompt plus the completion budget the sampler allocates (with a
  tool: every segment and tool answer) must fit config.json's max_position_embeddings: one
  line naming both and the limit; a sum equal to it builds."""
  import re

  from conftest import tiny_config
  from parsed import build

  from jaxrl_llm.config import ConfigError

  small = _checkpoint_with_context(tmp_path / "ckpt", 8)
  base = {"model.checkpoint": str(small), "sampling.max_new_tokens": 6}
  with pytest.raises(ConfigError) as err:
    build(tiny_config(**base), abstract=True)
  line = str(err.value)
  assert "\n" not in line and "the task's prompt length " in line, line
  assert "+ sampling.max_new_tokens=6 = " in line
  assert f"max_position_embeddings=8 in {small / 'config.json'}" in line
  total = int(re.search(r"= (\d+) tokens exceed", line).group(1))
  tool = {"sampling.tool": "calculator", "sampling.max_new_tokens": 0}
  with pytest.raises(ConfigError, match=r"sampling\.max_turns=3 segments and the tool's answers"):
    build(tiny_config(**(base | tool)), abstract=True)
  fits = _checkpoint_with_context(tmp_path / "fits", total)
  exp = build(tiny_config(**(base | {"model.checkpoint": str(fits)})), abstract=True)
  assert exp.prompt_len + 6 == total
  (small / "config.json").write_text("{not json")  # the loader's one line, naming the file
  from jaxrl_llm.models.hf_config import CheckpointFormatError

  with pytest.raises(CheckpointFormatError, match=f"^{small / 'config.json'}: not valid JSON"):
    build(tiny_config(**base), abstract=True)


def test_the_dry_run_refuses_a_prompt_file_run_over_the_checkpoints_context(tmp_path):
  """The command line's dry run of a prompt-file run whose data.prompt_len + max_new_tokens
  exceed the checkpoint's context: one line, exit 2 (it said the run fits)."""
  from conftest import TINY_CLI
  from text_fixtures import math_file_run

  overrides, _ = math_file_run(tmp_path)
  small = _checkpoint_with_context(tmp_path / "ckpt", 100, vocab_size=512)  # the BPE's 400 fit
  flags = [f"--config.{k}={v}" for k, v in overrides.items() if k != "model.vocab_size"]
  code, err = _main(
    "--dry_run", *TINY_CLI, *flags, f"--config.model.checkpoint={small}", "--config.sft.steps=0"
  )
  assert code == 2 and err[-1].startswith("error: invalid config: data.prompt_len=128 + "), err
  assert "sampling.max_new_tokens=12 = 140 tokens" in err[-1]
  assert "max_position_embeddings=100" in err[-1]


def test_the_real_model_config_without_the_model_says_how_to_fetch_it(tmp_path):
  """configs/smollm2_arith.py on a machine whose cache lacks the model: one line naming the
  directory and the command that fetches it, and no workdir made."""
  env = cli_env() | {"JAXRL_LLM_CACHE": str(tmp_path / "empty_cache")}
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/smollm2_arith.py"]
  proc = subprocess.run(
    [*cmd, f"--workdir={workdir}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert str(tmp_path / "empty_cache" / "SmolLM2-135M-Instruct") in lines[0]
  assert lines[0].endswith("; fetch it first: python tools/get_smollm2.py")
  assert not (workdir / "checkpoints").exists()


@pytest.mark.parametrize(
  "config, says",
  [
    ("configs/lora.py:x", "configs/lora.py has no settings to choose (its get_config takes "
     "none): drop ':x' from --config=configs/lora.py:x"),
    ("configs/lora.py:", "--config=configs/lora.py: ends in ':' with no setting after it: drop "
     "the ':' or name a setting"),
  ],
)  # fmt: skip
def test_a_setting_asked_of_a_config_without_settings_is_one_plain_line(tmp_path, config, says):
  """`--config=configs/lora.py:x` (lora.py's get_config takes no setting) and a trailing ':'
  with nothing after it: one line each (both were Python's "takes 0 positional arguments but 1
  was given" traceback, the second through ml_collections), and no workdir made."""
  cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={config}"]
  proc = subprocess.run(
    [*cmd, f"--workdir={tmp_path / 'run'}"], cwd=REPO, env=cli_env(), capture_output=True,
    text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"error: {says}"]
  assert not (tmp_path / "run").exists()


def test_a_missing_config_is_one_line_without_the_override_hint(tmp_path):
  """No --config: one line saying what it takes (absl's "flag --config=None: ..." named neither
  a file nor an example), without the hint about --config.FIELD=VALUE types that a bad
  override gets (and still gets). Nothing is made."""
  base = [sys.executable, "-m", "jaxrl_llm.main", f"--workdir={tmp_path / 'run'}"]
  run = lambda *a: subprocess.run(  # noqa: E731
    [*base, *a], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120
  )
  proc = run()
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
    "error: --config is required: an experiment config file, e.g. --config=configs/default.py "
    "(configs/ holds the recipes)"
  ]
  assert not (tmp_path / "run").exists()
  proc = run("--config=configs/default.py", "--config.train.num_steps=abc")
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1
  assert lines[0].endswith("(a --config.FIELD=VALUE takes the type of the field's default)")


def test_a_sweep_root_with_an_unreadable_run_record_is_one_line(tmp_path, capsys):
  """A run's run.json that is not JSON, or a directory: one line naming it (they were
  JSONDecodeError / IsADirectoryError tracebacks); --seeds=0,0 names --seeds, not --grid."""
  for i, make in enumerate([lambda p: p.write_text("{oops"), lambda p: p.mkdir()]):
    root = tmp_path / f"sweep{i}"
    (root / "seed=0").mkdir(parents=True)
    make(root / "seed=0" / "run.json")
    assert sweep.main([CONFIG, f"--root={root}", "--seeds=0", "--dry_run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {root / 'seed=0' / 'run.json'}: cannot be read"), err
  assert sweep.main([CONFIG, f"--root={tmp_path / 'new'}", "--seeds=0,0", "--dry_run"]) == 2
  assert capsys.readouterr().err.strip() == "error: --seeds='0,0': repeated value"


def test_compare_sorts_a_nan_last_and_refuses_a_glob_that_matches_nothing(tmp_path, capsys):
  """--sort with a run whose final value is NaN: the finite values largest first, the NaN
  last (the NaN broke the sort: 0.1186 above 0.12); --tags with a glob no run logged is one
  line (it printed a table of run and step alone, exit 0)."""
  import json

  from jaxrl_llm import metrics

  for name, v in {"a": 0.1186, "b": float("nan"), "c": 0.12, "d": 0.05}.items():
    run = tmp_path / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": {"seed": 0}}))
    writer = metrics.SummaryWriter(str(run))
    writer.scalars(10, {"eval/accuracy": v})
    writer.close()
  _, rows = compare.compare(str(tmp_path), ["eval/accuracy"], sort="eval/accuracy")
  assert [r[0] for r in rows] == ["c", "a", "d", "b"], rows
  assert compare.main([f"--root={tmp_path}", "--tags=evl/*"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: tag pattern 'evl/*' matches no tag"), err


def test_summary_refuses_an_argument_it_does_not_know_without_writing(tmp_path):
  """`summary.py --chek` (a typo of the CI check) rewrote experiments/README.md and exited 0."""
  readme = REPO / "experiments" / "README.md"
  before = readme.stat().st_mtime_ns
  proc = subprocess.run(
    [sys.executable, str(REPO / "experiments" / "summary.py"), "--chek"],
    capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout
  assert proc.stderr.startswith("error: unexpected arguments ['--chek']"), proc.stderr
  assert readme.stat().st_mtime_ns == before


def test_a_sweep_root_holding_the_other_kind_of_checkpoints_is_refused(tmp_path, capsys):
  """A packed sweep over a root of runs trained one by one (checkpoints in each workdir), or
  separate runs over a pack's root (checkpoints in ROOT/checkpoints): one line (the other kind
  trained every finished run again from step 0, beside its old events)."""
  import jax.numpy as jnp
  from conftest import save_trainer_checkpoint

  params = {"w": jnp.zeros((2,), jnp.float32)}
  runs = tmp_path / "runs"
  save_trainer_checkpoint(runs / "seed=0", params, {})
  assert sweep.main([CONFIG, f"--root={runs}", "--seeds=0,1", "--packed", "--dry_run"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "holds runs trained one by one" in err[0], err
  assert "drop --packed to resume them" in err[0]
  pack = tmp_path / "pack"
  save_trainer_checkpoint(pack, params, {})
  assert sweep.main([CONFIG, f"--root={pack}", "--seeds=0,1", "--dry_run"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "holds a pack's checkpoints" in err[0], err
  assert sweep.main([CONFIG, f"--root={runs}", "--seeds=0,1", "--dry_run"]) == 0  # its own kind


def test_a_setting_the_run_never_reads_is_one_line_before_the_workdir_is_made(tmp_path):
  """--config.kl.name=k2 with the default kl.beta=0 trained with no KL term, exit 0."""
  workdir = tmp_path / "run"
  code, err = _main(f"--workdir={workdir}", "--config.kl.name=k2")
  assert (code, err) == (
    2,
    [
      "error: invalid config: kl.name='k2' has no effect: kl.beta=0 has no KL term (set kl.beta > "
      "0); drop it or set what it acts with"
    ],
  )
  assert not workdir.exists()


@pytest.mark.parametrize("field", ["data.tokenizer=/nowhere", "data.prompt_len=1"])
def test_a_prompt_file_setting_on_a_built_in_task_is_one_line(tmp_path, field):
  """A data.* setting without data.train_files (the built-in task reads no files) trained as if
  it were not there, exit 0: a user who thought their tokenizer was used had no hint."""
  workdir = tmp_path / "run"
  code, err = _main(f"--workdir={workdir}", f"--config.{field}")
  name, value = field.split("=")
  shown = repr(value) if name == "data.tokenizer" else value
  assert (code, err) == (
    2,
    [
      f"error: invalid config: {name}={shown} has no effect: data.train_files is empty: the "
      "built-in task 'reverse' reads no files; drop it or set what it acts with"
    ],
  )
  assert not workdir.exists()


def test_a_memory_to_plan_against_without_a_dry_run_is_one_line(tmp_path):
  """--device_memory_gib is read only by --dry_run; a training run ignored it without a word."""
  workdir = tmp_path / "run"
  code, err = _main(f"--workdir={workdir}", "--device_memory_gib=5")
  assert (code, err) == (
    2, ["error: --device_memory_gib plans a --dry_run; add --dry_run or drop it"]
  )  # fmt: skip
  assert not workdir.exists()


def test_a_step_count_past_the_int32_step_counter_is_one_line(tmp_path):
  """train.num_steps beyond 2**31 (even beyond int64) started training."""
  workdir = tmp_path / "run"
  code, err = _main(f"--workdir={workdir}", "--config.train.num_steps=99999999999999999999")
  message = "train.num_steps=99999999999999999999 must be < 2**31 (an int32 step)"
  assert (code, err) == (2, [f"error: invalid config: {message}"])
  assert not workdir.exists()


@pytest.mark.parametrize(
  "name, body, says",
  [
    ("dict.py", 'def get_config():\n  return {"seed": 1}\n', "get_config() returned a dict; "),
    ("five.py", "def get_config():\n  return 5\n", "get_config() returned a int; "),
    ("config.txt", "def get_config():\n  return 5\n", "a config is a Python file"),
  ],
)
def test_a_config_file_that_is_not_a_config_is_one_line(tmp_path, name, body, says):
  """get_config() returning a dict or an int was an AttributeError traceback from the parse; a
  file not ending in .py said "'NoneType' object has no attribute 'loader'"."""
  path = tmp_path / name
  path.write_text(body)
  cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={path}", f"--workdir={tmp_path / 'w'}"]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  err = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), err
  assert says in err[0] and str(path) in err[0], err
  assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_relative_workdir_trains_and_saves(tmp_path):
  """A relative --workdir trained, then failed at its first save with a 100-line traceback
  (orbax saves to absolute paths only); a relaunch redid the warm start and failed again."""
  cmd = [
    sys.executable,
    "-m",
    "jaxrl_llm.main",
    f"--config={os.path.join(REPO, 'configs', 'default.py')}",
  ]
  cmd += ["--workdir=rel run", "--config.sft.steps=0", "--config.train.num_steps=1"]
  cmd += ["--config.model.d_model=32", "--config.model.mlp_dim=64", "--config.task.eval_size=16"]
  proc = subprocess.run(
    cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (tmp_path / "rel run" / "checkpoints" / "1" / "commit_success.txt").exists()


def test_the_moe_kernel_where_it_cannot_run_is_one_line_before_the_workdir_is_made(tmp_path):
  """model.moe_impl=kernel off a Hopper GPU (this CPU): the config check's one line naming why
  and what runs here, exit 2, no workdir (it was a 56-line traceback from the model's init)."""
  import jax

  if jax.devices()[0].platform == "gpu":
    pytest.skip("a GPU may run the kernel")
  workdir = tmp_path / "run"
  config = f"--config={REPO / 'configs' / 'moe_default.py'}"
  line = (
    "error: invalid config: model.moe_impl='kernel' cannot run here: it runs on NVIDIA Hopper "
    "GPUs only (this program is compiled for cpu). Allowed on this backend: auto, portable, "
    "ragged, dense"
  )
  for where in (f"--workdir={workdir}", "--dry_run"):
    args = [config, where, "--config.train.num_steps=2", "--config.model.moe_impl=kernel"]
    cmd = [sys.executable, "-m", "jaxrl_llm.main", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [line]), proc.stderr
  assert not workdir.exists()


def test_a_mesh_rule_its_mesh_axis_does_not_divide_is_one_line_before_the_workdir_is_made(
  tmp_path,
):
  """mesh.rules splitting the 2 kv heads over mesh.model=4 (4 CPU devices): the config check's
  one line naming the rule, the field, the parameter and the sizes, exit 2, no workdir (it was
  JAX's IndivisibleError traceback from the sharded initialisation)."""
  workdir = tmp_path / "run"
  env = cli_env()
  env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count=4".strip()
  rule = "--config.mesh.rules=(('kv_heads','model'),)"
  line = (
    "error: invalid config: mesh.rules maps kv_heads to mesh.model=4, which does not divide "
    "model.num_kv_heads=2 (param layer_0/attn/k/kernel dim 1); map it to mesh axes whose sizes "
    "divide it, or to None"
  )
  for where in (f"--workdir={workdir}", "--dry_run"):
    cmd = [sys.executable, "-m", "jaxrl_llm.main", CONFIG, where, "--config.mesh.model=4", rule]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [line]), proc.stderr
  assert not workdir.exists()
