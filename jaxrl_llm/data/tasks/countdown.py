"""Countdown task: ``<bos>538>23`` → any expression of the given digits that makes the target,
e.g. ``5*3+8`` or ``8*3-5*...``; then eos.

What it makes possible that the exact-match tasks do not: many different completions are
correct (orders, subsets and operators of the digits), and they differ in length (3 to
``2n - 1`` characters), so a policy can keep several strategies alive or collapse onto one,
and its correct and wrong answers can grow or shrink. The verifier evaluates the expression,
so the reference answer is only a *trace* for the supervised warm start, and a fraction of
those traces can be made wrong (``wrong_traces``) to warm-start a policy that still fails.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import ClassVar

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.data.tasks.base import (
  REWARD_TERMS,
  TASK_DEFAULTS,
  BuiltinTask,
  _mix64,
  ranged,
  tool_share,
)

OPS = "+-*"
MAX_TARGET = 99  # targets are written with two digits


@functools.cache
def _recipes(n: int) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
  """Every (order of 2..n of the n digit slots, operators between them), fewest digits first."""
  out = []
  for k in range(2, n + 1):
    for order in itertools.permutations(range(n), k):
      out.extend((order, ops) for ops in itertools.product(OPS, repeat=k - 1))
  return out


def evaluate(digits: list[int], ops: list[str]) -> int:
  """Left-to-right value of ``d0 op0 d1 op1 d2 ...`` (no operator precedence)."""
  value = digits[0]
  for op, d in zip(ops, digits[1:]):
    value = value + d if op == "+" else value - d if op == "-" else value * d
  return value


def _digit_tuples(n: int, tuples: np.ndarray) -> np.ndarray:
  """The digits [N, n] (1-9) of digit-tuple numbers [N] in [0, 9**n)."""
  return np.stack([(tuples // 9**j) % 9 + 1 for j in range(n)], -1)


@functools.cache
def _problem_table(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every problem of `n` digits as (digit-tuple number [P], target [P], recipe [P]): each
  pair of a digit tuple and a target in [0, MAX_TARGET] that some recipe reaches, in tuple then
  target order, with the first recipe (fewest digits) that reaches it as its trace."""
  tuples = np.arange(9**n, dtype=np.int64)
  digits = _digit_tuples(n, tuples)
  first = np.full((9**n, MAX_TARGET + 1), -1, np.int32)
  for r, (order, ops) in enumerate(_recipes(n)):
    value = digits[:, order[0]].copy()
    for op, j in zip(ops, order[1:]):
      x = digits[:, j]
      value = value + x if op == "+" else value - x if op == "-" else value * x
    ok = (value >= 0) & (value <= MAX_TARGET)
    ok[ok] &= first[tuples[ok], value[ok]] < 0
    first[tuples[ok], value[ok]] = r
  tuple_of, target = np.nonzero(first >= 0)
  return tuple_of.astype(np.int64), target.astype(np.int64), first[tuple_of, target]


