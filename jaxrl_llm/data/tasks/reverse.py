"""Reverse task: ``<bos>abcd>`` → ``dcba`` then eos."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxrl_llm.data.tasks.strings import LetterStringTask


@dataclasses.dataclass(frozen=True)
class ReverseTask(LetterStringTask):
  """Reverses a random string of ``min_len..max_len`` letters a-j (defaults 2..5)."""

  name: ClassVar[str] = "reverse"

  separator: str = dataclasses.field(default=">", init=False)

  def transform(self, text: str) -> str:
    """The reversed string."""
    return text[::-1]
