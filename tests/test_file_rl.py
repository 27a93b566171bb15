"""Real data end to end: a BPE tokenizer and chat template, a JSONL math dataset through grain,
the host-reward RL path (jitted sampler → host verifiers → jitted learner)."""

import jax
import ml_collections
import numpy as np
import pytest
from conftest import tiny_config
from parsed import build, train_and_evaluate
from text_fixtures import math_file_run

from jaxrl_llm import checkpoint, launch, metrics
from jaxrl_llm.data import file_task, verifiers
from jaxrl_llm.data.task import Task
from jaxrl_llm.run import VerifierError, host_reward_step, to_global_batch
from jaxrl_llm.run.guard import VerifierGuard


def _parity(completion: str, reference: str) -> float:
  """A Python verifier whose value varies with the text (so rewards are not all equal)."""
  return float(len(completion) % 2)


def _always_fails(completion: str, reference: str) -> float:
  """A verifier broken for every input (e.g. a package it imports is missing)."""
  raise ImportError("no module named 'the_checker'")


def _flaky(completion: str, reference: str) -> float:
  if "1" in completion:
    raise RuntimeError("verifier crashed")
  return 1.0


@pytest.fixture
def file_config(tmp_path):
  overrides, records = math_file_run(tmp_path)
  c = tiny_config(**overrides)
  c.task.reward_weights = ml_collections.ConfigDict({"math_correct": 1.0, "math_format_boxed": 0.5})
  return c, records


def test_file_task_implements_the_task_interface(file_config, caplog):
  """Rewards on the host; train_iterator fills data_stats; eval_set takes the reference
  answers out of the batch and trims it to a multiple of the devices, its log line naming the
  part of the held-out split it read (it read as the whole prompt dataset)."""
  config, records = file_config
  task = file_task.build_file_task(config, "")
  assert isinstance(task, Task) and task.rewards_on_host
  assert task.reward_terms is None and callable(task.host_reward_terms)
  assert task.answer_len == 1 and task.data_stats == {}
  batch = next(task.train_iterator(4, config.seed))
  assert task.data_stats["data/num_kept"] > 0 and len(batch["tokens"]) == 4
  with caplog.at_level("INFO"):
    ev, answers = task.eval_set(multiple_of=3)
  assert "answer" not in ev and len(answers) == len(ev["tokens"]) and len(answers) % 3 == 0
  n = len(task.eval_records)
  said = [r.getMessage() for r in caplog.records if "prompt_len" in r.getMessage()]
  assert said and said[-1].startswith(f"Held-out prompts 0..{min(n, 256) - 1} of {n} ("), said
  assert set(answers) <= {r["answer"] for r in records}


def test_the_held_out_split_is_the_same_for_every_seed(file_config):
  """`data.eval_fraction`'s split does not move with the run's seed: runs that differ in seed
  (the seeds of a study, the runs of a pack) train and evaluate on the same prompts."""
  config, _ = file_config
  tasks = []
  for seed in (0, 1, 7):
    config.seed = seed
    tasks.append(file_task.build_file_task(config, ""))
  prompts = lambda rs: sorted(r["prompt"] for r in rs)  # noqa: E731
  for task in tasks[1:]:
    assert prompts(task.train_records) == prompts(tasks[0].train_records)
    assert prompts(task.eval_records) == prompts(tasks[0].eval_records)
  assert 0 < len(tasks[0].eval_records) < len(tasks[0].train_records)


