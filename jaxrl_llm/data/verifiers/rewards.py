"""Reward terms over decoded completions (host side): correctness and format.

A reward term is any callable `fn(completion: str, reference: str) -> float` (`RewardFn`). The
terms here are top-level functions, so they pickle into the worker processes of
`jaxrl_llm.data.verifiers.scoring.score_batch`, which runs them on a batch (errors and
timeouts score 0.0 and are counted). They also refuse over-long or too deeply nested input
before parsing it (see `jaxrl_llm.data.verifiers.math`), so they stay fast on any text. The
registry of names (`REWARD_FNS`, `get_reward_fn`) is `jaxrl_llm.data.verifiers`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

from jaxrl_llm.data.verifiers import math as vmath

RewardFn = Callable[[str, str], float]
_FORMAT_TEMPLATES = ("boxed", "think", "gsm8k")
_THINK_RE = re.compile(r"^\s*<think>(?P<think>.*?)</think>(?P<answer>.*)$", re.DOTALL)


def reference_answer(reference: str) -> str:
  """The answer inside a reference: its last `\\boxed{}`, else after `####`, else all of it."""
  boxed = [b for b in vmath.extract_boxed(reference) if b]
  if boxed:
    return boxed[-1]
  gsm = vmath.extract_gsm8k(reference)
  return gsm if gsm is not None else reference.strip()


def correctness_reward(
  completion: str, reference: str, *, extract: str = "auto", backend: str = "builtin"
) -> float:
  """1.0 when the answer extracted from `completion` is equivalent to `reference`, else 0.0.

  A completion over `MAX_TEXT_CHARS`, and an answer window or answer over the size and brace
  depth limits of `jaxrl_llm.data.verifiers.math`, score 0.0 without being parsed.
  """
  if len(completion) > vmath.MAX_TEXT_CHARS:
    return 0.0
  pred = vmath.extract_answer(completion, extract)
  if pred is None:
    return 0.0
  return float(vmath.is_equivalent(pred, reference_answer(reference), backend=backend))


def format_reward(completion: str, *, template: str = "boxed") -> float:
  """1.0 when `completion` follows `template` ('boxed', 'think' or 'gsm8k'), else 0.0.

  'boxed': exactly one non-empty `\\boxed{}`. 'think': starts with one `<think>...</think>`
  block followed by a non-empty answer. 'gsm8k': exactly one `####` followed by an answer.
  Linear in `len(completion)`; a completion over `MAX_TEXT_CHARS` scores 0.0 unread.
  """
  if template not in _FORMAT_TEMPLATES:
    raise ValueError(f"format template {template!r} is not one of {_FORMAT_TEMPLATES}")
  if len(completion) > vmath.MAX_TEXT_CHARS:
    return 0.0
  if template == "boxed":
    boxed = vmath.extract_boxed(completion)
    return float(len(boxed) == 1 and bool(boxed[0]))
  if template == "think":
    if completion.count("<think>") != 1 or completion.count("</think>") != 1:
      return 0.0
    m = _THINK_RE.match(completion)
    return float(m is not None and bool(m["think"].strip()) and bool(m["answer"].strip()))
  return float(completion.count("####") == 1 and vmath.extract_gsm8k(completion) is not None)


# Two-argument, top-level (hence picklable) forms for the registry and `score_batch`.


def math_correct(completion: str, reference: str) -> float:
  """`correctness_reward` with extraction 'auto' (last boxed → `####` → last number)."""
  return correctness_reward(completion, reference, extract="auto")


def math_correct_boxed(completion: str, reference: str) -> float:
  """`correctness_reward` reading only the last `\\boxed{}` answer."""
  return correctness_reward(completion, reference, extract="boxed")


def gsm8k_correct(completion: str, reference: str) -> float:
  """`correctness_reward` reading only the answer after `####`."""
  return correctness_reward(completion, reference, extract="gsm8k")


def math_verify_correct(completion: str, reference: str) -> float:
  """`correctness_reward` judged by the optional `math-verify` package."""
  return correctness_reward(completion, reference, extract="auto", backend="math_verify")


def math_format_boxed(completion: str, reference: str | None = None) -> float:
  """`format_reward(template='boxed')`; `reference` is ignored."""
  del reference
  return format_reward(completion, template="boxed")


def think_format(completion: str, reference: str | None = None) -> float:
  """`format_reward(template='think')`; `reference` is ignored."""
  del reference
  return format_reward(completion, template="think")


def gsm8k_format(completion: str, reference: str | None = None) -> float:
  """`format_reward(template='gsm8k')`; `reference` is ignored."""
  del reference
  return format_reward(completion, template="gsm8k")


# An `Answer: N` line (the arithmetic task's format, `jaxrl_llm.data.arith`): the whole line is
# "Answer:" and an integer (thousands commas allowed), optionally wrapped in `**` or backticks
# ("**Answer:** 12", "**Answer: 12**", "`Answer: 12`") and ending in a period. `[ \t]` (never
# `\s`) keeps a match on one line, and no two space runs are adjacent, so a scan is linear.
_ANSWER_LINE_RE = re.compile(
  r"^[ \t]*(?:(?:\*\*|`)[ \t]*)?answer[ \t]*(?:\*\*[ \t]*)?:[ \t]*(?:\*\*[ \t]*)?"
  r"(?P<num>-?(?:\d{1,3}(?:,\d{3})+|\d+))(?![\d,])[ \t]*(?:(?:\*\*|`)[ \t]*)?(?:\.[ \t]*)?$",
  re.IGNORECASE | re.MULTILINE,
)


def answer_line_correct(completion: str, reference: str) -> float:
  """1.0 when the last `Answer: N` line of `completion` holds the reference integer, else 0.0.

  `N` is an integer, with or without thousands commas ("Answer: 1,234"), and the line may be
  wrapped in `**` or backticks and end in a period; a line with other text ("Answer: 12
  apples") is no answer line. A completion over `MAX_TEXT_CHARS` scores 0.0 unread.
  """
  if len(completion) > vmath.MAX_TEXT_CHARS:
    return 0.0
  last = None
  for m in _ANSWER_LINE_RE.finditer(completion):
    last = m
  if last is None:
    return 0.0
  pred = last["num"].replace(",", "")
  return float(vmath.is_equivalent(pred, reference_answer(reference)))


def answer_line_format(completion: str, reference: str | None = None) -> float:
  """1.0 when `completion` has exactly one `Answer: N` line (see `answer_line_correct`) and
  it is the last non-empty line, else 0.0; `reference` is ignored."""
  del reference
  if len(completion) > vmath.MAX_TEXT_CHARS:
    return 0.0
  found = list(itertools.islice(_ANSWER_LINE_RE.finditer(completion), 2))
  if len(found) != 1:
    return 0.0
  return float(not completion[found[0].end() :].strip())
