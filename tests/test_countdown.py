"""The countdown task: its in-graph verifier on hand cases, its split, its traces, and a warm
start of the real model that reaches the accuracy its config states."""

from __future__ import annotations

import collections
import itertools
import pathlib

import jax
import numpy as np
import pytest
from parsed import train_and_evaluate

from jaxrl_llm.data.task import Task
from jaxrl_llm.data.tasks import CharTokenizer, CountdownTask, get_task
from jaxrl_llm.data.tasks.countdown import evaluate

TOK = CharTokenizer()


def _terms(task, prompt: str, completions: list[str], t: int = 8, eos: bool = True):
  """The verifier's terms of `completions` (each ended by an eos unless `eos` is False)."""
  tokens, _ = TOK.encode_batch(
    [prompt] * len(completions), task.prompt_len, bos=True, eos=False, left_pad=True
  )
  comp, mask = TOK.encode_batch(completions, t, bos=False, eos=eos, left_pad=False)
  answer, answer_mask = TOK.encode_batch(
    [""] * len(completions), task.answer_len, bos=False, eos=True, left_pad=False
  )
  out = jax.jit(task.reward_terms)(tokens, comp, mask.astype(np.float32), answer, answer_mask)
  return {k: np.asarray(v) for k, v in out.items()}


def test_the_verifier_accepts_every_expression_that_makes_the_target():
  task = get_task("countdown", numbers=3)  # 538>23: 5*3+8 = 23, 3*5+8, 8+3*5 = 55 (left to right)
  cases = {
    "5*3+8": 1,  # a trace-like answer
    "3*5+8": 1,  # another order
    "8+5*3": 0,  # 39, left to right
    "8*3-5+": 0,  # ends in an operator
    "8*3-1": 0,  # 1 is not given
    "5*5-2": 0,  # 5 used twice, given once
    "5*3+8+": 0,
    "23": 0,  # the target, not an expression of the digits
    "": 0,
  }
  r = _terms(task, "538>23", list(cases))
  np.testing.assert_array_equal(r["correct"], list(cases.values()))
  np.testing.assert_array_equal(r["format"], [1, 1, 1, 0, 1, 1, 0, 0, 0])
  np.testing.assert_allclose(r["partial"][:3], [1.0, 1.0, 0.0])
  assert r["partial"][4] == 0.0  # a digit not given earns nothing
  # 8*3-5 = 19: four from the target.
  np.testing.assert_allclose(_terms(task, "538>23", ["8*3-5"])["partial"], [0.6])


def test_the_verifier_needs_an_eos_and_reads_nothing_after_it():
  task = get_task("countdown", numbers=3)
  assert _terms(task, "538>23", ["5*3+8"], eos=False)["correct"][0] == 0
  comp, mask = TOK.encode_batch(["5*3+8"], 8, bos=False, eos=True, left_pad=False)
  comp[0, 6:] = TOK.ids_of("*9")  # junk after the eos
  tokens, _ = TOK.encode_batch(["538>23"], task.prompt_len, bos=True, eos=False, left_pad=True)
  out = task.reward_terms(tokens, comp, np.ones_like(mask, np.float32), comp[:, :6], mask[:, :6])
  assert float(out["correct"][0]) == 1.0


def test_repeated_digits_may_be_used_as_often_as_given():
  task = get_task("countdown", numbers=4)
  r = _terms(task, "7713>49", ["7*7", "7*7*1", "7*7*7"], t=10)
  np.testing.assert_array_equal(r["correct"], [1, 1, 0])


def _reachable(n: int) -> int:
  """How many (digit tuple, target in [0, 99]) pairs some left-to-right chain of 2..n of the
  tuple's digits (each slot used once, + - *) reaches: every order and operator sequence,
  evaluated over all 9**n tuples at once."""
  digits = np.array(list(itertools.product(range(1, 10), repeat=n)))
  reached = np.zeros((len(digits), 100), bool)
  rows = np.arange(len(digits))
  for k in range(2, n + 1):
    for order in itertools.permutations(range(n), k):
      for ops in itertools.product("+-*", repeat=k - 1):
        value = digits[:, order[0]]
        for op, j in zip(ops, order[1:], strict=True):
          x = digits[:, j]
          value = value + x if op == "+" else value - x if op == "-" else value * x
        ok = (value >= 0) & (value <= 99)
        reached[rows[ok], value[ok]] = True
  return int(reached.sum())


def test_countdown_implements_the_task_interface_with_a_disjoint_split():
  task = get_task("countdown", numbers=3)
  assert isinstance(task, Task) and isinstance(task, CountdownTask)
  assert (task.prompt_len, task.answer_len) == (7, 6)
  # Every (digit tuple, target in [0, 99]) that a left-to-right chain of 2..n of its digits,
  # each slot used once, reaches: counted here by brute force over the 9**n tuples.
  assert task.num_problems == _reachable(3) == 12800
  assert get_task("countdown", numbers=4).num_problems == _reachable(4)
  assert get_task("countdown").num_problems == _reachable(4)  # numbers=4 is the default
  ev, answers = task.eval_set()
  assert answers is None and ev["tokens"].shape == (256, 7)
  train = task.train_examples(0)
  eval_keys = {(r.tobytes()) for r in ev["tokens"]}
  assert not eval_keys & {r.tobytes() for r in train["tokens"]}
  # Same multiset of digits and target: the same side of the split.
  index = np.arange(task.num_problems)
  digits, _, targets = task._problems(index)
  canon = np.sort(digits, -1) @ np.array([100, 10, 1]) * 100 + targets
  held = task.is_held_out(index)
  for key in np.unique(canon)[:500]:
    assert len(set(held[canon == key].tolist())) == 1


