"""Built-in synthetic verifiable tasks and their registry."""

from __future__ import annotations

import dataclasses

from jaxrl_llm.tasks.addition import AdditionTask
from jaxrl_llm.tasks.base import Task
from jaxrl_llm.tasks.reverse import ReverseTask
from jaxrl_llm.tasks.sort import SortTask
from jaxrl_llm.tasks.tokenizer import CharTokenizer

TASKS: dict[str, type[Task]] = {
  AdditionTask.name: AdditionTask,
  ReverseTask.name: ReverseTask,
  SortTask.name: SortTask,
}


def get_task(name: str, **kwargs) -> Task:
  """Builds the registered task ``name`` with its keyword hyperparameters.

  Raises ValueError for an unknown task name or an unknown keyword, listing the valid ones.
  """
  if name not in TASKS:
    raise ValueError(f"Unknown task {name!r}; valid task names: {sorted(TASKS)}.")
  cls = TASKS[name]
  valid = sorted(f.name for f in dataclasses.fields(cls) if f.init)
  unknown = sorted(set(kwargs) - set(valid))
  if unknown:
    raise ValueError(f"Task {name!r} got unknown arguments {unknown}; valid arguments: {valid}.")
  return cls(**kwargs)


__all__ = ["TASKS", "AdditionTask", "CharTokenizer", "ReverseTask", "SortTask", "Task", "get_task"]