@pytest.mark.extended
def test_host_reward_rewards_are_the_verifiers(file_config):
  config, records = file_config
  exp = build(config)
  assert exp.task.rewards_on_host and exp.task.tokenizer.vocab_size <= 512
  exp.task.reward_fns["math_format_boxed"] = _parity
  it = exp.task.train_iterator(config.rl.num_prompts, config.seed)
  np_batch = next(it)
  answers = {r["prompt"]: r["answer"] for r in records}
  assert all(a in answers.values() for a in np_batch["answer"])

  g = config.sampling.group_size
  # The same sampling the step will do (sample does not donate the state).
  rollout = exp.program.sample(
    exp.state, to_global_batch(np_batch, exp.batch_sharding), jax.random.PRNGKey(0)
  )
  texts = exp.task.decode(np.asarray(rollout.tokens))
  state, m = host_reward_step(exp, exp.state, np_batch, jax.random.PRNGKey(0))
  m = jax.device_get(m)
  # Every reward equals the verifiers applied to the decoded sampled text.
  refs = np.repeat(np_batch["answer"], g)
  want = np.array(
    [verifiers.math_correct(t, r) + 0.5 * _parity(t, r) for t, r in zip(texts, refs)], np.float32
  )
  np.testing.assert_allclose(m["hist/reward"], want, rtol=1e-6)
  assert len(set(want.tolist())) > 1  # the check had something to check
  assert m["rollout/accuracy"] == pytest.approx(
    np.mean([verifiers.math_correct(t, r) for t, r in zip(texts, refs)])
  )
  assert int(state.step) == 1


@pytest.mark.extended
def test_the_default_reward_weights_reward_the_correct_term_on_prompt_files(
  file_config, monkeypatch
):
  """The default config's `correct` weight means `data.correct_term`'s verifier on prompt
  files: the reward is that verifier's score of each decoded completion."""
  config, _ = file_config
  monkeypatch.setitem(verifiers.REWARD_FNS, "parity", _parity)
  config.task.reward_weights = ml_collections.ConfigDict({"correct": 1.0, "format": 0.0})
  config.data.correct_term = "parity"  # varies with the text: a random policy is never right
  exp = build(config)
  np_batch = next(exp.task.train_iterator(config.rl.num_prompts, config.seed))
  rollout = exp.program.sample(
    exp.state, to_global_batch(np_batch, exp.batch_sharding), jax.random.PRNGKey(2)
  )
  want = [_parity(t, "") for t in exp.task.decode(np.asarray(rollout.tokens))]
  _, m = host_reward_step(exp, exp.state, np_batch, jax.random.PRNGKey(2))
  np.testing.assert_allclose(jax.device_get(m)["hist/reward"], want)
  assert 0 < np.mean(want) < 1  # the check had something to check


