"""Host-side verifiers that score decoded completions (run outside jit).

`math` extracts and compares answers (refusing over-long or too deeply nested input before
parsing it); `rewards` turns them into reward terms; `scoring` scores batches robustly in worker
processes (errors and timeouts score 0.0 and are counted; a hung call's worker is killed).
`get_reward_fn(name)` looks up a two-argument term `fn(completion, reference) -> float` by name.
"""

import importlib.util

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
  "score_batch",
  "shutdown_workers",
  "think_format",
  "within_limits",
  "worker_pids",
]
