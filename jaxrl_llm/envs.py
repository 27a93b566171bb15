"""In-graph tool environments of multi-turn rollouts: pure functions over token arrays.

A policy calls a tool by writing its call and ending it with `CALL_CLOSE` (``5*3+8=``); the
sampler (`sampling.sample`) then appends the environment's answer (``23,``: a value, or
`ERROR` for a call it cannot evaluate, ended by `ANSWER_END`) one token per decode step, its
keys and values written to the KV cache like the policy's own, and the policy goes on. The
answer's tokens are the environment's: never learned from (`Rollout.env_mask`), their
log-probs never recorded. Registered by name like the objectives (`ENVIRONMENTS`, the
`sampling.tool` setting):

  calculator  `+ - *` over whole numbers, left to right (a calculator chain: ``2+3*4`` is 20)
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
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.data.tasks.tokenizer import CharTokenizer

CALL_CLOSE = "="  # ends a tool call: the environment answers after it
ANSWER_END = ","  # ends the environment's answer
ERROR = ":"  # the answer to a call the environment cannot evaluate
OPS = "+-*"


@dataclasses.dataclass(frozen=True)
class ToolEnv:
  """An in-graph tool: `respond` reads each row's call and gives its answer tokens."""

  name: ClassVar[str] = "tool"
  tokenizer: CharTokenizer = dataclasses.field(default_factory=CharTokenizer)
  max_digits: int = 6  # values of more digits are errors

  @property
  def answer_len(self) -> int:
    """E: the most tokens an answer takes (sign, digits, `ANSWER_END`)."""
    return self.max_digits + 2

  @property
  def close_id(self) -> int:
    """The token that ends a call."""
    return self.tokenizer.char_id(CALL_CLOSE)

  def _parse(self, prompt_tokens, tokens, start, end):
    """(value [B] int32, error [B] bool) of each row's call tokens[start:end), left to right."""
    tok = self.tokenizer
    digit_of = jnp.full((tok.vocab_size,), -1, jnp.int32)
    digit_of = digit_of.at[jnp.asarray(tok.ids_of("0123456789"))].set(jnp.arange(10))
    op_of = (
      jnp.zeros((tok.vocab_size,), jnp.int32)
      .at[jnp.asarray(tok.ids_of(OPS))]
      .set(jnp.arange(1, len(OPS) + 1))
    )
    b, t = tokens.shape
    inside = (jnp.arange(t)[None, :] >= start[:, None]) & (jnp.arange(t)[None, :] < end[:, None])
    limit = 10**self.max_digits

    def step(carry, x):
      value, number, op, has_number, error, count = carry
      tok_t, inside_t = x
      d, o = digit_of[tok_t], op_of[tok_t]
      is_digit, is_op = inside_t & (d >= 0), inside_t & (o > 0)
      number = jnp.where(is_digit, number * 10 + jnp.maximum(d, 0), number)
      count = count + is_digit.astype(jnp.int32)
      error |= inside_t & ~(d >= 0) & ~(o > 0)  # a character no call holds
      error |= is_op & ~has_number  # an operator without a number before it
      error |= is_digit & (number >= limit)
      applied = _apply(value, number, op)
      value = jnp.where(is_op, applied, value)
      op = jnp.where(is_op, o, op)
      number = jnp.where(is_op, 0, number)
      has_number = jnp.where(is_op, False, has_number | is_digit)
      return (value, number, op, has_number, error, count), is_digit

    zeros = jnp.zeros((b,), jnp.int32)
    carry = (zeros, zeros, zeros, jnp.zeros((b,), bool), jnp.zeros((b,), bool), zeros)
    (value, number, op, has_number, error, _), is_digit = jax.lax.scan(
      step, carry, (tokens.T, inside.T)
    )
    value = _apply(value, number, op)
    error |= ~has_number | (jnp.abs(value) >= limit)
    return value, error, is_digit.T

  def check(self, prompt_tokens, tokens, start, end, is_digit):
    """Extra errors [B] bool of a call (none by default)."""
    del prompt_tokens, tokens, start, end
    return jnp.zeros(is_digit.shape[:1], bool)

  def respond(self, prompt_tokens, tokens, start, end, calling=None):
    """Each row's answer to its call tokens[start:end) (`end` is the close token's slot):
    (answer [B, E] int32, its length [B] int32, error [B] bool). Pure: jit- and vmap-safe.
    `calling` [B] marks the rows that call now (the others' answers are not used)."""
    del calling  # an in-graph tool answers every row at once
    value, error, is_digit = self._parse(prompt_tokens, tokens, start, end)
    error |= self.check(prompt_tokens, tokens, start, end, is_digit)
    return (*self.encode(value, error), error)

  def encode(self, value, error):
    """`value` [B] as tokens `-123,` ([B, E], length [B]); `ERROR,` where `error`."""
    tok, e = self.tokenizer, self.answer_len
    digits = jnp.asarray(tok.ids_of("0123456789"))
    magnitude = jnp.abs(value)
    places = 10 ** jnp.arange(self.max_digits - 1, -1, -1)  # most significant first
    shown = (magnitude[:, None] // places[None, :]) % 10  # [B, max_digits]
    n_digits = jnp.maximum(jnp.sum(magnitude[:, None] >= places[None, :], axis=1), 1)
    sign = (value < 0).astype(jnp.int32)
    i = jnp.arange(e)[None, :]
    k = i - sign[:, None]  # index among the digits
    lead = self.max_digits - n_digits[:, None]  # leading zeros skipped
    digit_tok = digits[jnp.take_along_axis(shown, jnp.clip(k + lead, 0, self.max_digits - 1), 1)]
    out = jnp.where(k < n_digits[:, None], digit_tok, tok.char_id(ANSWER_END))
    out = jnp.where((sign[:, None] == 1) & (i == 0), tok.char_id("-"), out)
    length = sign + n_digits + 1
    out = jnp.where(
      error[:, None], jnp.where(i == 0, tok.char_id(ERROR), tok.char_id(ANSWER_END)), out
    )
    length = jnp.where(error, 2, length)
    out = jnp.where(i < length[:, None], out, tok.pad_id)
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
class CountdownCheck(ToolEnv):
  """The countdown task's check: single digits 1-9, each at most as often as the prompt's
  `numbers` digits give it, left to right; anything else is an error."""

  name: ClassVar[str] = "countdown"
  numbers: int = dataclasses.field(kw_only=True)  # the task's `task.numbers`

  def check(self, prompt_tokens, tokens, start, end, is_digit):
    """A multi-digit number, a 0, or a digit used more often than the prompt gives it."""
    tok, n = self.tokenizer, self.numbers
    digit_of = jnp.full((tok.vocab_size,), -1, jnp.int32)
    digit_of = digit_of.at[jnp.asarray(tok.ids_of("0123456789"))].set(jnp.arange(10))
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
    tok = self.tokenizer
    calls = [tok.decode(np.asarray(tokens)[i, start[i] : end[i]], stop_at_eos=False) for i in rows]
    prompts = [tok.decode(np.asarray(prompt_tokens)[i]) for i in rows]
    scores, _ = score_batch(
      calls, prompts, terms={"tool": self.fn}, timeout_s=self.timeout_s, fill=float("nan")
    )
    got = scores["tool"].astype(np.float64)
    ok = np.isfinite(got) & (np.abs(got) < 10**self.max_digits) & (got == np.round(got))
    value[rows] = np.where(ok, got, 0).astype(np.int32)
    error[rows] = ~ok
    return value, error


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


ENVIRONMENTS: dict[str, type[ToolEnv]] = {"calculator": Calculator, "countdown": CountdownCheck}
HOST = "host:"  # `sampling.tool=host:module:function`: that callable as a `HostTool`
TOOLS = ("none", *ENVIRONMENTS, f"{HOST}<module>:<function>")  # `sampling.tool` values


def is_tool(name: str) -> bool:
  """Whether `name` is a `sampling.tool` value (a host tool's callable is checked when built)."""
  return name in TOOLS[:-1] or (name.startswith(HOST) and name.count(":") == 2)


def get_env(name: str, task, timeout_s: float | None = None) -> ToolEnv | None:
  """The environment `name` for `task` (None for "none"): a registered one, or a host tool
  `host:module:function` whose calls each get `timeout_s`; a ValueError naming the allowed
  values otherwise."""
  if name == "none":
    return None
  if name.startswith(HOST):
    module, _, function = name.removeprefix(HOST).partition(":")
    try:
      fn = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"sampling.tool={name!r}: cannot import {module}.{function} ({e})") from None
    return HostTool(tokenizer=task.tokenizer, fn=fn, timeout_s=timeout_s)
  if name not in ENVIRONMENTS:
    raise ValueError(f"sampling.tool={name!r}: allowed {' | '.join(TOOLS)}")
  kwargs = {"numbers": task.numbers} if name == "countdown" else {}
  return ENVIRONMENTS[name](tokenizer=task.tokenizer, **kwargs)