@pytest.mark.extended  # CI's time (2026-12-06)
def test_a_verifier_at_weight_zero_is_logged_and_adds_nothing_to_the_reward(
  file_config, monkeypatch
):
  """A verifier named at weight 0 is scored on every completion and logged as `reward/NAME`
  (a diagnostic, e.g. the format rate of a run without the format reward), while the reward is
  the weighted terms' alone."""
  config, _ = file_config
  monkeypatch.setitem(verifiers.REWARD_FNS, "parity", _parity)
  config.task.reward_weights = ml_collections.ConfigDict({"math_correct": 1.0, "parity": 0.0})
  exp = build(config)
  assert "parity" in exp.task.host_term_names
  np_batch = next(exp.task.train_iterator(config.rl.num_prompts, config.seed))
  rollout = exp.program.sample(
    exp.state, to_global_batch(np_batch, exp.batch_sharding), jax.random.PRNGKey(2)
  )
  texts = exp.task.decode(np.asarray(rollout.tokens))
  _, m = host_reward_step(exp, exp.state, np_batch, jax.random.PRNGKey(2))
  m = jax.device_get(m)
  parity = [_parity(t, "") for t in texts]
  assert 0 < np.mean(parity) < 1  # the diagnostic had something to show
  np.testing.assert_allclose(m["reward/parity"], np.mean(parity), rtol=1e-6)
  answers = np.repeat(np_batch["answer"], len(texts) // len(np_batch["answer"]))
  correct = [verifiers.math_correct(t, r) for t, r in zip(texts, answers, strict=True)]
  np.testing.assert_allclose(m["hist/reward"], correct)


@pytest.mark.slow
def test_verifier_failures_are_counted_not_fatal(file_config):
  config, _ = file_config
  exp = build(config)
  exp.task.reward_fns["math_format_boxed"] = _flaky
  np_batch = next(exp.task.train_iterator(config.rl.num_prompts, config.seed))
  batch = to_global_batch(np_batch, exp.batch_sharding)
  texts = exp.task.decode(
    np.asarray(exp.program.sample(exp.state, batch, jax.random.PRNGKey(1)).tokens)
  )
  _, m = host_reward_step(exp, exp.state, np_batch, jax.random.PRNGKey(1))
  m = jax.device_get(m)
  assert np.isfinite(m["policy/loss"])
  assert m["verifier/errors"] == sum("1" in t for t in texts) > 0


def test_file_dataset_trains_three_steps(file_config, tmp_path):
  config, _ = file_config
  result = train_and_evaluate(config, str(tmp_path / "run"))
  scalars = metrics.read_scalars(str(tmp_path / "run"))
  for tag in (
    "reward/math_correct",
    "reward/math_format_boxed",
    "rollout/accuracy",
    "verifier/errors",
    "verifier/timeouts",
    "eval/accuracy",
    "policy/loss",
  ):
    assert tag in scalars, tag
  assert [s for s, _ in scalars["policy/loss"]] == [1, 2, 3]
  assert scalars["data/num_too_long"][0][1] == 0
  assert scalars["data/num_kept"][0][1] == scalars["data/num_records"][0][1] > 0
  assert 0.0 <= result["eval/accuracy"] <= 1.0
  text = metrics.read_text(str(tmp_path / "run"))["samples"][-1][1]
  assert "<|im_start|>" in text  # the chat template reached the prompts


def _broken_verifier_run(file_config, monkeypatch, limit: int):
  """The file run, 6 steps, a checkpoint every 2, with a weighted term that fails every call."""
  config, _ = file_config
  monkeypatch.setitem(verifiers.REWARD_FNS, "always_fails", _always_fails)
  config.task.reward_weights = ml_collections.ConfigDict({"math_correct": 1.0, "always_fails": 1})
  config.train.num_steps, config.train.checkpoint_every = 6, 2
  config.train.log_every, config.train.max_failed_verifier_steps = 1, limit
  return config


@pytest.mark.extended
def test_a_verifier_failing_every_call_stops_the_run_keeping_its_checkpoints(
  file_config, tmp_path, monkeypatch
):
  """A host reward term that fails on every completion for train.max_failed_verifier_steps
  steps in a row stops the run with one line naming the term, the step and the setting; the
  step is logged (its failure counts are in TensorBoard) but not saved: the checkpoints before
  it are kept."""
  config = _broken_verifier_run(file_config, monkeypatch, limit=3)
  workdir = str(tmp_path / "run")
  with pytest.raises(VerifierError) as err:
    train_and_evaluate(config, workdir)
  line = str(err.value)
  assert launch.explain(err.value) == f"error: {line}"  # the command line: this line, exit 2
  assert "\n" not in line and line.startswith(
    "rl step 3: reward term 'always_fails' failed on all 16"
  )
  assert "train.max_failed_verifier_steps=3" in line and "16 errors, 0 timeouts" in line
  with checkpoint.Checkpointer(workdir, save_every=2) as ckpt:
    assert ckpt.all_steps() == [2]
  scalars = metrics.read_scalars(workdir)
  assert [v for _, v in scalars["verifier/errors/always_fails"]] == [16, 16, 16]
  assert [v for _, v in scalars["verifier/errors/math_correct"]] == [0, 0, 0]


@pytest.mark.extended  # CI's time (2026-12-06)
def test_a_verifier_failing_every_call_trains_on_when_the_limit_is_off(
  file_config, tmp_path, monkeypatch
):
  """train.max_failed_verifier_steps=0: the run trains to its end, the failures counted."""
  config = _broken_verifier_run(file_config, monkeypatch, limit=0)
  train_and_evaluate(config, str(tmp_path / "run"))
  scalars = metrics.read_scalars(str(tmp_path / "run"))
  assert [v for _, v in scalars["verifier/errors/always_fails"]] == [16] * 6


def test_the_verifier_guard_counts_steps_in_a_row_per_term():
  """Only a step where a term failed on every call (errors and timeouts together) extends its
  streak; a step with one success resets it; terms are counted apart; in-graph steps (no
  verifier counts) count nothing."""
  guard = VerifierGuard(limit=2, calls=4, timeout_s=5.0)

  def step(n, **failed):
    m = {"policy/loss": 0.0}
    for name, (errors, timeouts) in failed.items():
      m |= {f"verifier/errors/{name}": errors, f"verifier/timeouts/{name}": timeouts}
    guard.update(n, m)

  step(1, a=(4, 0), b=(3, 0))
  step(2, a=(3, 0), b=(0, 4))  # a: one call succeeded; b: every call timed out
  step(3)  # the in-graph path: no counts
  step(4, a=(2, 2), b=(1, 0))
  with pytest.raises(VerifierError, match=r"rl step 5: reward term 'a' failed on all 4 .* 2 steps"):
    step(5, a=(0, 4), b=(0, 0))
  assert (
    VerifierGuard(0, 4, 5.0).update(1, {"verifier/errors/a": 4, "verifier/timeouts/a": 0}) is None
  )


def test_a_chat_template_that_cannot_render_a_prompt_is_one_error_before_the_run(tmp_path):
  """A tokenizer with no chat template, one with a syntax error, and one that refuses the system
  turn the config asks for: building the task is one `DataError` line naming data.template and
  what to change, before any batch (it was a traceback at the first one). The refusing template
  without a system prompt builds."""
  from text_fixtures import build_bpe_tokenizer

  from jaxrl_llm.data import records

  overrides, _ = math_file_run(tmp_path)
  refuses = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
  )
  cases = {
    "none": (None, "has no chat template"),
    "syntax": ("{% for m in messages %}{{ m['content'] }}", "TemplateSyntaxError"),
    "system": (refuses, "System role not supported"),
  }
  for name, (template, why) in cases.items():
    tok = build_bpe_tokenizer(tmp_path / name, chat_template=template)
    cfg = tiny_config(**overrides | {"data.tokenizer": str(tok), "data.system_prompt": "Be brief."})
    with pytest.raises(records.DataError) as e:
      file_task.build_file_task(cfg, "")
    line = str(e.value)
    assert line.startswith("data.template='qwen_math_chat' cannot render the first prompt: ")
    assert why in line and "\n" not in line and "leave data.system_prompt empty" in line, line
  cfg = tiny_config(**overrides | {"data.tokenizer": str(tmp_path / "system")})
  assert file_task.build_file_task(cfg, "").template == "qwen_math_chat"


