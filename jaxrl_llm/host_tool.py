"""A Python callable as a multi-turn rollout's tool (`sampling.tool=host:module:function`), for
what JAX cannot express: the program calls the host for the rows that call at a decode step,
and the calls run in the host verifiers' worker processes under their time limit."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import sigterm
from jaxrl_llm.envs import ToolEnv

logger = logging.getLogger(__name__)


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

  def __post_init__(self):
    """Refuses answers longer than the scorer's float32 holds exactly."""
    if self.max_digits > 7:  # the scorer's float32 holds every whole number below 10**7
      raise ValueError(f"a host tool's max_digits={self.max_digits}: allowed 1 to 7")

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
    whole = functools.partial(_whole, self.fn, 10**self.max_digits)  # checked in the worker
    scores, stats = score_batch(
      calls, prompts, terms={name: whole}, timeout_s=self.timeout_s, fill=float("nan"),
      said=_WARNED, label="host tool", stop=sigterm.seen,
    )  # fmt: skip
    if stats["verifier/cut"] and not CUT["calls"]:  # said once a process
      logger.warning(
        "SIGTERM: host tool %r calls are answered with the error token from now on (%d cut) so "
        "that this step ends and is saved", name, stats["verifier/cut"],
      )  # fmt: skip
    CUT["calls"] += stats["verifier/cut"]
    got = scores[name].astype(np.float64)
    ok = np.isfinite(got) & (np.abs(got) < 10**self.max_digits) & (got == np.round(got))
    value[rows] = np.where(ok, got, 0).astype(np.int32)
    error[rows] = ~ok
    return value, error


_WARNED: set[str] = set()  # host tools whose first failure this process has logged
CUT = {"calls": 0}  # host tool calls a SIGTERM cut in this process (an evaluation then unsaid)


def _whole(fn, limit: int, call: str, prompt: str) -> int:
  """A host tool's answer `fn(call, prompt)` where it is a whole number below `limit` in
  magnitude: an int (not a bool) or a float that is exactly whole, checked at full precision
  before the scorer stores it as float32; a ValueError otherwise (the call's error token)."""
  got = fn(call, prompt)
  if isinstance(got, bool | np.bool_) or not isinstance(
    got, int | float | np.integer | np.floating
  ):
    raise ValueError(f"host tool answer {got!r} is no number: return an int")
  if isinstance(got, float | np.floating) and not float(got).is_integer():
    raise ValueError(f"host tool answer {got!r} is no whole number")
  if abs(int(got)) >= limit:
    raise ValueError(f"host tool answer {got!r} is not below {limit}")
  return int(got)
