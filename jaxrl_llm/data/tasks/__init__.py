"""Built-in synthetic verifiable tasks (in-graph JAX verifiers) and their registry."""

from __future__ import annotations

import dataclasses

from jaxrl_llm.data.tasks.addition import AdditionTask
from jaxrl_llm.data.tasks.base import BuiltinTask
from jaxrl_llm.data.tasks.countdown import CountdownTask
from jaxrl_llm.data.tasks.reverse import ReverseTask
from jaxrl_llm.data.tasks.sort import SortTask
from jaxrl_llm.data.tasks.tokenizer import CharTokenizer

TASKS: dict[str, type[BuiltinTask]] = {
  AdditionTask.name: AdditionTask,
  CountdownTask.name: CountdownTask,
  ReverseTask.name: ReverseTask,
  SortTask.name: SortTask,
}


def _init_fields(cls: type[BuiltinTask]) -> set[str]:
  return {f.name for f in dataclasses.fields(cls) if f.init}


def field_errors(values: dict) -> list[str]:
  """Why any registered task's fields among `values` (the `task` config section's) are out
  of range, whichever task is selected: each task's own checks, once each."""
  out: list[str] = []
  for cls in TASKS.values():
    own = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
    own |= {k: v for k, v in values.items() if k in own}
    out += [e for e in cls.field_errors(own) if e not in out]
  return out


def get_task(name: str, **kwargs) -> BuiltinTask:
  """Builds the registered task ``name`` with its keyword hyperparameters.

  Hyperparameters that belong only to other registered tasks (e.g. ``min_len`` when building
  ``addition``) are ignored, so one config section can hold every task's fields. Raises
  ValueError for an unknown task name or a keyword no registered task accepts.
  """
  if name not in TASKS:
    raise ValueError(f"Unknown task {name!r}; valid task names: {sorted(TASKS)}.")
  cls = TASKS[name]
  own = _init_fields(cls)
  known = set().union(*(_init_fields(c) for c in TASKS.values()))
  unknown = sorted(set(kwargs) - known)
  if unknown:
    raise ValueError(
      f"Task {name!r} got unknown arguments {unknown}; valid arguments: {sorted(own)}."
    )
  return cls(**{k: v for k, v in kwargs.items() if k in own})


__all__ = [
  "TASKS",
  "AdditionTask",
  "BuiltinTask",
  "CharTokenizer",
  "CountdownTask",
  "ReverseTask",
  "SortTask",
  "field_errors",
  "get_task",
]