def test_the_logged_prompt_keeps_the_end_of_turn_tokens_its_pad_id_shares(tmp_path):
  """A tokenizer that pads with its end-of-turn token (SmolLM2 pads with <|im_end|>): the
  samples' prompt text dropped every <|im_end|> the model saw, not only the left padding."""
  from text_fixtures import build_bpe_tokenizer, write_math_jsonl

  write_math_jsonl(tmp_path / "math.jsonl", n=40)
  tok = build_bpe_tokenizer(tmp_path / "tok", eos_token="<|im_end|>", pad_token="<|im_end|>")
  config = tiny_config(
    **{
      "data.train_files": str(tmp_path / "math.jsonl"),
      "data.tokenizer": str(tok),
      "data.template": "chat",
      "data.system_prompt": "Be brief.",
      "data.prompt_len": 256,
      "task.eval_size": 4,
    }
  )
  task = file_task.build_file_task(config, "")
  assert task.tokenizer.pad_id == task.tokenizer.eos_id
  batch, _ = task.eval_set()
  shown, _ = task.describe(batch["tokens"][0], np.array([task.tokenizer.eos_id]))
  assert shown.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"), shown
  assert shown.count("<|im_end|>") == 2 and shown.endswith("<|im_start|>assistant\n"), shown


def test_a_batch_larger_than_the_prompt_file_names_the_setting_to_change(file_config, tmp_path):
  """rl.num_prompts above the training prompts that fit is one line naming rl.num_prompts, the
  prompts that fit and what is allowed (it named an internal `batch_size`)."""
  config, _ = file_config
  task = file_task.build_file_task(config, "")
  kept = len(task.train_records)
  config.rl.num_prompts = 1 << kept.bit_length()  # the next power of two above the prompts
  with pytest.raises(ValueError) as err:
    train_and_evaluate(config, str(tmp_path / "run"))
  line = launch.explain(err.value)
  assert "\n" not in line and line.startswith(
    f"error: rl.num_prompts={config.rl.num_prompts} is more than the {kept} training prompts"
  )
  assert f"allowed: at most {kept}, or more records, or a larger data.prompt_len" in line
