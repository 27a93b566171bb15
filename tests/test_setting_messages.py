"""Settings that name a real thing the wrong way, each refused in one line that says what the
value was read as and what to give instead: a prompt file whose name holds a comma (the file
settings are comma-separated lists), a trainer workdir given as model.checkpoint."""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, TINY_CLI, cli_env, tiny_config
from text_fixtures import math_file_run

from jaxrl_llm.data import file_task
from jaxrl_llm.data import records as records_lib


@pytest.mark.parametrize("setting", ["data.train_files", "data.eval_files"])
def test_a_prompt_file_whose_name_holds_a_comma_says_the_list_is_comma_separated(tmp_path, setting):
  overrides, _ = math_file_run(tmp_path)
  comma = shutil.copy(tmp_path / "math.jsonl", tmp_path / "a,b.jsonl")
  cfg = tiny_config(**overrides | {setting: str(comma)})
  with pytest.raises(records_lib.DataError) as e:
    file_task.build_file_task(cfg, "")
  message = str(e.value)
  assert message.startswith(f"{setting}={str(comma)!r}: ") and "\n" not in message, message
  assert "comma-separated" in message and repr(str(tmp_path / "a?b.jsonl")) in message, message
  cfg = tiny_config(**overrides | {setting: str(tmp_path / "a?b.jsonl")})
  assert file_task.build_file_task(cfg, "").eval_set()  # the glob it names reads the file


@pytest.mark.parametrize("tokenizer", [False, True])
def test_a_trainer_workdir_as_model_checkpoint_says_how_to_export_it(tmp_path, tokenizer):
  """model.checkpoint naming a run's workdir (a natural slip when going on from a run) was
  read as a Hugging Face checkpoint: its tokenizer.json was missing, or with data.tokenizer set
  the run record was an unsupported model_type=None. One line says what it is and the export."""
  overrides, _ = math_file_run(tmp_path)
  run = tmp_path / "run"
  (run / "checkpoints" / "3").mkdir(parents=True)
  (run / "config.json").write_text(json.dumps({"config": {"model": {}}}))
  args = [
    f"--config.model.checkpoint={run}",
    f"--config.data.train_files={tmp_path / 'math.jsonl'}",
    "--config.sft.steps=0",
  ]
  if tokenizer:
    args.append(f"--config.data.tokenizer={overrides['data.tokenizer']}")
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  cmd += [f"--workdir={tmp_path / 'w'}", *TINY_CLI, *args]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: model.checkpoint={str(run)!r} is a trainer workdir"), last
  assert f"tools/hf_convert.py export --workdir={run}" in last, last
  assert "Traceback" not in proc.stderr and not (tmp_path / "w").exists()
