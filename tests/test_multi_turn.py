"""Multi-turn rollouts with in-graph tools (jaxrl_llm/envs.py, `sampling.tool`): the tool's
answers join the context inside the one decode loop, and only the policy's tokens are learned."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, tiny_config
from parsed import build

from jaxrl_llm import envs, host_tool, objectives
from jaxrl_llm.config import ConfigError, parse
from jaxrl_llm.data.tasks import CharTokenizer
from jaxrl_llm.rl import loss as rl_loss
from jaxrl_llm.sampling import Scores, sample, score
from jaxrl_llm.turns import final_segment
from jaxrl_llm.types import PolicyBatch

TOK = CharTokenizer()


def _respond(env, prompt: str, calls: list[str]):
  comp, _ = TOK.encode_batch(calls, 16, bos=False, eos=False, left_pad=False)
  prompts, _ = TOK.encode_batch([prompt] * len(calls), 9, bos=True, eos=False, left_pad=True)
  end = np.array([c.index("=") for c in calls], np.int32)
  answer, length, error = env.respond(
    jnp.asarray(prompts), jnp.asarray(comp), jnp.zeros_like(end), jnp.asarray(end)
  )
  return [TOK.decode(a[:n]) for a, n in zip(np.asarray(answer), np.asarray(length))], list(
    np.asarray(error)
  )


def test_the_calculator_evaluates_left_to_right_and_answers_errors_with_the_error_token():
  calc = envs.Calculator(tokenizer=TOK)
  answers, errors = _respond(
    calc, "", ["5*3+8=", "12+30=", "2-9=", "0=", "=", "5*+3=", "7+=", "999*999*999="]
  )
  assert answers == ["23,", "42,", "-7,", "0,", ":,", ":,", ":,", ":,"]
  assert errors == [False] * 4 + [True] * 4
  assert calc.answer_len == 8  # a sign, six digits and the end


@pytest.mark.extended
def test_the_countdown_tool_checks_the_prompts_digits():
  check = envs.CountdownCheck(tokenizer=TOK, numbers=4)
  answers, errors = _respond(check, "5381>23", ["5*3+8=", "8-5-3=", "5*5=", "12+3=", "1*0="])
  assert answers == ["23,", "0,", ":,", ":,", ":,"]  # twice a 5; 12 is no digit; 0 not given
  assert errors == [False, False, True, True, True]


def _multi_turn(**overrides):
  """A tiny countdown policy with the countdown tool, and one of its multi-turn rollouts."""
  settings = {"task.name": "countdown", "sampling.tool": "countdown", "sampling.max_turns": 3}
  cfg = parse(tiny_config(**{**settings, **overrides}))
  exp = build(cfg)
  samp = cfg.sampling.sampler(exp.task)
  ex = exp.task.eval_examples()
  n = 16
  rollout = jax.jit(lambda p, t, m, k: sample(exp.model, p, t, m, k, samp))(
    exp.state.params, jnp.asarray(ex["tokens"][:n]), jnp.asarray(ex["mask"][:n]), jax.random.key(3)
  )
  return exp, samp, jax.device_get(rollout)


@pytest.fixture(scope="module")
def multi_turn():
  return _multi_turn()


def test_the_tools_answers_follow_each_call_and_are_never_the_policys(multi_turn):
  """Every call the policy closes (with calls left) is followed by the tool's own answer to it;
  those tokens are marked the environment's, out of the loss mask, with no recorded log-prob;
  the verifier reads the policy's tokens after the last answer."""
  _, samp, r = multi_turn
  assert samp.max_new_tokens == 3 * (8 + 8) and r.tool_calls.sum() > 0, r.tool_calls
  close = TOK.char_id("=")
  for i in range(r.tokens.shape[0]):
    env, tokens = r.env_mask[i] > 0, r.tokens[i]
    assert np.all(r.loss_mask[i][env] == 0) and np.all(r.logprobs[i][env] == 0)
    policy = (np.arange(len(tokens)) < r.lengths[i]) & ~env
    np.testing.assert_array_equal(r.loss_mask[i] > 0, policy)
    start, calls = 0, 0
    for t in range(r.lengths[i]):
      if env[t] or tokens[t] != close or calls == samp.max_turns - 1:
        if not env[t] and t > 0 and env[t - 1]:
          start = t  # the policy's next segment
        continue
      answer, n, _ = samp.tool.respond(
        jnp.asarray(r.prompt_tokens[i : i + 1]), jnp.asarray(tokens[None]),
        jnp.asarray([start]), jnp.asarray([t]),
      )  # fmt: skip
      got = tokens[t + 1 : t + 1 + int(n[0])]
      np.testing.assert_array_equal(got, np.asarray(answer[0, : len(got)]))
      assert env[t + 1 : t + 1 + len(got)].all()
      calls += 1
    assert calls == r.tool_calls[i]
  tokens, mask = final_segment(r)
  i = int(np.argmax(r.tool_calls))
  last = int(np.max(np.nonzero(r.env_mask[i])[0]))
  np.testing.assert_array_equal(
    tokens[i, : r.lengths[i] - last - 1], r.tokens[i, last + 1 : r.lengths[i]]
  )
  assert mask[i].sum() == r.lengths[i] - last - 1


