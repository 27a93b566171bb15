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
  host:M:F    the Python callable M.F(call, prompt) -> number, on the host
              (`host_tool.HostTool`), e.g. `host:jaxrl_llm.envs:arithmetic`
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import operator
import pickle
import string
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.data.tasks.tokenizer import CharTokenizer
from jaxrl_llm.tool_formats import ToolTokens, token_texts, tool_tokens


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
    tokens[start:end). Every value the call reaches (a number read, a product, a sum) stays
    below 10**max_digits in magnitude or the call is an error: int32 never wraps."""
    if not 0 < self.max_digits <= 9:  # twice the limit must fit in int32
      raise ValueError(f"max_digits={self.max_digits}: allowed 1 to 9")
    t_ = self.tokens
    v = t_.vocab_size  # ids past it (a model's padded vocabulary) read as its last: no call
    tables = _call_tables(self.tokenizer, self.inline)
    lookup = {
      "value": _table(v, [(i, x) for i, x, _ in t_.numbers], -1),
      "places": _table(v, [(i, 10**n) for i, _, n in t_.numbers], 1),
      "op": _table(v, t_.ops),
      "blank": _table(v, [(i, 1) for i in t_.blanks]) > 0,
      "lead": jnp.asarray(tables["lead"]),
      "trail": jnp.asarray(tables["trail"]),
    }
    error = jnp.zeros(tokens.shape[:1], bool)
    if t_.format.trailing:  # the call: the number, operator and blank run before the close
      start, error = self._trailing_call(tokens, start, end, lookup, tables)
    pos = jnp.arange(tokens.shape[1])[None, :]
    inside = (pos >= start[:, None]) & (pos < end[:, None])
    step = functools.partial(self._step, lookup, 10**self.max_digits)
    zeros = jnp.zeros_like(start)
    carry = ((zeros, zeros, zeros + 1), zeros, zeros, error & False, error & False, error)
    (acc, number, op, has_number, _, error), is_digit = jax.lax.scan(
      step, carry, (tokens.T, inside.T)
    )
    value, over = self._value(acc, number, op, 10**self.max_digits)
    error |= ~has_number | over | (jnp.abs(value) >= 10**self.max_digits)
    return jnp.where(error, 0, value), error, is_digit.T

  def _trailing_call(self, tokens, start, end, lookup, tables):
    """(start [B], error [B]) of each row's trailing call: the run of number, operator and
    blank tokens before the close. With an opening tag it must follow the segment's last tag
    (or fill the segment); inline, a run cut from a larger expression (`3.5 * 2`, `(2+3)*4`:
    the token before it ends in `.` or `)`, no blank between) is an error."""
    v = self.tokens.vocab_size
    tok = jnp.clip(tokens, 0, v - 1)
    callish = (lookup["value"][tok] >= 0) | (lookup["op"][tok] > 0) | lookup["blank"][tok]
    pos = jnp.arange(tokens.shape[1])[None, :]
    other = (pos >= start[:, None]) & (pos < end[:, None]) & ~callish
    run = jnp.maximum(start, jnp.max(jnp.where(other, pos + 1, 0), axis=1))

    def at(p):  # [B] the token at slot p [B] of each row
      return jnp.take_along_axis(tok, jnp.clip(p, 0, tokens.shape[1] - 1)[:, None], 1)[:, 0]

    if "opening" not in tables:  # inline: the token before the run must not cut it
      cut = jnp.asarray(tables["cut"])[at(run - 1)] & ~lookup["lead"][at(run)]
      return run, (run > start) & cut
    walk = jnp.asarray(tables["opening"])  # [n + 1, V]: text left of the tag to match
    n = walk.shape[0] - 1

    def back(k, state):  # one token further left, while the tag is part matched
      p = run - 1 - k
      new = jnp.where(p >= start, walk[jnp.clip(state, 0, n), at(p)], -1)
      return jnp.where(state > 0, new, state)

    state = jax.lax.fori_loop(0, n, back, jnp.full_like(run, n))
    return run, (run > start) & (state != 0)

  def _step(self, lookup, limit, carry, x):
    """One token of the call scan: reads numbers and folds operators; errors are sticky."""
    acc, number, op, has_number, gap, error = carry
    tok_t, inside_t = x
    tok_t = jnp.clip(tok_t, 0, lookup["value"].shape[0] - 1)
    d, o, places = lookup["value"][tok_t], lookup["op"][tok_t], lookup["places"][tok_t]
    is_digit, is_op = inside_t & (d >= 0), inside_t & (o > 0)
    blank = inside_t & lookup["blank"][tok_t]
    error |= inside_t & ~(d >= 0) & ~(o > 0) & ~blank  # what no call holds
    error |= is_op & ~has_number  # an operator without a number before it
    error |= is_digit & has_number & (gap | lookup["lead"][tok_t])  # `12 35`: no operator
    d = jnp.maximum(d, 0)
    over = number > (limit - 1 - d) // places  # number * places + d would reach the limit
    number = jnp.where(is_digit, jnp.where(over, 0, number) * places + d, number)
    number = jnp.where(is_digit & over, 0, number)  # no overflow past the error
    error |= is_digit & over
    gap = jnp.where(is_digit, lookup["trail"][tok_t], gap | blank)
    folded, over = self._fold(acc, number, op, o, limit)
    acc = jax.tree.map(lambda new, old: jnp.where(is_op, new, old), folded, acc)
    error |= is_op & over
    op = jnp.where(is_op, o, op)
    number = jnp.where(is_op, 0, number)
    has_number = jnp.where(is_op, False, has_number | is_digit)
    return (acc, number, op, has_number, gap, error), is_digit

  def _fold(self, acc, number, op, new_op, limit):
    """(The accumulator (total, term, sign) after `number` and the operator `new_op`, with `op`
    the operator before `number` (0 at the start); whether a value reached `limit`)."""
    total, term, sign = acc
    if not self.precedence:  # a chain: the total so far, `op` applied
      total, over = _apply(total, number, op, limit)
      return (total, term, sign), over
    product, over = _mul(term, number, limit)
    over &= op == 3
    term = jnp.where(op == 3, product, number)  # `*` binds first
    additive = new_op != 3
    summed, over_sum = _add(total, sign * term, limit)
    total = jnp.where(additive, summed, total)
    sign = jnp.where(additive, jnp.where(new_op == 2, -1, 1), sign)
    return (total, jnp.where(additive, 0, term), sign), over | (additive & over_sum)

  def _value(self, acc, number, op, limit):
    """(The call's value at its end (`number` the last, after `op`); whether a value reached
    `limit`)."""
    total, term, sign = acc
    if not self.precedence:
      return _apply(total, number, op, limit)
    product, over = _mul(term, number, limit)
    value, over_sum = _add(total, sign * jnp.where(op == 3, product, number), limit)
    return value, ((op == 3) & over) | over_sum

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


def _apply(value, number, op, limit):
  """(`value op number` (op 0: no value yet, the number itself; 1 +, 2 -, 3 *); whether it
  reached `limit`)."""
  (plus, over_plus), (minus, over_minus) = _add(value, number, limit), _add(value, -number, limit)
  times, over_times = _mul(value, number, limit)
  ops = [op == 1, op == 2, op == 3]
  return jnp.select(ops, [plus, minus, times], number), jnp.select(
    ops, [over_plus, over_minus, over_times], False
  )


def _add(a, b, limit):
  """(a + b, or 0 where its magnitude reaches `limit`; where it does) for |a|, |b| < limit."""
  total = a + b  # below 2 * limit <= 2 * 10**9: no int32 wrap
  over = jnp.abs(total) >= limit
  return jnp.where(over, 0, total), over


def _mul(a, b, limit):
  """(a * b, or 0 where its magnitude would reach `limit`; where it would), checked before
  multiplying so int32 never wraps (|a|, |b| < limit)."""
  over = jnp.abs(a) > (limit - 1) // jnp.maximum(jnp.abs(b), 1)
  return jnp.where(over, 0, a) * b, over


# What ends the token before an inline call cut from a larger expression (`3.5`, `(2+3)*4`).
_CUT = frozenset(".,/)]}^*+-×%!_" + string.ascii_letters + string.digits)


@functools.cache
def _call_tables(tokenizer, inline: bool = False) -> dict[str, np.ndarray]:
  """numpy tables over `tokenizer`'s ids that read a trailing call (built once per tokenizer):
  `lead`/`trail` [V] the token's text starts/ends with whitespace; `cut` [V] it ends in a
  character that joins it to a number after it (`.` of `3.5`, `)` of `(2+3)*4`); `opening`
  [n + 1, V] the backward walk over the opening tag (n characters): from `r` characters of the
  tag left to match, a token leaves `r - len(text)` (0: matched) or -1 (no tag)."""
  t_ = tool_tokens(tokenizer, inline)
  v, fmt = t_.vocab_size, t_.format
  out = {"lead": np.zeros(v, bool), "trail": np.zeros(v, bool)}
  if not fmt.trailing:
    return out
  texts = token_texts(tokenizer)  # as each id reads after other text
  out["lead"] = np.asarray([s[:1].isspace() for s in texts])
  out["trail"] = np.asarray([s[-1:].isspace() for s in texts])
  if not fmt.opening:
    out["cut"] = np.asarray([s[-1:] in _CUT for s in texts]) & ~out["trail"]
    return out
  tag, n = fmt.opening, len(fmt.opening)
  walk = np.full((n + 1, v), -1, np.int32)
  walk[0] = 0
  for r in range(1, n + 1):
    for i, s in enumerate(texts):
      s = s.rstrip() if r == n else s  # blanks may follow the tag
      if s.endswith(tag[:r]):
        walk[r, i] = 0
      elif s and tag[:r].endswith(s):
        walk[r, i] = r - len(s)
  out["opening"] = walk
  return out


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


def _not_a_tool_function(fn) -> str:
  """Why `fn` can never answer `fn(call, prompt)` with a number ("" when it may): a signature
  that does not take two arguments, or a generator or coroutine function."""
  if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
    return "is a generator function (its calls give a generator, not a number)"
  if inspect.iscoroutinefunction(fn):
    return "is a coroutine function (its calls give a coroutine, not a number)"
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # no signature to read (some builtins): its calls will tell
    return ""
  try:
    signature.bind("call", "prompt")
  except TypeError as e:
    return f"takes {signature}, not (call, prompt) ({e})"
  return ""


def host_callable(name: str):
  """The callable M.F of host tool `name` (`host:M:F`), or why it cannot be had: a line naming
  `sampling.tool` and what is allowed (any exception importing M is the user's module's)."""
  module, _, function = name.removeprefix(HOST).partition(":")
  try:
    fn = getattr(importlib.import_module(module), function)
  except (Exception, SystemExit, KeyboardInterrupt) as e:  # the module's own, ImportError, ...
    return (
      f"sampling.tool={name!r}: cannot import {module}.{function} ({type(e).__name__}: {e}); "
      f"allowed: {HOST}<module>:<function> naming an importable callable"
    )
  if not callable(fn):
    return (
      f"sampling.tool={name!r}: {module}.{function} is a {type(fn).__name__}, not a callable; "
      f"allowed: {HOST}<module>:<function> naming a function(call, prompt) -> number"
    )
  cannot = _not_a_tool_function(fn)
  if cannot:
    return (
      f"sampling.tool={name!r}: {module}.{function} {cannot}; allowed: {HOST}<module>:<function> "
      "naming a function(call, prompt) -> number"
    )
  try:  # a host tool runs in worker processes (`score_batch`): it must pickle, by reference
    pickle.dumps(fn)
  except Exception as e:
    why = " ".join(f"{type(e).__name__}: {e}".split())
    return (
      f"sampling.tool={name!r}: {module}.{function} cannot be pickled ({why}); allowed: "
      f"{HOST}<module>:<function> naming a module-level function(call, prompt) -> number, "
      "picklable, since a host tool runs in worker processes"
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
    from jaxrl_llm.host_tool import HostTool  # its module imports this one

    return HostTool(tokenizer=task.tokenizer, fn=fn, timeout_s=timeout_s)
  if name not in ENVIRONMENTS:
    raise ValueError(f"sampling.tool={name!r}: allowed {' | '.join(TOOLS)}")
  kwargs = {"numbers": task.numbers} if name == "countdown" else {}
  return ENVIRONMENTS[name](tokenizer=task.tokenizer, **kwargs)
