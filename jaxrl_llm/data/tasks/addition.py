"""Addition task: ``<bos>a+b=`` → decimal ``a + b`` then eos."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.data.tasks.base import TASK_DEFAULTS, BuiltinTask, _mix64, ranged, tool_share


@dataclasses.dataclass(frozen=True)
class AdditionTask(BuiltinTask):
  """Adds two integers drawn uniformly from ``[0, 10**digits)``.

  Problem index ``i`` is the pair ``(i // 10**digits, i % 10**digits)``; numbers are written
  without leading zeros. ``a+b`` and ``b+a`` share a split key, so a commuted copy of an
  evaluation problem is never trained on. With ``digits=2``: 10,000 problems, S = 7, A = 4.

  Attributes:
    digits: the operands' digits.
    wrong_traces: fraction of training problems whose trace (the warm start's target) misreads
      the second operand's last digit (one more, mod 10), so its sum is wrong. Evaluation
      traces are never changed; the reward never reads a trace.
    tool_traces: fraction of traces that first call the calculator (`sampling.tool=calculator`)
      with the sum, then copy its answer: ``12+35=47,47`` (``47,`` is what the tool appends; a
      wrong trace calls with the misread operand). The others answer at once.
  """

  name: ClassVar[str] = "addition"
  # The tools whose answers the tool traces show (a sum: with or without precedence alike).
  trace_tools: ClassVar[tuple[str, ...]] = ("calculator", "arithmetic")

  digits: int = ranged(TASK_DEFAULTS.digits, 1, 9)
  wrong_traces: float = ranged(TASK_DEFAULTS.wrong_traces, 0, 1)
  tool_traces: float = ranged(TASK_DEFAULTS.tool_traces, 0, 1)

  @property
  def _base(self) -> int:
    return 10**self.digits

  @property
  def prompt_len(self) -> int:
    """S = bos + digits + '+' + digits + '='."""
    return 2 * self.digits + 3

  @property
  def answer_len(self) -> int:
    """A = (digits + 1) sum digits + eos; with `tool_traces`, the call before them (the two
    operands, `+` and `=`) and the tool's answer (the sum and `,`)."""
    if self.tool_traces <= 0:
      return self.digits + 2
    return (2 * self.digits + 2) + (self.digits + 2) + (self.digits + 2)

  @property
  def num_problems(self) -> int:
    """All ordered pairs (a, b)."""
    return self._base**2

  @property
  def answer_chars(self) -> str:
    """Decimal digits."""
    return "0123456789"

  def split_key(self, index: np.ndarray) -> np.ndarray:
    """The unordered pair {a, b}, so commuted problems land on the same side."""
    a, b = np.divmod(index, self._base)
    return np.minimum(a, b) * self._base + np.maximum(a, b)

  def trivial_rules(self, prompts: list[str]) -> dict[str, list[str]]:
    """An operand (first, second, larger) or both written together."""
    pairs = [p.removesuffix("=").split("+") for p in prompts]
    return {
      "first": [a for a, _ in pairs],
      "second": [b for _, b in pairs],
      "larger": [max(a, b, key=int) for a, b in pairs],
      "both written together": [a + b for a, b in pairs],
    }

  def render(self, index: np.ndarray) -> tuple[list[str], list[str]]:
    """``"a+b="`` prompts and decimal-sum traces (some wrong on the training side, some
    calling the calculator first)."""
    index = np.asarray(index, np.int64)
    a, b = np.divmod(index, self._base)
    prompts = [f"{x}+{y}=" for x, y in zip(a.tolist(), b.tolist())]
    wrong = (_mix64(index, 0xADD) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    wrong = (wrong < self.wrong_traces) & ~self.key_held_out(self.split_key(index))
    read = np.where(wrong, b - b % 10 + (b % 10 + 1) % 10, b)  # the second operand as read
    answers = []
    for x, y, call in zip(a.tolist(), read.tolist(), tool_share(index, self.tool_traces)):
      answers.append(f"{x}+{y}={x + y},{x + y}" if call else str(x + y))
    return prompts, answers

  def reward_terms(self, prompt_tokens, completion, completion_mask, answer, answer_mask):
    """`BuiltinTask.reward_terms` against the prompt's own sum, computed here from its two
    operands (so a wrong or tool-calling trace is never the reference)."""
    del answer_mask
    tok = self.tokenizer
    digit_of = jnp.full((tok.vocab_size,), -1, jnp.int32)
    digit_of = digit_of.at[jnp.asarray(tok.ids_of("0123456789"))].set(jnp.arange(10))
    d = digit_of[prompt_tokens]  # [B, S], -1 off digits
    plus = jnp.cumsum(prompt_tokens == tok.ids_of("+")[0], axis=1) > 0  # at and after the `+`
    total = jnp.zeros(prompt_tokens.shape[:1], jnp.int32)
    for operand in (~plus, plus):  # a, then b: place values from the right of each run
      is_digit = operand & (d >= 0)
      after = jnp.flip(jnp.cumsum(jnp.flip(is_digit, 1), axis=1), 1) - is_digit
      total += jnp.sum(jnp.where(is_digit, d * 10 ** jnp.minimum(after, 9), 0), axis=1)
    true, true_mask = self._number_tokens(total, answer.shape[1])
    return super().reward_terms(prompt_tokens, completion, completion_mask, true, true_mask)

  def _number_tokens(self, value, width: int):
    """`value` [B] (>= 0) in decimal then eos, padded to `width`: ([B, width] ids, mask)."""
    tok = self.tokenizer
    ids = jnp.asarray(tok.ids_of("0123456789"), jnp.int32)
    places = 10 ** jnp.arange(9, -1, -1, dtype=jnp.int32)  # most significant first
    n = jnp.maximum(jnp.sum(value[:, None].astype(jnp.int32) >= places[None, :], axis=1), 1)
    i = jnp.arange(width)[None, :]
    k = jnp.clip(10 - n[:, None] + i, 0, 9)  # index into places
    shown = ids[(value[:, None].astype(jnp.int32) // places[k]) % 10]
    out = jnp.where(i < n[:, None], shown, jnp.where(i == n[:, None], tok.eos_id, tok.pad_id))
    return out.astype(jnp.int32), i <= n[:, None]
