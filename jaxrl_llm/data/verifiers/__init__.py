"""Host-side verifiers that score decoded completions (run outside jit).

`math` extracts and compares answers (refusing over-long or too deeply nested input before
parsing it); `rewards` turns them into reward terms; `scoring` scores batches robustly in worker
processes (errors and timeouts score 0.0 and are counted; a hung call's worker is killed).
`get_reward_fn(name)` looks up a two-argument term `fn(completion, reference) -> float` by name;
`@register_reward(name)` adds one of your own (docs/data_and_checkpoints.md).
"""

import importlib.util
from collections.abc import Callable

from jaxrl_llm.data.verifiers.math import (
  brace_depth,
  extract_answer,
  extract_boxed,
  extract_gsm8k,
  extract_last_number,
  is_equivalent,
  normalize,
  parse_number,
  within_limits,
)
from jaxrl_llm.data.verifiers.rewards import (
  RewardFn,
  answer_line_correct,
  answer_line_format,
  correctness_reward,
  format_reward,
  gsm8k_correct,
  gsm8k_format,
  math_correct,
  math_correct_boxed,
  math_format_boxed,
  math_verify_correct,
  reference_answer,
  think_format,
)
from jaxrl_llm.data.verifiers.scoring import score_batch, shutdown_workers, worker_pids
from jaxrl_llm.data.verifiers.workers import unpicklable

REWARD_FNS: dict[str, RewardFn] = {
  "math_correct": math_correct,
  "math_correct_boxed": math_correct_boxed,
  "math_verify_correct": math_verify_correct,
  "gsm8k_correct": gsm8k_correct,
  "math_format_boxed": math_format_boxed,
  "think_format": think_format,
  "gsm8k_format": gsm8k_format,
  "answer_line_correct": answer_line_correct,
  "answer_line_format": answer_line_format,
}


# Terms that need an optional package: name → (module to import, how to install it).
NEEDS_PACKAGE: dict[str, tuple[str, str]] = {
  "math_verify_correct": ("math_verify", "pip install -e '.[math]'"),
}


BUILT_IN = frozenset({"correct", *REWARD_FNS})  # names a plug-in term may not take


def register_reward(
  name: str, *, needs: tuple[str, str] | None = None
) -> Callable[[RewardFn], RewardFn]:
  """Decorator adding `fn(completion: str, reference: str) -> float` to `REWARD_FNS` as `name`,
  so `task.reward_weights` and `data.correct_term` can name it (returns the function).

  `needs`: (module, how to install it) of an optional package it imports (`NEEDS_PACKAGE`).
  ValueError, one line, for a built-in name, a name that is not an identifier, or a function
  that cannot be pickled: worker processes call it, so it must be a module-level function (or a
  functools.partial of one), not a lambda or a nested function.
  """
  if name in BUILT_IN or not name.isidentifier():
    why = "is a built-in term" if name in BUILT_IN else "is not a Python identifier"
    raise ValueError(
      f"reward term {name!r} {why}: a term of your own needs a new identifier (built-in: "
      f"{', '.join(sorted(BUILT_IN))})"
    )

  def add(fn: RewardFn) -> RewardFn:
    said = unpicklable(fn)
    if said:
      raise ValueError(
        f"reward term {name!r} cannot be pickled ({said}); register a module-level function (or "
        "a functools.partial of one) of a module the config file imports"
      )
    REWARD_FNS[name] = fn
    if needs is not None:
      NEEDS_PACKAGE[name] = needs
    return fn

  return add


def missing_package(name: str) -> str | None:
  """What the reward term `name` lacks to run here ('math_verify (pip install ...)'), or None
  when it needs nothing or its package is installed (found, not imported)."""
  if name not in NEEDS_PACKAGE:
    return None
  module, install = NEEDS_PACKAGE[name]
  try:
    found = importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a parent package missing, or an import blocked
    found = False
  return None if found else f"{module} ({install})"


def get_reward_fn(name: str) -> RewardFn:
  """The reward term registered as `name`; ValueError listing the valid names otherwise."""
  try:
    return REWARD_FNS[name]
  except KeyError:
    raise ValueError(
      f"unknown reward function {name!r}; valid names: {', '.join(sorted(REWARD_FNS))}"
    ) from None


__all__ = [
  "BUILT_IN",
  "NEEDS_PACKAGE",
  "REWARD_FNS",
  "RewardFn",
  "answer_line_correct",
  "answer_line_format",
  "brace_depth",
  "correctness_reward",
  "extract_answer",
  "extract_boxed",
  "extract_gsm8k",
  "extract_last_number",
  "format_reward",
  "get_reward_fn",
  "gsm8k_correct",
  "gsm8k_format",
  "is_equivalent",
  "math_correct",
  "math_correct_boxed",
  "math_format_boxed",
  "math_verify_correct",
  "missing_package",
  "normalize",
  "parse_number",
  "reference_answer",
  "register_reward",
  "score_batch",
  "shutdown_workers",
  "think_format",
  "unpicklable",
  "within_limits",
  "worker_pids",
]
