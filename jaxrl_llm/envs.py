"""In-graph tool environments of multi-turn rollouts: pure functions over token arrays.

A policy calls a tool by writing its call and closing it; the sampler (`sampling.sample`) then
appends the environment's answer (a value, or an error for a call it cannot evaluate) one
token per decode step, its keys and values written to the KV cache like the policy's own, and
the policy goes on. The answer's tokens are the environment's: never learned from
(`Rollout.env_mask`), their log-probs never recorded. How calls and answers are written
depends on the tokenizer, and for `arithmetic_inline` on the tool (`tool_formats`).

Registered by name like the objectives (`ENVIRONMENTS`, the `sampling.tool` setting):

  calculator  `+ - *` over whole numbers, left to right (a calculator chain: ``2+3*4`` is 20)
  arithmetic  `+ - *` over whole numbers with the usual precedence (``2+3*4`` is 14)
  arithmetic_inline  the same, called inline (the `inline` format; the task alphabet's calls
              are inline already: `plain`)
  countdown   the countdown task's own check of an expression: single digits, each used at
              most as often as the prompt gives it, left to right; anything else is an error
  host:M:F    the Python callable M.F(call, prompt) -> number, on the host (`HostTool`), e.g.
              `host:jaxrl_llm.envs:arithmetic`
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.data.tasks.tokenizer import CharTokenizer
from jaxrl_llm.tool_formats import ToolTokens, tool_tokens


def _table(size: int, pairs, fill: int = 0) -> jax.Array:
  """A [size] int32 lookup table with `pairs` (id, value) set."""
  out = np.full((size,), fill, np.int32)
  for i, v in pairs:
    out[i] = v
  return jnp.asarray(out)


@dataclasses.dataclass(frozen=True)
class ToolEnv:
  """An in-graph tool: `respond` reads each row's call and gives its answer tokens."""

  name: ClassVar[str] = "tool"
  precedence: ClassVar[bool] = False  # `*` before `+ -` (else left to right)
  inline: ClassVar[bool] = False  # called in the policy's prose (`FORMATS["inline"]`)
  tokenizer: Any = dataclasses.field(default_factory=CharTokenizer)
  max_digits: int = 6  # values of more digits are errors

  @property
  def tokens(self) -> ToolTokens:
    """The tokenizer's call and answer tokens."""
    return tool_tokens(self.tokenizer, self.inline)

  @property
  def answer_len(self) -> int:
    """E: the most tokens an answer takes (prefix, sign and digits or the error, suffix)."""
    t = self.tokens
    return len(t.prefix) + max(self.max_digits + 1, len(t.error)) + len(t.suffix)

  @property
  def close_len(self) -> int:
    """How many tokens close a call."""
    return len(self.tokens.close)

  def closes(self, tokens, step, seg_start):
    """[B] bool: the policy's tokens up to slot `step` (a scalar) end with the close sequence,
    inside the current segment."""
    close = self.tokens.close
    k = len(close)
    window = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(step - k + 1, 0), k, axis=1)
    match = jnp.all(window == jnp.asarray(close, jnp.int32)[None, :], axis=1)
    return match & (step - k + 1 >= seg_start)

  def _parse(self, prompt_tokens, tokens, start, end):
    """(value [B] int32, error [B] bool, is_digit [B, T]) of each row's call in
    tokens[start:end)."""
    t_ = self.tokens
    v = t_.vocab_size  # ids past it (a model's padded vocabulary) read as its last: no call
    value_of = _table(v, [(i, x) for i, x, _ in t_.numbers], -1)
    places_of = _table(v, [(i, 10**n) for i, _, n in t_.numbers], 1)
    op_of = _table(v, t_.ops)
    blank_of = _table(v, [(i, 1) for i in t_.blanks]) > 0
    b, t = tokens.shape
    pos = jnp.arange(t)[None, :]
    if t_.format.trailing:  # the call: the number, operator and blank run before the close
      callish = (value_of[tokens] >= 0) | (op_of[tokens] > 0) | blank_of[tokens]
      other = (pos >= start[:, None]) & (pos < end[:, None]) & ~callish
      start = jnp.maximum(start, jnp.max(jnp.where(other, pos + 1, 0), axis=1))
    inside = (pos >= start[:, None]) & (pos < end[:, None])
    limit = 10**self.max_digits
    zeros = jnp.zeros((b,), jnp.int32)

    def step(carry, x):
      acc, number, op, has_number, error = carry
      tok_t, inside_t = x
      d, o = value_of[tok_t], op_of[tok_t]
      is_digit, is_op = inside_t & (d >= 0), inside_t & (o > 0)
      error |= inside_t & ~(d >= 0) & ~(o > 0) & ~blank_of[tok_t]  # what no call holds
      error |= is_op & ~has_number  # an operator without a number before it
      number = jnp.where(is_digit, number * places_of[tok_t] + jnp.maximum(d, 0), number)
      error |= is_digit & (number >= limit)
      number = jnp.where(number >= limit, 0, number)  # no overflow past the error
      acc = jax.tree.map(
        lambda new, old: jnp.where(is_op, new, old), self._fold(acc, number, op, o), acc
      )
      op = jnp.where(is_op, o, op)
      number = jnp.where(is_op, 0, number)
      has_number = jnp.where(is_op, False, has_number | is_digit)
      return (acc, number, op, has_number, error), is_digit

    carry = ((zeros, zeros, jnp.ones((b,), jnp.int32)), zeros, zeros, zeros > 0, zeros > 0)
    (acc, number, op, has_number, error), is_digit = jax.lax.scan(step, carry, (tokens.T, inside.T))
    value = self._value(acc, number, op)
    error |= ~has_number | (jnp.abs(value) >= limit)
    return value, error, is_digit.T

  def _fold(self, acc, number, op, new_op):
    """The accumulator (total, term, sign) after `number` and the operator `new_op`, with `op`
    the operator before `number` (0 at the start)."""
    total, term, sign = acc
    if not self.precedence:  # a chain: the total so far, `op` applied
      return _apply(total, number, op), term, sign
    term = jnp.where(op == 3, term * number, number)  # `*` binds first
    additive = new_op != 3
    total = jnp.where(additive, total + sign * term, total)
    sign = jnp.where(additive, jnp.where(new_op == 2, -1, 1), sign)
    return total, jnp.where(additive, 0, term), sign

  def _value(self, acc, number, op):
    """The call's value at its end (`number` the last, after `op`)."""
    total, term, sign = acc
    if not self.precedence:
      return _apply(total, number, op)
    return total + sign * jnp.where(op == 3, term * number, number)

  def check(self, prompt_tokens, tokens, start, end, is_digit):
    """Extra errors [B] bool of a call (none by default)."""
    del prompt_tokens, tokens, start, end
    return jnp.zeros(is_digit.shape[:1], bool)

  def respond(self, prompt_tokens, tokens, start, end, calling=None):
    """Each row's answer to its call in tokens[start:end) (`end` is the close's first slot):
    (answer [B, E] int32, its length [B] int32, error [B] bool). Pure: jit- and vmap-safe.
    `calling` [B] marks the rows that call now (the others' answers are not used)."""
    del calling  # an in-graph tool answers every row at once
    value, error, is_digit = self._parse(prompt_tokens, tokens, start, end)
    error |= self.check(prompt_tokens, tokens, start, end, is_digit)
    return (*self.encode(value, error), error)

  def encode(self, value, error):
    """The answers [B, E] (and their lengths [B]): prefix, `value` [B] as `-123` or the error
    where `error`, suffix (`-123,` and `:,` with the task alphabet)."""
    t_, e, m = self.tokens, self.answer_len, self.max_digits
    digits = jnp.asarray(t_.digits, jnp.int32)
    magnitude = jnp.abs(value)
    places = 10 ** jnp.arange(m - 1, -1, -1)  # most significant first
    shown = (magnitude[:, None] // places[None, :]) % 10  # [B, max_digits]
    n_digits = jnp.maximum(jnp.sum(magnitude[:, None] >= places[None, :], axis=1), 1)
    sign = (value < 0).astype(jnp.int32)
    p = len(t_.prefix)
    i = jnp.arange(e)[None, :]
    k = i - p - sign[:, None]  # index among the digits
    lead = m - n_digits[:, None]  # leading zeros skipped
    body = digits[jnp.take_along_axis(shown, jnp.clip(k + lead, 0, m - 1), 1)]
    body = jnp.where((sign[:, None] == 1) & (i == p), t_.minus, body)
    body_n = sign + n_digits
    error_ids = jnp.asarray(t_.error, jnp.int32)
    body = jnp.where(error[:, None], error_ids[jnp.clip(i - p, 0, len(t_.error) - 1)], body)
    body_n = jnp.where(error, len(t_.error), body_n)
    out = body
    if t_.suffix:
      suffix = jnp.asarray(t_.suffix, jnp.int32)
      after = i - p - body_n[:, None]  # index in the suffix
      out = jnp.where(after >= 0, suffix[jnp.clip(after, 0, len(t_.suffix) - 1)], body)
    if p:
      out = jnp.where(i < p, jnp.asarray(t_.prefix, jnp.int32)[jnp.clip(i, 0, p - 1)], out)
    length = p + body_n + len(t_.suffix)
    out = jnp.where(i < length[:, None], out, t_.pad)
    return out.astype(jnp.int32), length.astype(jnp.int32)


def _apply(value, number, op):
  """`value op number` (op 0: no value yet, the number itself; 1 +, 2 -, 3 *)."""
  return jnp.select(
    [op == 1, op == 2, op == 3], [value + number, value - number, value * number], number
  )


@dataclasses.dataclass(frozen=True)
class Calculator(ToolEnv):
  """`+ - *` over whole numbers, left to right."""

  name: ClassVar[str] = "calculator"


@dataclasses.dataclass(frozen=True)
class Arithmetic(ToolEnv):
  """`+ - *` over whole numbers with the usual precedence (`2+3*4` is 14)."""

  name: ClassVar[str] = "arithmetic"
  precedence: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class InlineArithmetic(Arithmetic):
  """`Arithmetic` called inline: the number, operator and blank run before `` =`` in the
  policy's own text is the call, its value is written after it, and the policy goes on."""

  name: ClassVar[str] = "arithmetic_inline"
  inline: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class CountdownCheck(ToolEnv):
  """The countdown task's check: single digits 1-9, each at most as often as the prompt's
  `numbers` digits give it, left to right; anything else is an error."""

  name: ClassVar[str] = "countdown"
  numbers: int = dataclasses.field(kw_only=True)  # the task's `task.numbers`

  def check(self, prompt_tokens, tokens, start, end, is_digit):
    """A multi-digit number, a 0, or a digit used more often than the prompt gives it."""
    t_, n = self.tokens, self.numbers
    digit_of = _table(t_.vocab_size, zip(t_.digits, range(10)), -1)  # the digits "0".."9"
    given = digit_of[prompt_tokens[:, -(n + 3) : -3]]  # [B, n]
    have = jax.nn.one_hot(given, 10, dtype=jnp.int32).sum(1)  # [B, 10]
    used = jax.nn.one_hot(jnp.where(is_digit, digit_of[tokens], -1), 10, dtype=jnp.int32).sum(1)
    adjacent = is_digit[:, 1:] & is_digit[:, :-1]  # two digits in a row: a number over 9
    return jnp.any(used > have, -1) | (used[:, 0] > 0) | jnp.any(adjacent, -1)


@dataclasses.dataclass(frozen=True)
class HostTool(ToolEnv):
  """A Python callable as the tool, for what JAX cannot express: `fn(call, prompt) -> number`
  on the call's and the prompt's text, run on the host for the rows that call at a decode step
  (one batch per step, `jax.pure_callback`; the segments between calls stay in the program).
  Calls run as the host verifiers do (`verifiers.scoring.score_batch`: worker processes, a
  call past `timeout_s` killed): one that raises, hangs, or returns no whole number below
  10**max_digits is answered with the error token and counted, and the run goes on."""

  name: ClassVar[str] = "host"
  fn: Callable[[str, str], float] | None = None
  timeout_s: float | None = None  # seconds a call may run (None: no limit)

  def respond(self, prompt_tokens, tokens, start, end, calling=None):
    """The host's answers to the calling rows' calls (every row when `calling` is None)."""
    b = tokens.shape[0]
    calling = jnp.ones((b,), bool) if calling is None else calling
    shapes = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.bool_))
    value, error = jax.pure_callback(
      self._host, shapes, prompt_tokens, tokens, start, end, calling, vmap_method="sequential"
    )
    return (*self.encode(value, error), error)

  def _host(self, prompt_tokens, tokens, start, end, calling):
    """numpy: (value [B] int32, error [B] bool) of the calling rows' calls."""
    from jaxrl_llm.data.verifiers.scoring import score_batch

    value, error = np.zeros(tokens.shape[0], np.int32), np.zeros(tokens.shape[0], bool)
    rows = np.nonzero(np.asarray(calling))[0]
    if rows.size == 0:
      return value, error
    tok, opening = self.tokenizer, self.tokens.format.opening
    calls = [tok.decode(np.asarray(tokens)[i, start[i] : end[i]], stop_at_eos=False) for i in rows]
    calls = [c.rpartition(opening)[2].strip() for c in calls] if opening else calls
    prompts = [tok.decode(np.asarray(prompt_tokens)[i]) for i in rows]
    name = f"{getattr(self.fn, '__module__', '')}.{getattr(self.fn, '__qualname__', 'tool')}"
    scores, stats = score_batch(
      calls, prompts, terms={name: self.fn}, timeout_s=self.timeout_s, fill=float("nan"),
      warn=name not in _WARNED, label="host tool",
    )  # fmt: skip
    if stats["verifier/errors"]:  # its first failure is said once a run; the rest are counted
      _WARNED.add(name)
    got = scores[name].astype(np.float64)
    ok = np.isfinite(got) & (np.abs(got) < 10**self.max_digits) & (got == np.round(got))
    value[rows] = np.where(ok, got, 0).astype(np.int32)
    error[rows] = ~ok
    return value, error