def test_the_kv_cache_across_turns_equals_a_prefill_of_the_whole_context(multi_turn):
  """The sampler's recorded log-probs (its cache carried across turns, each tool answer
  decoded into it) equal the learner's teacher-forced pass over prompt + every token."""
  exp, samp, r = multi_turn
  sc = score(
    exp.model, exp.state.params, r.prompt_tokens, r.prompt_mask, r.tokens, samp.temperature
  )
  mask = r.loss_mask > 0
  np.testing.assert_allclose(np.asarray(sc.logp)[mask], r.logprobs[mask], atol=2e-5)


def _policy_batch(r, rng):
  b, t = r.tokens.shape
  old = jnp.asarray(r.logprobs) + 0.1 * jax.random.normal(rng, (b, t))
  return PolicyBatch(
    prompt_tokens=jnp.asarray(r.prompt_tokens),
    prompt_mask=jnp.asarray(r.prompt_mask),
    tokens=jnp.asarray(r.tokens),
    loss_mask=jnp.asarray(r.loss_mask),
    old_logp=old,
    adv=jax.random.normal(jax.random.fold_in(rng, 1), (b,)),
    weight=None,
    behaviour_logp=jnp.asarray(r.logprobs),
    ref_logp=old - 0.05,
  )


@pytest.mark.parametrize(
  "objective", [n for n in objectives.OBJECTIVES if not objectives.OBJECTIVES[n].inputs]
)
def test_the_loss_gradient_at_the_tools_tokens_is_exactly_zero(multi_turn, objective):
  """For every objective (with the KL in the loss, an entropy bonus and a behaviour
  correction), the gradient of the loss with respect to the learner's log-probs and logits at
  the tool's token positions is exactly 0: they enter no term, aggregation or weight."""
  from test_rl_loss import _settings

  _, _, r = multi_turn
  settings = _settings(
    **{"objective.name": objective, "kl.beta": 0.1, "kl.placement": "loss",
       "rl.entropy_coef": 0.01, "correction.name": "tis_token"}
  )  # fmt: skip
  mb = _policy_batch(r, jax.random.key(0))
  b, t = r.tokens.shape
  logits = jax.random.normal(jax.random.key(1), (b, t, TOK.vocab_size))
  norms = rl_loss.normalizers(mb, settings, t)

  def total(logp, logits):
    sc = Scores(logp=logp, entropy=objectives.entropy_from_logits(logits), values=None)
    return rl_loss.loss_from_scores(sc, mb, norms, settings=settings, max_len=t)[0]

  g_logp, g_logits = jax.grad(total, argnums=(0, 1))(jnp.asarray(r.logprobs) - 0.02, logits)
  env = r.env_mask > 0
  assert env.any()
  assert np.all(np.asarray(g_logp)[env] == 0) and np.all(np.asarray(g_logits)[env] == 0)
  assert np.any(np.asarray(g_logp)[r.loss_mask > 0] != 0)  # the policy's tokens do learn


def _warm_steps(config, workdir, steps: int = 2):
  """`run_steps` after the config's supervised warm start: (final state, metrics per step)."""
  from conftest import to_global_batch

  from jaxrl_llm.data import pipeline
  from jaxrl_llm.run.warm_start import warm_start

  exp = build(config)
  state = warm_start(exp, str(workdir))
  it = pipeline.make_prompt_iterator(exp.task.train_examples(0), config.rl.num_prompts, seed=0)
  metrics = []
  for i in range(steps):
    batch = to_global_batch(next(it), exp.batch_sharding)
    state, m = exp.rl_step(state, batch, jax.random.fold_in(state.rng, i))
    metrics.append(jax.device_get(m))
  return jax.device_get(state), metrics


