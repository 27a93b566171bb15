"""Regularisers (objectives.md §8)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import check_float


def entropy_from_logits(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Entropy H [B, T] float32 of softmax(logits / τ_s) (objectives.md §8).

  Computed in float32 whatever the logits dtype; −inf logits (banned tokens) contribute 0.
  """
  chex.assert_rank(logits, 3)
  check_float(logits)
  if temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  z = logits.astype(jnp.float32) / temperature
  return entropy_from_logprobs(jax.nn.log_softmax(z, axis=-1))


def entropy_from_logprobs(logp: jax.Array) -> jax.Array:
  """Entropy H [...] of a float32 log-softmax [..., V] (§8); −inf entries contribute 0."""
  p = jnp.exp(logp)
  safe_logp = jnp.where(p > 0, logp, 0.0)  # no 0·(−inf) in value or gradient
  return -jnp.sum(p * safe_logp, axis=-1)
