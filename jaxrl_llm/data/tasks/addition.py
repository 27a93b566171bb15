"""Addition task: ``<bos>a+b=`` → decimal ``a + b`` then eos."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from jaxrl_llm.data.tasks.base import TASK_DEFAULTS, BuiltinTask, ranged


@dataclasses.dataclass(frozen=True)
class AdditionTask(BuiltinTask):
  """Adds two integers drawn uniformly from ``[0, 10**digits)``.

  Problem index ``i`` is the pair ``(i // 10**digits, i % 10**digits)``; numbers are written
  without leading zeros. ``a+b`` and ``b+a`` share a split key, so a commuted copy of an
  evaluation problem is never trained on. With ``digits=2``: 10,000 problems, S = 7, A = 4.
  """

  name: ClassVar[str] = "addition"

  digits: int = ranged(TASK_DEFAULTS.digits, 1, 9)

  @property
  def _base(self) -> int:
    return 10**self.digits

  @property
  def prompt_len(self) -> int:
    """S = bos + digits + '+' + digits + '='."""
    return 2 * self.digits + 3

  @property
  def answer_len(self) -> int:
    """A = (digits + 1) sum digits + eos."""
    return self.digits + 2

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
    """``"a+b="`` prompts and decimal-sum answers."""
    a, b = np.divmod(np.asarray(index, np.int64), self._base)
    a, b = a.tolist(), b.tolist()
    prompts = [f"{x}+{y}=" for x, y in zip(a, b)]
    answers = [str(x + y) for x, y in zip(a, b)]
    return prompts, answers