_WARNED: set[str] = set()  # host tools whose first failure this process has logged


def arithmetic(call: str, prompt: str) -> int:
  """An example host tool: `call` as arithmetic with `+ - *` and the usual precedence
  (`2+3*4` is 14, where the in-graph calculator chains left to right), through Python's `ast`
  alone (no `eval`): any other syntax raises."""
  del prompt
  if len(call) > 64:
    raise ValueError("call too long")
  ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

  def value(node) -> int:
    if isinstance(node, ast.BinOp) and type(node.op) in ops:
      return ops[type(node.op)](value(node.left), value(node.right))
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    raise ValueError(f"not arithmetic: {ast.dump(node)}")

  return value(ast.parse(call, mode="eval").body)


ENVIRONMENTS: dict[str, type[ToolEnv]] = {
  "calculator": Calculator,
  "arithmetic": Arithmetic,
  "arithmetic_inline": InlineArithmetic,
  "countdown": CountdownCheck,
}
HOST = "host:"  # `sampling.tool=host:module:function`: that callable as a `HostTool`
TOOLS = ("none", *ENVIRONMENTS, f"{HOST}<module>:<function>")  # `sampling.tool` values


def is_tool(name: str) -> bool:
  """Whether `name` is a `sampling.tool` value (a host tool's callable is checked when built)."""
  return name in TOOLS[:-1] or (name.startswith(HOST) and name.count(":") == 2)


