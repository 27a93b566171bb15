"""Prompt templates and chat templates: a dataset question → the prompt text a model reads.

``render_prompt`` turns a question into prompt text with one of ``PROMPT_TEMPLATES``;
``render_prompt_parts`` does the same but keeps apart the control tokens the template writes,
so that special-token strings inside a record's text are encoded as plain text.
``apply_chat_template`` renders a model's Jinja chat template in a sandbox.

Needs the optional package ``jinja2`` for chat templates; it is imported lazily, so this module
can be imported without it.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class ChatTokenizer(Protocol):
  """What the chat templates use of a tokenizer (``tokenizers.HFTokenizer`` is one)."""

  source: str
  chat_template: str | None
  special_tokens: tuple[str, ...]

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs) -> str:
    """``messages`` rendered with the tokenizer's chat template."""

  def find_special_tokens(self, text: str) -> list[str]:
    """The special-token strings in ``text``, in order."""

  def split_at_special_tokens(self, text: str) -> list[str]:
    """``[text, special, text, ...]``: ``text`` split around its special tokens."""

  def replace_special_tokens(self, text: str, fn) -> str:
    """``text`` with each special token ``t`` replaced by ``fn(t)``."""


# ---- chat templates ---------------------------------------------------------------------------


def _raise_exception(message: str):
  from jinja2.exceptions import TemplateError

  raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _tojson(
  value: Any,
  ensure_ascii: bool = False,
  indent: int | None = None,
  separators=None,
  sort_keys: bool = False,
) -> str:
  return json.dumps(
    value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


@functools.lru_cache(maxsize=32)
def _compile_chat_template(template: str):
  """Compiles a chat template in an immutable sandbox with the helpers templates expect."""
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(template)


def apply_chat_template(
  messages: Sequence[Mapping[str, Any]],
  template: str,
  *,
  add_generation_prompt: bool = True,
  bos_token: str = "",
  eos_token: str = "",
  **kwargs,
) -> str:
  """Renders a Jinja chat template over ``messages`` (dicts with ``role`` and ``content``).

  The template runs in ``jinja2``'s immutable sandbox with ``trim_blocks`` and
  ``lstrip_blocks``, the ``loopcontrols`` extension and the ``raise_exception`` and
  ``strftime_now`` helpers. Extra keyword arguments (e.g. ``enable_thinking``, ``tools``)
  become template variables. Template errors are raised as ValueError.
  """
  import jinja2

  for k, m in enumerate(messages):
    if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
      raise ValueError(f"messages[{k}] must be a dict with 'role' and 'content', got {m!r}.")
  try:
    compiled = _compile_chat_template(template)
    return compiled.render(
      messages=[dict(m) for m in messages],
      add_generation_prompt=add_generation_prompt,
      bos_token=bos_token,
      eos_token=eos_token,
      **kwargs,
    )
  except jinja2.TemplateError as e:
    raise ValueError(f"Chat template failed: {type(e).__name__}: {e}") from e


# ---- prompt templates -------------------------------------------------------------------------

QWEN_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# Name → prompt text with a ``{question}`` placeholder. Names in CHAT_PROMPT_TEMPLATES use the
# text as the single user message of the tokenizer's chat template.
PROMPT_TEMPLATES: dict[str, str] = {
  # The question as it is.
  "plain": "{question}",
  # Zero-RL reasoning format in the style of DeepSeek-R1-Zero: think, then answer, in tags.
  "r1": (
    "This is a dialogue between a User and an Assistant. The User poses a problem and the "
    "Assistant solves it. Before replying, the Assistant works the problem through privately, "
    "then states the final result. The Assistant writes that reasoning between <think> and "
    "</think> and the final result between <answer> and </answer>, in the form "
    "<think> ... </think> <answer> ... </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
  ),
  # Qwen-math boxed-answer instruction after the question.
  "qwen_math": "{question}\n" + QWEN_MATH_INSTRUCTION,
  # The tokenizer's chat template around one user message holding the question.
  "chat": "{question}",
  # The chat template around the qwen_math text.
  "qwen_math_chat": "{question}\n" + QWEN_MATH_INSTRUCTION,
}
CHAT_PROMPT_TEMPLATES = frozenset({"chat", "qwen_math_chat"})


def uses_chat_template(template_name: str) -> bool:
  """Whether the named prompt template renders through the tokenizer's chat template.

  Text rendered by a chat template carries its own special tokens, so encode it with
  ``add_special_tokens=False``; the other templates are encoded with ``add_special_tokens=True``.
  """
  _check_template_name(template_name)
  return template_name in CHAT_PROMPT_TEMPLATES


def _check_template_name(name: str):
  if name not in PROMPT_TEMPLATES:
    raise ValueError(
      f"Unknown prompt template {name!r}; valid templates: {sorted(PROMPT_TEMPLATES)}."
    )


def render_prompt(
  question: str,
  template_name: str,
  *,
  tokenizer: ChatTokenizer | None = None,
  system: str | None = None,
) -> str:
  """Prompt text for ``question`` under the named template (see ``PROMPT_TEMPLATES``).

  Chat templates need ``tokenizer`` (for its chat template) and accept a ``system`` message;
  the other templates take neither a tokenizer nor a system message.
  """
  _check_template_name(template_name)
  text = PROMPT_TEMPLATES[template_name].replace("{question}", question)
  if template_name not in CHAT_PROMPT_TEMPLATES:
    if system:
      raise ValueError(
        f"Prompt template {template_name!r} has no system message; use one of "
        f"{sorted(CHAT_PROMPT_TEMPLATES)} for a system prompt."
      )
    return text
  if tokenizer is None:
    raise ValueError(f"Prompt template {template_name!r} needs a tokenizer with a chat template.")
  messages = [{"role": "system", "content": system}] if system else []
  messages.append({"role": "user", "content": text})
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _unused_char(*texts: str) -> str:
  """A private-use character that occurs in none of ``texts``."""
  for code in range(0xE000, 0xF900):
    c = chr(code)
    if not any(c in t for t in texts):
      return c
  raise ValueError("Every private-use character occurs in the prompt text.")


def render_prompt_parts(
  question: str,
  template_name: str,
  *,
  tokenizer: ChatTokenizer | None = None,
  system: str | None = None,
) -> list[str]:
  """``render_prompt`` split around the control tokens the template itself writes.

  Returns ``[text, control, text, ..., control, text]``, whose concatenation is
  ``render_prompt(question, ...)``: odd items are the special tokens a chat template puts
  around the messages, even items text. A special-token string inside ``question`` or
  ``system`` (e.g. ``<|im_end|>``) stays inside a text part, so ``HFTokenizer.encode`` encodes
  it as plain text and a data record cannot open a turn of its own. Templates other than the
  chat ones write no control tokens and give ``[text]``.
  """
  if template_name not in CHAT_PROMPT_TEMPLATES or tokenizer is None:
    return [render_prompt(question, template_name, tokenizer=tokenizer, system=system)]
  contents = [question, system or ""]
  if not any(tokenizer.find_special_tokens(c) for c in contents):
    rendered = render_prompt(question, template_name, tokenizer=tokenizer, system=system)
    return tokenizer.split_at_special_tokens(rendered)
  # Stand-ins for the special-token strings of the contents, so that the rendered text's only
  # special tokens are the template's; the stand-ins are put back in the text parts.
  specials = tokenizer.special_tokens
  mark = _unused_char(*contents, tokenizer.chat_template or "")
  index = {t: k for k, t in enumerate(specials)}

  def hide(s: str) -> str:
    return tokenizer.replace_special_tokens(s, lambda t: f"{mark}{index[t]}{mark}")

  rendered = render_prompt(
    hide(question), template_name, tokenizer=tokenizer, system=hide(system) if system else system
  )
  parts = tokenizer.split_at_special_tokens(rendered)
  stand_in = re.compile(f"{mark}(\\d+){mark}")
  parts[0::2] = [stand_in.sub(lambda m: specials[int(m.group(1))], p) for p in parts[0::2]]
  if any(mark in p for p in parts):
    raise ValueError(
      f"The chat template of {tokenizer.source} altered the message text in a way that hides "
      "where its special-token strings are; set data.special_tokens_in_text=True to encode "
      "them as control tokens."
    )
  return parts
