"""Settings that name a real thing the wrong way, each refused in one line that says what the
value was read as and what to give instead: a prompt file whose name holds a comma (the file
settings are comma-separated lists), a trainer workdir given as model.checkpoint."""

import shutil

import pytest
from conftest import tiny_config
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
