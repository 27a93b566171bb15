"""Shared problem space of the string tasks: strings over the letters a-j."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm.data.tasks.base import TASK_DEFAULTS, BuiltinTask, ranged

LETTERS = "abcdefghij"
_DIGITS_TO_LETTERS = str.maketrans("0123456789", LETTERS)


@dataclasses.dataclass(frozen=True)
class LetterStringTask(BuiltinTask):
  """Problems are all strings over ``LETTERS`` with length in ``[min_len, max_len]``.

  Index ``i`` enumerates shorter strings first; within a length, the string is ``i``'s offset
  written in base 10 with digit ``k`` shown as ``LETTERS[k]``. Prompts are
  ``<bos>{string}{separator}``. With lengths 2..5: 111,100 problems, S = 7, A = 6.
  """

  min_len: int = ranged(TASK_DEFAULTS.min_len, 1, 12)
  max_len: int = ranged(TASK_DEFAULTS.max_len, 1, 12)

  separator: str = dataclasses.field(default=">", init=False)

  @classmethod
  def field_errors(cls, v: dict) -> list[str]:
    """The base's checks (each length in [1, 12]), and min_len <= max_len (said only when both
    lengths are in range: an out-of-range one is the problem to fix first)."""
    out = super().field_errors(v)
    in_range = not any(e.startswith(("task.min_len=", "task.max_len=")) for e in out)
    if in_range and not v["min_len"] <= v["max_len"]:
      out.append(f"task.min_len={v['min_len']} must be <= task.max_len={v['max_len']}")
    return out

  @property
  def prompt_len(self) -> int:
    """S = bos + max_len letters + separator."""
    return self.max_len + 2

  @property
  def answer_len(self) -> int:
    """A = max_len letters + eos."""
    return self.max_len + 1

  @property
  def num_problems(self) -> int:
    """Number of strings with length in ``[min_len, max_len]``."""
    return sum(len(LETTERS) ** n for n in range(self.min_len, self.max_len + 1))

  @property
  def answer_chars(self) -> str:
    """The letters a-j."""
    return LETTERS

  def strings(self, index: np.ndarray) -> list[str]:
    """The string of each problem index [N]."""
    index = np.asarray(index, np.int64)
    lengths = np.arange(self.min_len, self.max_len + 1)
    starts = np.concatenate([[0], np.cumsum(len(LETTERS) ** lengths)])  # [num_lengths + 1]
    which = np.searchsorted(starts, index, side="right") - 1
    offset = (index - starts[which]).tolist()
    length = lengths[which].tolist()
    return [f"{o:0{n}d}".translate(_DIGITS_TO_LETTERS) for o, n in zip(offset, length)]

  def transform(self, text: str) -> str:
    """The answer for input string ``text``."""
    raise NotImplementedError

  def trivial_rules(self, prompts: list[str]) -> dict[str, list[str]]:
    """The string echoed, its first letter, its last letter."""
    strings = [p.removesuffix(self.separator) for p in prompts]
    return {
      "echo": strings,
      "first letter": [s[:1] for s in strings],
      "last letter": [s[-1:] for s in strings],
    }

  def render(self, index: np.ndarray) -> tuple[list[str], list[str]]:
    """``"{s}{separator}"`` prompts and ``transform(s)`` answers."""
    strings = self.strings(index)
    return [s + self.separator for s in strings], [self.transform(s) for s in strings]
