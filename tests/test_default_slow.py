"""The embedded default really learns (slow: about 1.5 minutes on two CPU cores)."""

import pytest
from conftest import load_config
from parsed import train_and_evaluate

from jaxrl_llm import metrics


@pytest.mark.slow
def test_default_config_learns(tmp_path):
  config = load_config("default")
  config.mesh.data = 1  # the tests' 8 fake devices would only slow this down
  result = train_and_evaluate(config, str(tmp_path))
  evals = metrics.read_scalars(str(tmp_path))["eval/accuracy"]
  start, end = evals[0][1], evals[-1][1]
  assert evals[0][0] == 0 and evals[-1][0] == config.train.num_steps
  assert end == result["eval/accuracy"]
  assert end >= 0.8, evals
  assert end - start >= 0.3, evals


@pytest.mark.slow
def test_moe_default_learns_with_r3(tmp_path):
  config = load_config("moe_default")
  config.mesh.data = 1
  assert config.replay.name == "r3" and config.model.moe_num_experts > 0
  train_and_evaluate(config, str(tmp_path))
  evals = metrics.read_scalars(str(tmp_path))["eval/accuracy"]
  start, end = evals[0][1], evals[-1][1]
  assert end - start >= 0.3, evals
