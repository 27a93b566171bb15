"""The bookkeeping of multi-turn rollouts (`sampling.sample` with an `envs.ToolEnv`): the
tool's answer being appended, where the policy's segment began, what the tool wrote; and the
completion the verifier reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm.types import Rollout


@struct.dataclass
class Turns:
  """A multi-turn rollout's bookkeeping: the environment's answer being appended, where the
  policy's segment began, and what the environment wrote."""

  pending: jax.Array  # [B, E] int32, the environment's answer being appended
  pending_n: jax.Array  # [B] int32, its length
  pending_i: jax.Array  # [B] int32, tokens of it appended so far
  seg_start: jax.Array  # [B] int32, first slot of the policy's current segment
  env_mask: jax.Array  # [B, T] float32, 1 on the environment's tokens
  calls: jax.Array  # [B] int32, tool calls made
  errors: jax.Array  # [B] int32, calls the environment could not evaluate

  @classmethod
  def start(cls, b: int, t: int, e: int) -> Turns:
    """No call made, nothing pending."""
    zeros = jnp.zeros((b,), jnp.int32)
    return cls(
      pending=jnp.zeros((b, e), jnp.int32),
      pending_n=zeros,
      pending_i=zeros,
      seg_start=zeros,
      env_mask=jnp.zeros((b, t), jnp.float32),
      calls=zeros,
      errors=zeros,
    )


def take_turns(cfg, turns: Turns, prompts, tokens, token, step, active, forced) -> Turns:
  """After the token at slot `step`: an appended environment token advances its answer (the
  policy's next segment starts after the last); a policy token that completes the call's close,
  with calls left, gets the environment's answer to the call (the segment before the close)
  pending."""
  env = cfg.tool
  pending_i = turns.pending_i + forced.astype(jnp.int32)
  answered = forced & (pending_i == turns.pending_n)
  seg_start = jnp.where(answered, step + 1, turns.seg_start)
  closes = env.closes(tokens, step, turns.seg_start)
  call = active & ~forced & closes & (turns.calls < cfg.max_turns - 1)
  end = jnp.full_like(seg_start, step - env.close_len + 1)
  none = (jnp.zeros((call.shape[0], env.answer_len), jnp.int32), jnp.zeros_like(end), ~call)
  answer, length, error = jax.lax.cond(  # the tool reads the calls only at a step that has one
    jnp.any(call), lambda: env.respond(prompts, tokens, turns.seg_start, end, call), lambda: none
  )
  return Turns(
    pending=jnp.where(call[:, None], answer, turns.pending),
    pending_n=jnp.where(call, length, turns.pending_n),
    pending_i=jnp.where(call, 0, pending_i),
    seg_start=seg_start,
    env_mask=turns.env_mask.at[:, step].set(forced.astype(jnp.float32)),
    calls=turns.calls + call.astype(jnp.int32),
    errors=turns.errors + (call & error).astype(jnp.int32),
  )


def over_budget(cfg, turns: Turns, step, active, forced):
  """[B] bool: rows whose policy segment reached `cfg.turn_tokens` tokens at slot `step`
  without a call pending (they end; 0: no per-turn budget)."""
  if not cfg.turn_tokens:
    return jnp.zeros_like(active)
  idle = turns.pending_i >= turns.pending_n
  return active & ~forced & idle & (step + 1 - turns.seg_start >= cfg.turn_tokens)


def final_segment(rollout: Rollout) -> tuple[jax.Array, jax.Array]:
  """The completion the verifier reads, [B, T] tokens and mask: the policy's tokens after the
  environment's last answer, moved to the front (a single-turn rollout's own tokens and loss
  mask, unchanged)."""
  if rollout.env_mask is None:
    return rollout.tokens, rollout.loss_mask
  t = rollout.tokens.shape[1]
  pos = jnp.arange(t)[None, :]
  start = jnp.max(jnp.where(rollout.env_mask > 0, pos + 1, 0), axis=1)  # [B]
  idx = jnp.clip(start[:, None] + pos, 0, t - 1)
  tokens = jnp.take_along_axis(rollout.tokens, idx, axis=1)
  mask = (pos < (rollout.lengths - start)[:, None]).astype(jnp.float32)
  return tokens, mask