@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_traces_are_diverse_solutions_and_wrong_at_the_stated_rate(wrong):
  """Every trace is an expression of the given digits; held-out traces all make their target,
  training traces miss it at about the `wrong_traces` rate (a changed operator can still hit)."""
  task = get_task("countdown", numbers=3, wrong_traces=wrong)
  for examples, rate in ((task.eval_examples(), 0.0), (task.train_examples(0), wrong)):
    prompts = [TOK.decode(r).split(">") for r in examples["tokens"]]
    traces = [TOK.decode(r) for r in examples["answer"]]
    hits = []
    for (given, target), trace in zip(prompts, traces, strict=True):
      digits, ops = trace[::2], trace[1::2]
      assert not collections.Counter(digits) - collections.Counter(given), (given, trace)
      hits.append(evaluate([int(d) for d in digits], list(ops)) == int(target))
    missed = 1 - np.mean(hits)
    assert rate - 0.06 <= missed <= rate + 0.01, (rate, missed)
    assert {len(trace) for trace in traces} == {3, 5}  # answers of different lengths
    shapes = {trace.translate(str.maketrans("", "", "123456789")) for trace in traces}
    assert len(shapes) == 12  # every operator pattern of two and three digits


@pytest.mark.extended
def test_a_warm_start_on_countdown_leaves_room_to_fail(tmp_path):
  """The testbed's policy (configs/countdown.py), warm-started on traces of which 30% are wrong,
  answers held-out problems above twice the best trivial answer and far from perfectly (greedy
  accuracy < 0.6, pass@4 < 0.8): a policy with room to fail and to improve, read back from its
  events."""
  from conftest import load_config

  from jaxrl_llm import metrics as metrics_lib
  from jaxrl_llm.data.tasks.trivial import trivial_table

  config = load_config("countdown")
  config.train.num_steps, config.train.eval_every = 1, 1
  train_and_evaluate(config, str(tmp_path))
  scalars = metrics_lib.read_scalars(str(tmp_path))
  accuracy, pass_k = scalars["eval/accuracy"][0], scalars["eval/pass@4"][0]
  trivial = trivial_table(get_task("countdown", numbers=config.task.numbers))["best"]
  assert accuracy[0] == pass_k[0] == 0
  assert 2 * trivial < accuracy[1] < 0.6 and pass_k[1] < 0.8, (accuracy, pass_k, trivial)


@pytest.mark.parametrize("setting", ["cpu", "gpu", "moe"])
def test_every_setting_of_the_testbed_config_parses(setting):
  """`configs/countdown.py:SETTING` through the trainer's own parser: the countdown task with
  wrong traces in each; the MoE twin has the CPU setting's body with routed experts."""
  from jaxrl_llm import launch as trainer_main

  path = str(pathlib.Path(__file__).parents[1] / "configs" / "countdown.py")
  config = trainer_main.parse_config(["t", f"--config={path}:{setting}"])
  assert config.task.name == "countdown" and config.task.wrong_traces == 0.3
  assert config.model.moe_num_experts == (4 if setting == "moe" else 0)
  assert config.model.d_model == (256 if setting == "gpu" else 64)
  with pytest.raises(ValueError, match="the settings are cpu"):
    trainer_main.parse_config(["t", f"--config={path}:tpu"])


def test_tool_traces_hold_what_the_countdown_tool_answers():
  """`tool_traces`: each trace is `call=answer,expression`, the answer exactly what
  `envs.CountdownCheck` appends to that call, and the expression the plain trace."""
  import jax.numpy as jnp

  from jaxrl_llm import envs

  plain = get_task("countdown", numbers=4, wrong_traces=0.3)
  tooled = get_task("countdown", numbers=4, wrong_traces=0.3, tool_traces=1.0)
  index = np.arange(0, 362_950, 997)
  prompts, traces = tooled.render(index)
  assert traces != plain.render(index)[1]
  assert [t.split(",")[1] for t in traces] == plain.render(index)[1]
  assert max(map(len, traces)) + 1 <= tooled.answer_len
  tok = tooled.tokenizer
  calls = [t.split("=")[0] + "=" for t in traces]
  comp, _ = tok.encode_batch(calls, 8, bos=False, eos=False, left_pad=False)
  prompt_ids, _ = tok.encode_batch(prompts, 8, bos=True, eos=False, left_pad=True)
  end = jnp.asarray([len(c) - 1 for c in calls])
  expected = [t.split("=")[1].split(",")[0] + "," for t in traces]

  def answers(name):
    """What the tool `name` appends to each trace's call (and whether any was an error)."""
    env = envs.get_env(name, tooled)
    answer, length, error = env.respond(
      jnp.asarray(prompt_ids), jnp.asarray(comp), jnp.zeros_like(end), end
    )
    shown = [tok.decode(a[:n]) for a, n in zip(np.asarray(answer), np.asarray(length))]
    return shown, bool(np.asarray(error).any())

  assert isinstance(envs.get_env("countdown", tooled), envs.CountdownCheck)
  for name in tooled.trace_tools:  # the tools the config check lets a traced run use
    assert answers(name) == (expected, False), name
  assert answers("arithmetic")[0] != expected  # precedence answers some calls otherwise
