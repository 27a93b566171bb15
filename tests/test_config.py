"""Bad input gets a clear message naming the field, the value and what is allowed."""

import subprocess
import sys

import pytest
from conftest import REPO, cli_env, tiny_config
from parsed import build, train_and_evaluate

from jaxrl_llm import checkpoint
from jaxrl_llm.config import ConfigError


@pytest.mark.parametrize(
  "field,value,needle",
  [
    ("sampling.temperature", -0.5, "sampling.temperature=-0.5 must be >= 0.01"),
    ("objective.clip_high", 1.0, "objective.clip_high=1.0 must be in (0, 1)"),
    ("objective.clip_low", 0.0, "objective.clip_low=0.0 must be in (0, 1)"),
    ("sampling.group_size", 1, "sampling.group_size=1 must be >= 2"),
    ("sampling.top_p", 1.5, "sampling.top_p=1.5 must be in (0, 1]"),
    ("rl.num_minibatches", 3, "do not split into rl.num_minibatches=3"),
    ("objective.name", "nope", "unknown objective 'nope'"),
    ("aggregation.name", "mean", "unknown aggregation 'mean'"),
    ("model.num_kv_heads", 3, "model.num_heads=2 must be a multiple of model.num_kv_heads=3"),
    ("model.vocab_size", 8, "model.vocab_size=8 is smaller than task"),
    ("task.name", "chess", "task.name='chess'; allowed: addition, countdown, reverse, sort"),
    ("sampling.param_dtype", "fp8", "sampling.param_dtype='fp8'; allowed: auto, float32"),
  ],
)
def test_out_of_range_values_are_named(field, value, needle):
  config = tiny_config(**{field: value})
  with pytest.raises(ValueError) as err:
    build(config)
  assert needle in str(err.value)


def test_prompt_files_take_correct_and_host_verifiers_as_reward_terms():
  """With `data.train_files` a reward term is `correct` (the verifier `data.correct_term`
  names: the default config's weights work as they are) or a host verifier; another (the
  built-in tasks' `format`) is named with the allowed ones before any file is read."""
  from jaxrl_llm.config import parse

  config = tiny_config(**{"data.train_files": "/nonexistent/math.jsonl"})
  assert dict(parse(config).task.reward_weights) == {"correct": 1.0, "format": 0.0}
  config.task.reward_weights.format = 0.5
  with pytest.raises(ConfigError) as err:
    parse(config)
  assert "task.reward_weights names 'format', which is not a host verifier" in str(err.value)
  assert (
    "correct (= data.correct_term), answer_line_correct, answer_line_format, gsm8k_correct"
    in str(err.value)
  )
  config.task.reward_weights = {"correct": 1.0, "math_format_boxed": 0.5}
  assert parse(config).uses_files


_WITHOUT_MATH_VERIFY = """
import sys
sys.modules["math_verify"] = None  # this interpreter cannot import the optional package
sys.path.insert(0, "tests")
from conftest import tiny_config
from jaxrl_llm.config import ConfigError, parse
for correct_term, weights in [
  ("math_verify_correct", {"correct": 0.0, "math_correct": 1.0}),
  ("math_correct", {"correct": 1.0, "math_verify_correct": 0.5}),
  ("math_correct", {"correct": 1.0, "math_verify_correct": 0.0}),
]:
  config = tiny_config(**{"data.train_files": "/nonexistent/math.jsonl"})
  config.data.correct_term, config.task.reward_weights = correct_term, weights
  try:
    print("ok", parse(config).data.correct_term)
  except ConfigError as err:
    print(err)
"""