@pytest.mark.extended
def test_a_multi_turn_run_whose_policy_never_calls_equals_the_single_turn_run(tmp_path):
  """The reverse task's warm-started policy, drawing among its 4 most likely tokens, writes
  letters, never the call's `=`: with the calculator offered, its two RL updates give every
  scalar of the single-turn run and the same parameters (within float32 tolerance)."""
  base = {"sft.steps": 200, "sampling.max_new_tokens": 8, "sampling.top_k": 4}
  single_state, single = _warm_steps(parse(tiny_config(**base)), tmp_path / "single")
  tool = {**base, "sampling.tool": "calculator", "sampling.max_turns": 3}
  multi_state, multi = _warm_steps(parse(tiny_config(**tool)), tmp_path / "multi")
  for a, b in zip(single, multi, strict=True):
    assert float(b["tool/calls_mean"]) == 0.0 and float(b["tool/env_token_frac"]) == 0.0
    assert float(a["rollout/accuracy"]) > 0  # a warm-started policy that answers
    for key, value in a.items():
      np.testing.assert_allclose(np.asarray(b[key]), np.asarray(value), rtol=1e-6, err_msg=key)
  for x, y in zip(jax.tree.leaves(single_state.params), jax.tree.leaves(multi_state.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_a_tool_is_refused_in_one_line_where_it_cannot_run():
  with pytest.raises(ConfigError, match=r"sampling\.tool='countdown' checks countdown"):
    build(tiny_config(**{"sampling.tool": "countdown"}))  # on the reverse task
  with pytest.raises(ConfigError, match=r"sampling.tool='abacus'; allowed: none, calculator"):
    parse(tiny_config(**{"sampling.tool": "abacus"}))
  with pytest.raises(ConfigError, match=r"sampling.max_turns=0 must be >= 1"):
    parse(tiny_config(**{"sampling.max_turns": 0}))
  one = {"sampling.tool": "calculator", "sampling.max_turns": 1}  # no call could be answered
  with pytest.raises(
    ConfigError, match=r"sampling\.max_turns=1 with sampling\.tool='calculator' leaves no turn"
  ):
    parse(tiny_config(**one))
  assert parse(tiny_config(**{"sampling.max_turns": 1})).sampling.max_turns == 1  # no tool: fine


def test_metrics_count_turns_calls_errors_and_the_tools_share():
  """A multi-turn RL step logs its tool use beside the reward."""
  cfg = {"task.name": "countdown", "sampling.tool": "countdown", "sampling.max_turns": 3}
  _, metrics = run_steps(parse(tiny_config(**cfg)), 1)
  m = metrics[0]
  assert float(m["tool/turns_mean"]) == pytest.approx(1 + float(m["tool/calls_mean"]))
  assert 0 < float(m["tool/env_token_frac"]) < 1 and float(m["tool/used_frac"]) > 0
  assert 0 <= float(m["tool/error_frac"]) <= 1


@pytest.mark.extended
def test_a_pack_of_multi_turn_runs_trains(tmp_path):
  """Two runs (temperatures) of a multi-turn config as one packed program."""
  from parsed import train_pack

  from jaxrl_llm import metrics as metrics_lib

  cfg = {"task.name": "countdown", "sampling.tool": "countdown", "sampling.max_turns": 3}
  cfg.update({"train.num_steps": 2, "train.eval_every": 2, "train.log_every": 1})
  configs = [tiny_config(**{**cfg, "sampling.temperature": t}) for t in (0.7, 1.0)]
  train_pack(configs, str(tmp_path))
  runs = [p for p in tmp_path.iterdir() if (p / "config.json").exists()]
  assert len(runs) == 2
  for run in runs:
    scalars = metrics_lib.read_scalars(str(run))
    assert [s for s, _ in scalars["tool/calls_mean"]] == [1, 2]
    assert [s for s, _ in scalars["eval/accuracy"]] == [0, 2]


def test_dataclass_replace_keeps_the_tool():
  cfg = parse(tiny_config(**{"sampling.tool": "calculator"}))
  from jaxrl_llm.data.tasks import get_task

  samp = cfg.sampling.sampler(get_task("reverse"))
  assert dataclasses.replace(samp, greedy=True).tool == samp.tool != None  # noqa: E711


def test_the_host_arithmetic_tool_answers_with_the_usual_precedence():
  """`host:jaxrl_llm.envs:arithmetic` (a Python callable through the host verifiers' pool):
  `2+3*4` is 14 there, 20 in the in-graph calculator; what is not arithmetic is an error."""
  host = envs.get_env("host:jaxrl_llm.envs:arithmetic", build_task(), timeout_s=5.0)
  answers, errors = _respond(host, "", ["2+3*4=", "12-30=", "2**3=", "=", "9*9*9*9*9*9*9="])
  assert answers == ["14,", "-18,", ":,", ":,", ":,"]
  assert errors == [False, False, True, True, True]
  assert _respond(envs.Calculator(tokenizer=TOK), "", ["2+3*4="])[0] == ["20,"]


def test_a_failing_host_tool_is_logged_once_as_a_tool_then_only_counted(caplog, monkeypatch):
  """A host tool that raises on every call: its first failure is one warning naming it as a
  host tool (it was a "reward term 'tool' failed" line for every decode step with a call, 87
  in a 2-update run); later batches only count their errors."""
  import logging

  monkeypatch.setattr(host_tool, "_WARNED", set())
  host = envs.get_env("host:host_tools:fail", build_task(), timeout_s=5.0)
  with caplog.at_level(logging.WARNING):
    for _ in range(3):  # three decode steps with calls
      answers, errors = _respond(host, "", ["2+3=", "4*5="])
      assert answers == [":,", ":,"] and errors == [True, True]
  said = [r.getMessage() for r in caplog.records if "failed on item" in r.getMessage()]
  assert len(said) == 1 and said[0].startswith("host tool 'host_tools.fail' failed on item"), said


def build_task():
  from jaxrl_llm.data.tasks import get_task

  return get_task("countdown")


@pytest.mark.extended
@pytest.mark.parametrize("fn", ["hang", "fail"])
def test_a_host_tool_that_hangs_or_raises_is_bounded_counted_and_never_stops_the_run(fn):
  """Every call answered with the error token (a hung call killed at data.verifier_timeout_s)
  and counted in tool/errors_mean; both RL updates finish."""
  cfg = {"task.name": "countdown", "sampling.tool": f"host:host_tools:{fn}"}
  cfg.update({"sampling.max_turns": 2, "data.verifier_timeout_s": 0.5})
  _, metrics = run_steps(parse(tiny_config(**cfg)), 2)
  calls = sum(float(m["tool/calls_mean"]) for m in metrics)
  assert calls > 0
  for m in metrics:
    assert float(m["tool/errors_mean"]) == pytest.approx(float(m["tool/calls_mean"]))
    assert float(m["tool/error_frac"]) == (1.0 if float(m["tool/calls_mean"]) else 0.0)


def test_a_host_tools_answers_join_the_context():
  """`host:host_tools:length` answers each call with its length: those answers are what the
  rollout holds after each call, and the tool's tokens stay out of the loss mask."""
  exp, _, r = _multi_turn(**{"sampling.tool": "host:host_tools:length"})
  assert r.tool_calls.sum() > 0 and r.tool_errors.sum() == 0
  for i in np.nonzero(r.tool_calls)[0]:
    env = r.env_mask[i] > 0
    first = int(np.argmax(env))  # the first answer, right after the first call's `=`
    call = TOK.decode(r.tokens[i, : first - 1], stop_at_eos=False)
    answer = TOK.decode(r.tokens[i, first : first + len(str(len(call))) + 1])
    assert answer == f"{len(call)},", (call, answer)
    assert np.all(r.loss_mask[i][env] == 0)
  assert exp.task.name == "countdown"


def test_a_host_tool_that_cannot_be_imported_is_refused_in_one_line():
  with pytest.raises(ValueError, match=r"cannot import nowhere\.fn"):
    build(tiny_config(**{"task.name": "countdown", "sampling.tool": "host:nowhere:fn"}))


def test_a_host_tool_module_that_exits_on_import_is_refused_in_one_line(tmp_path, monkeypatch):
  """A module calling sys.exit() as it is imported ended the trainer with its status and no
  word, leaving the new workdir behind (an exception at import was already one line)."""
  (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(5)\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ValueError, match=r"cannot import exits_on_import\.f \(SystemExit: 5\)"):
    build(tiny_config(**{"task.name": "countdown", "sampling.tool": "host:exits_on_import:f"}))