def host_callable(name: str):
  """The callable M.F of host tool `name` (`host:M:F`), or why it cannot be had: a line naming
  `sampling.tool` and what is allowed (any exception importing M is the user's module's)."""
  module, _, function = name.removeprefix(HOST).partition(":")
  try:
    fn = getattr(importlib.import_module(module), function)
  except Exception as e:  # ImportError, AttributeError, or the module's own failure
    return (
      f"sampling.tool={name!r}: cannot import {module}.{function} ({type(e).__name__}: {e}); "
      f"allowed: {HOST}<module>:<function> naming an importable callable"
    )
  if not callable(fn):
    return (
      f"sampling.tool={name!r}: {module}.{function} is a {type(fn).__name__}, not a callable; "
      f"allowed: {HOST}<module>:<function> naming a function(call, prompt) -> number"
    )
  return fn


def get_env(name: str, task, timeout_s: float | None = None) -> ToolEnv | None:
  """The environment `name` for `task` (None for "none"): a registered one, or a host tool
  `host:module:function` whose calls each get `timeout_s`; a ValueError naming the allowed
  values otherwise."""
  if name == "none":
    return None
  if name.startswith(HOST):
    fn = host_callable(name)
    if isinstance(fn, str):
      from jaxrl_llm.config.fields import ConfigError

      raise ConfigError(f"invalid config: {fn}")
    return HostTool(tokenizer=task.tokenizer, fn=fn, timeout_s=timeout_s)
  if name not in ENVIRONMENTS:
    raise ValueError(f"sampling.tool={name!r}: allowed {' | '.join(TOOLS)}")
  kwargs = {"numbers": task.numbers} if name == "countdown" else {}
  return ENVIRONMENTS[name](tokenizer=task.tokenizer, **kwargs)