def _key(digits: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Split keys [N]: the sorted digits [N, n] and the target [N] as one integer."""
  key = np.zeros(len(targets), np.int64)
  for column in np.sort(digits, -1).T:
    key = key * 10 + column
  return key * 100 + targets


@dataclasses.dataclass(frozen=True)
class CountdownTask(BuiltinTask):
  """Reach a target in [0, 99] from ``numbers`` digits 1-9, each used at most once, with
  ``+ - *`` evaluated left to right (a calculator chain: ``2+3*4`` is 20).

  A problem is a digit tuple and a target that some expression of 2..n of its digits reaches;
  every such pair is one problem (uniform over them), so the target is not a fixed function of
  the digits: over the whole space, no rule over the prompt (a digit, the first two added, all
  of them chained with fixed operators) solves more than 1.8% of the problems at
  ``numbers=4`` (5.7% at 3; `tools/trivial_answers.py` prints the held-out table). The trace,
  the warm start's
  target, is the first expression reaching it with the fewest digits. Problems with the same
  digits (as a multiset) and target share a split key. With ``numbers=4``: 362,950 problems,
  S = 8, A = 8.

  Attributes:
    numbers: how many digits the prompt gives (2..5).
    wrong_traces: fraction of training problems whose trace (the warm start's target) has its
      last operator changed, so it usually misses the target. Evaluation traces are never
      changed; the reward never reads a trace.
    tool_traces: fraction of traces (1: every one) that first call the countdown tool
      (`sampling.tool=countdown`) with the expression, then write it: ``5*3+8=23,5*3+8`` (the
      tool's answer, ``23,``, is what the tool would append). The warm start imitates whole
      traces, the tool's answers included; RL never learns from the tool's tokens.
  """

  name: ClassVar[str] = "countdown"
  # The tools whose answers the tool traces show (left to right, as the expressions are built).
  trace_tools: ClassVar[tuple[str, ...]] = ("countdown", "calculator")

  numbers: int = ranged(TASK_DEFAULTS.numbers, 2, 5)
  wrong_traces: float = ranged(TASK_DEFAULTS.wrong_traces, 0, 1)
  tool_traces: float = ranged(TASK_DEFAULTS.tool_traces, 0, 1)

  @property
  def prompt_len(self) -> int:
    """S = bos + digits + '>' + two target digits."""
    return self.numbers + 4

  @property
  def answer_len(self) -> int:
    """A = the longest expression (every digit used) + eos; with `tool_traces`, the call, the
    tool's answer (a sign, the digits of 9**numbers, the end) and the expression again."""
    expression = 2 * self.numbers - 1
    if self.tool_traces <= 0:
      return expression + 1
    return 2 * expression + 1 + len(str(9**self.numbers)) + 2 + 1

  @property
  def num_problems(self) -> int:
    """Pairs of a digit tuple and a target it reaches."""
    return len(_problem_table(self.numbers)[0])

  @property
  def answer_chars(self) -> str:
    """Digits 1-9 and the operators."""
    return "123456789" + OPS

  def _problems(self, index: np.ndarray) -> tuple[np.ndarray, list, np.ndarray]:
    """(digits [N, n], recipes, targets [N]) of problem indices."""
    tuple_of, target, recipe = (
      a[np.asarray(index, np.int64)] for a in _problem_table(self.numbers)
    )
    table = _recipes(self.numbers)
    return _digit_tuples(self.numbers, tuple_of), [table[r] for r in recipe.tolist()], target

  def trivial_rules(self, prompts: list[str]) -> dict[str, list[str]]:
    """A digit (each position), two digits in prompt order with each operator (`d1+d2` adds
    the first two), and every digit in prompt order chained by each fixed operator sequence."""
    given = [p.split(">")[0] for p in prompts]
    n = self.numbers
    out = {f"d{i + 1}": [g[i] for g in given] for i in range(n)}
    for i, j in itertools.combinations(range(n), 2):
      out.update({f"d{i + 1}{op}d{j + 1}": [g[i] + op + g[j] for g in given] for op in OPS})
    for ops in itertools.product(OPS, repeat=n - 1):
      name = "all " + "".join(ops)
      out[name] = ["".join(d + o for d, o in zip(g, (*ops, ""))) for g in given]
    return out

  def split_key(self, index: np.ndarray) -> np.ndarray:
    """The sorted digits and the target, so reordered copies land on the same side."""
    digits, _, targets = self._problems(index)
    return _key(digits, targets)

  def render(self, index: np.ndarray) -> tuple[list[str], list[str]]:
    """``"538>23"`` prompts and recipe traces (some made wrong on the training side)."""
    index = np.asarray(index, np.int64)
    digits, recipes, targets = self._problems(index)
    wrong = (_mix64(index, 0x7A11) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    wrong = (wrong < self.wrong_traces) & ~self.key_held_out(_key(digits, targets))
    calls = tool_share(index, self.tool_traces)
    prompts, answers = [], []
    for row, (order, ops), t, w, call in zip(
      digits.tolist(), recipes, targets.tolist(), wrong, calls
    ):
      ops = list(ops)
      if w:  # the next operator in "+-*" order
        ops[-1] = OPS[(OPS.index(ops[-1]) + 1) % len(OPS)]
      prompts.append("".join(map(str, row)) + f">{t:02d}")
      expression = str(row[order[0]]) + "".join(o + str(row[j]) for o, j in zip(ops, order[1:]))
      if call:  # the call, the tool's answer (envs.CountdownCheck), the expression
        value = evaluate([row[j] for j in order], ops)
        expression = f"{expression}={value},{expression}"
      answers.append(expression)
    return prompts, answers

  def reward_terms(self, prompt_tokens, completion, completion_mask, answer, answer_mask):
    """Pure-JAX verifier (the arguments of `BuiltinTask.reward_terms`): per-sequence reward
    terms, each [B] float32.

    ``format``: the body (up to the first eos) is ``digit (op digit)*`` and ends with an eos.
    ``correct``: well-formed, uses each given digit at most as often as the prompt gives it, and
    evaluates (left to right) to the target. ``partial``: for a well-formed expression of the
    given digits, ``1 - min(|value - target|, 10) / 10``, else 0. The trace (``answer``) is not
    read.
    """
    chex.assert_rank([prompt_tokens, completion, completion_mask], 2)
    chex.assert_equal_shape([completion, completion_mask])
    del answer, answer_mask
    tok, n = self.tokenizer, self.numbers
    b, t = completion.shape
    digit_of = jnp.full((tok.vocab_size,), -1, jnp.int32)
    digit_of = digit_of.at[jnp.asarray(tok.ids_of("0123456789"))].set(jnp.arange(10))
    given = digit_of[prompt_tokens[:, -(n + 3) : -3]]  # [B, n]
    target = digit_of[prompt_tokens[:, -2]] * 10 + digit_of[prompt_tokens[:, -1]]  # [B]

    tokens = jnp.where(completion_mask > 0, completion, tok.pad_id)
    is_eos = tokens == tok.eos_id
    terminated = is_eos.any(-1)
    length = jnp.where(terminated, jnp.argmax(is_eos, -1), t)  # [B]
    pos = jnp.arange(t)[None, :]
    body = pos < length[:, None]
    value_of = digit_of[tokens]  # [B, T], -1 off digits
    op_of = (
      jnp.zeros((tok.vocab_size,), jnp.int32)
      .at[jnp.asarray(tok.ids_of(OPS))]
      .set(jnp.arange(1, len(OPS) + 1))[tokens]
    )  # [B, T]: 1 '+', 2 '-', 3 '*', 0 otherwise
    even = pos % 2 == 0
    grammar = jnp.where(even, value_of >= 1, op_of > 0) | ~body
    well_formed = terminated & (length % 2 == 1) & (length <= 2 * n - 1) & grammar.all(-1)

    used = jax.nn.one_hot(jnp.where(body & even, value_of, -1), 10, dtype=jnp.int32).sum(1)
    have = jax.nn.one_hot(given, 10, dtype=jnp.int32).sum(1)  # [B, 10]
    legal = well_formed & jnp.all(used <= have, -1)

    def chain(carry, x):
      value, op = carry
      d, o, k = x
      step = jnp.select([op == 1, op == 2, op == 3], [value + d, value - d, value * d], d)
      value = jnp.where((k % 2 == 0) & (k < length), step, value)
      return (value, jnp.where(o > 0, o, op)), None

    xs = (value_of.T, op_of.T, jnp.arange(t))
    (value, _), _ = lax.scan(chain, (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32)), xs)
    correct = legal & (value == target)
    partial = jnp.where(legal, (10 - jnp.minimum(jnp.abs(value - target), 10)) / 10, 0.0)
    out = dict(zip(REWARD_TERMS, (correct, well_formed, partial), strict=True))
    return {k: v.astype(jnp.float32) for k, v in out.items()}