def test_a_verifier_whose_optional_package_is_missing_is_refused_with_the_config():
  """`math_verify_correct` needs the optional math-verify package: where it cannot be imported,
  naming it as data.correct_term (which defines accuracy even at weight 0) or as a weighted
  reward term is one config error saying how to install it, before any file is read (each
  call would otherwise fail and score 0). At weight 0 it is never called: accepted."""
  proc = subprocess.run(
    [sys.executable, "-c", _WITHOUT_MATH_VERIFY],
    cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.strip().splitlines()
  install = "optional package is not installed: math_verify (pip install -e '.[math]')"
  assert lines[0].startswith("invalid config: data.correct_term=math_verify_correct: ")
  assert lines[1].startswith("invalid config: task.reward_weights.math_verify_correct: ")
  assert install in lines[0] and install in lines[1] and "math_correct," in lines[1]
  assert lines[2] == "ok math_correct"


def test_auto_sampler_weights_are_bf16_on_accelerators_and_fp32_on_cpu():
  from jaxrl_llm import quant

  assert quant.resolve_sampler_dtype("auto", "gpu") == "bfloat16"
  assert quant.resolve_sampler_dtype("auto", "tpu") == "bfloat16"
  assert quant.resolve_sampler_dtype("auto", "cpu") == "float32"
  assert quant.resolve_sampler_dtype("int8", "gpu") == "int8"
  exp = build(tiny_config())  # auto on this CPU: the sampler runs on the float32 params
  assert exp.program.learner.sampler_dtype == "float32"


def test_every_problem_is_listed_at_once():
  config = tiny_config(**{"sampling.temperature": 0.0, "objective.clip_low": 2.0})
  with pytest.raises(ConfigError) as err:
    build(config)
  assert "sampling.temperature" in str(err.value) and "objective.clip_low" in str(err.value)


def test_batch_not_divisible_by_mesh():
  config = tiny_config(**{"mesh.data": -1, "rl.num_prompts": 6})  # 8 fake devices
  with pytest.raises(ConfigError, match=r"rl\.num_prompts=6 is not divisible by the 8"):
    build(config)


def test_prompts_that_do_not_split_over_the_devices_are_one_line():
  """P = 3 on 8 data-parallel devices: one line naming rl.num_prompts (the minibatch that does
  not split either, and P again, were two more lines of the same problem)."""
  config = tiny_config(
    **{"mesh.data": -1, "rl.num_prompts": 3, "sampling.group_size": 2, "rl.num_minibatches": 1}
  )
  with pytest.raises(ConfigError) as err:
    build(config, abstract=True)
  line = str(err.value)
  assert "\n" not in line and line.startswith("invalid config: rl.num_prompts=3 is not"), line
  # A minibatch alone that does not split is still named: P = 8, 3 minibatches of 8 x 3 / 3.
  config = tiny_config(
    **{"mesh.data": -1, "rl.num_prompts": 8, "sampling.group_size": 3, "rl.num_minibatches": 6}
  )
  with pytest.raises(ConfigError, match=r"minibatch of 4 sequences .* not divisible by the 8"):
    build(config, abstract=True)


@pytest.mark.extended
def test_incompatible_checkpoint_in_workdir(tmp_path):
  train_and_evaluate(tiny_config(**{"train.num_steps": 2}), str(tmp_path))
  bigger = tiny_config(**{"train.num_steps": 4, "model.num_layers": 3})
  with pytest.raises(checkpoint.CheckpointMismatchError) as err:
    train_and_evaluate(bigger, str(tmp_path))
  msg = str(err.value)
  assert "num_layers" in msg and str(tmp_path) in msg
  assert (tmp_path / "checkpoints" / "2").is_dir()  # nothing saved was lost


def _cli(*args):
  env = cli_env()
  return subprocess.run(
    [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_cli_unknown_field_is_named(tmp_path):
  proc = _cli(f"--workdir={tmp_path}", "--config.objective.clip_hihg=0.3")
  assert proc.returncode == 2
  assert "unknown config field 'objective.clip_hihg'" in proc.stderr
  assert "clip_high" in proc.stderr  # lists what is allowed
  assert "Traceback" not in proc.stderr


def test_cli_bad_value_is_named(tmp_path):
  proc = _cli(f"--workdir={tmp_path}", "--config.sampling.temperature=-1")
  assert proc.returncode == 2
  assert "sampling.temperature=-1.0 must be >= 0.01" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_example_config_names_the_paths_it_needs(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxrl_llm.main",
      "--config=configs/qwen2_5_gsm8k_dapo.py",
      f"--workdir={tmp_path}",
    ],
    cwd=REPO,
    env=cli_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2
  assert "--config.model.checkpoint=..." in proc.stderr
  assert "--config.data.train_files=..." in proc.stderr


def test_a_built_in_task_takes_only_the_terms_its_verifier_scores():
  """Without prompt files a weighted reward term must be one the built-in verifiers return
  (`correct`, `format`, `partial`): a typo in the whole-dict form is named with the allowed
  terms when parsed, before the warm start runs (it used to fail at the RL step's trace with a
  KeyError); the allowed terms are exactly those the verifier returns."""
  import numpy as np

  from jaxrl_llm.config import parse
  from jaxrl_llm.data.tasks import get_task
  from jaxrl_llm.data.tasks.base import REWARD_TERMS

  config = tiny_config()
  config.task.reward_weights = {"correct": 1.0, "fromat": 0.5}
  with pytest.raises(ConfigError) as err:
    parse(config)
  assert str(err.value) == (
    "invalid config: task.reward_weights names 'fromat', which the built-in task 'reverse' "
    "does not score; allowed: correct, format, partial"
  )
  config.task.reward_weights = {"correct": 1.0, "fromat": 0.0}  # weight 0: never read
  parse(config)
  task = get_task("reverse")
  batch = task.eval_examples()
  answer = np.asarray(batch["answer"])[:4]
  mask = np.asarray(batch["answer_mask"])[:4]
  terms = task.reward_terms(np.asarray(batch["tokens"])[:4], answer, mask, answer, mask)
  assert tuple(terms) == REWARD_TERMS
