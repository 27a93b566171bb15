"""Sort task: ``<bos>dbca:`` → ``abcd`` then eos."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxrl_llm.data.tasks.strings import LetterStringTask


@dataclasses.dataclass(frozen=True)
class SortTask(LetterStringTask):
  """Sorts the letters of a random string of ``min_len..max_len`` letters a-j (defaults 2..5)."""

  name: ClassVar[str] = "sort"

  separator: str = dataclasses.field(default=":", init=False)

  def transform(self, text: str) -> str:
    """The letters in alphabetical order."""
    return "".join(sorted(text))
