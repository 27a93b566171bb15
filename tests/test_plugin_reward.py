"""A reward term of your own (`verifiers.register_reward`): a module the config file imports
registers it, and `task.reward_weights` names it on the command line and in `tools/sweep.py`
sweeps as a built-in term; a name or function the workers cannot use is one line at import."""

import functools
import importlib
import subprocess
import sys

import ml_collections
import pytest
from conftest import REPO, TINY_CLI, cli_env, tiny_config
from text_fixtures import math_file_run

from jaxrl_llm import metrics
from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.data import verifiers

CONFIG = REPO / "tests" / "fixtures" / "plugin_reward_config.py"
TERM = "ends_with_period"


@pytest.fixture
def plugin():
  """Imports tests/plugin_reward.py (`plugin()`: its module), which registers its term; the
  term and the module are removed after the test."""
  assert TERM not in verifiers.REWARD_FNS
  sys.path.insert(0, str(CONFIG.parent))
  yield lambda: importlib.import_module("plugin_reward")
  verifiers.REWARD_FNS.pop(TERM, None)
  sys.modules.pop("plugin_reward", None)
  sys.path.remove(str(CONFIG.parent))


def _file_flags(tmp_path) -> list[str]:
  """The tiny prompt-file run of `math_file_run` (2 steps, evaluated at the end) as flags."""
  overrides, _ = math_file_run(tmp_path)
  tiny = dict(f.removeprefix("--config.").split("=", 1) for f in TINY_CLI)
  overrides = (
    tiny
    | overrides
    | {"sft.steps": 0, "train.num_steps": 2, "train.eval_every": 2, "train.log_every": 1}
  )
  return [f"--config.{k}={v}" for k, v in overrides.items()]


def _nested():
  def term(completion: str, reference: str) -> float:
    return 1.0

  return term


def test_a_registered_term_is_a_host_verifier_reward_weights_may_name(tmp_path, plugin):
  """Unknown before its module is imported, then accepted by name like a built-in term."""
  overrides, _ = math_file_run(tmp_path)
  config = tiny_config(**overrides)
  config.task.reward_weights = ml_collections.ConfigDict({"correct": 1.0, TERM: 0.5})
  with pytest.raises(ConfigError, match=f"'{TERM}', which is not a host verifier"):
    parse(config)
  module = plugin()
  assert verifiers.get_reward_fn(TERM) is module.ends_with_period
  assert dict(parse(config).task.reward_weights) == {"correct": 1.0, TERM: 0.5}
  assert module.ends_with_period("So it is 4.", "4") == 1.0


@pytest.mark.parametrize(
  "name, fn, says",
  [
    ("math_correct", _nested(), "'math_correct' is a built-in term"),
    ("correct", _nested(), "'correct' is a built-in term"),
    ("my-term", _nested(), "'my-term' is not a Python identifier"),
    ("mine", lambda completion, reference: 1.0, "'mine' cannot be pickled"),
    ("mine", _nested(), "'mine' cannot be pickled"),
  ],
  ids=["built-in", "correct", "not-an-identifier", "lambda", "nested-function"],
)
def test_a_term_the_workers_cannot_use_is_refused_in_one_line(name, fn, says):
  """A built-in name, a name that is no identifier, or a function that does not pickle (the
  worker processes call it): one ValueError line naming the term, and nothing registered."""
  before = dict(verifiers.REWARD_FNS)
  with pytest.raises(ValueError, match=says) as err:
    verifiers.register_reward(name)(fn)
  assert "\n" not in str(err.value), str(err.value)
  assert verifiers.REWARD_FNS == before


def test_a_partial_of_a_module_level_function_registers(plugin):
  """functools.partial of a module-level function pickles, so it is a term too (and
  `needs` declares its optional package)."""
  fn = functools.partial(plugin().ends_with_period, reference="")
  try:
    assert verifiers.register_reward("period_partial", needs=("json", "built in"))(fn) is fn
    assert verifiers.get_reward_fn("period_partial") is fn
    assert verifiers.missing_package("period_partial") is None
  finally:
    verifiers.REWARD_FNS.pop("period_partial", None)
    verifiers.NEEDS_PACKAGE.pop("period_partial", None)


def test_a_config_file_registering_a_lambda_is_one_error_line(tmp_path):
  """From the command line, the refusal at import is the run's one `error:` line, exit 2."""
  config = tmp_path / "lambda_config.py"
  config.write_text(
    "from jaxrl_llm.config import get_config\n"
    "from jaxrl_llm.data.verifiers import register_reward\n\n"
    "register_reward('mine')(lambda completion, reference: 1.0)\n"
  )
  cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={config}"]
  cmd += [f"--workdir={tmp_path / 'run'}"]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: cannot load config file"), lines
  assert "reward term 'mine' cannot be pickled" in lines[0]


def test_the_command_line_trains_with_a_term_its_config_file_registers(tmp_path):
  """`--config=tests/fixtures/plugin_reward_config.py`, which imports the module beside it
  (no PYTHONPATH; it was `No module named ...` from another working directory): the run
  scores the term in its workers, logs `reward/ends_with_period` every step and in the
  evaluation."""
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={CONFIG}", f"--workdir={workdir}"]
  cmd += _file_flags(tmp_path)
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  scalars = metrics.read_scalars(str(workdir))
  assert [s for s, _ in scalars[f"reward/{TERM}"]] == [1, 2]
  assert f"eval/reward/{TERM}" in scalars
  assert all(v == 0 for _, v in scalars[f"verifier/errors/{TERM}"])


@pytest.mark.slow  # two runs through tools/sweep.py: about 30 s on 2 cores
def test_a_sweep_over_the_config_file_runs_every_point_with_the_term(tmp_path):
  """`tools/sweep.py` checks the grid against the config file (which registers the term from
  the module beside it) and runs both points; each logs the term."""
  root = tmp_path / "sweep"
  flags = [f.removeprefix("--config.") for f in _file_flags(tmp_path)]
  cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), f"--config={CONFIG}", f"--root={root}"]
  cmd += ["--grid=sampling.temperature=0.7,1.0", *(f"--set={f}" for f in flags)]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  runs = sorted(p for p in root.iterdir() if (p / "run.json").exists())
  assert [p.name for p in runs] == ["sampling.temperature=0.7", "sampling.temperature=1.0"]
  for run in runs:
    assert [s for s, _ in metrics.read_scalars(str(run))[f"reward/{TERM}"]] == [1, 2], run


def test_a_term_put_in_the_registry_by_hand_that_cannot_reach_the_workers_is_refused_at_parse(
  tmp_path, monkeypatch
):
  """A lambda set into REWARD_FNS by hand (not through register_reward) passed the config
  checks and ended the run in a traceback when the first batch was scored; it is now refused
  with the other config errors, before anything is built."""
  monkeypatch.setitem(verifiers.REWARD_FNS, "by_hand", lambda completion, reference: 1.0)
  overrides, _ = math_file_run(tmp_path)
  config = tiny_config(**overrides)
  config.task.reward_weights = ml_collections.ConfigDict({"correct": 1.0, "by_hand": 0.5})
  with pytest.raises(ConfigError, match=r"reward term 'by_hand' cannot reach the verifier worker"):
    parse(config)
  monkeypatch.setitem(verifiers.REWARD_FNS, "by_hand", verifiers.math_correct)
  assert dict(parse(config).task.reward_weights) == {"correct": 1.0, "by_hand": 0.5}
