"""The optimiser: AdamW with warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax


def make_optimizer(
  *,
  learning_rate: float,
  total_updates: int,
  warmup_steps: int,
  decay_to: float,
  weight_decay: float,
  b1: float,
  b2: float,
  grad_clip: float,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup + cosine decay and global-norm clipping; returns (tx, schedule).
  Every argument is a field of `config.OptimSettings` (no defaults of its own)."""
  shape = functools.partial(
    _warmup_cosine, warmup_steps=warmup_steps, total_updates=total_updates, decay_to=decay_to
  )
  if isinstance(learning_rate, jax.Array):  # a pack's per-run rate, traced: optax's schedules
    unit = shape(1.0)  # branch on their peak in Python, so the peak scales a unit schedule
    schedule = lambda count: learning_rate * unit(count)  # noqa: E731
  else:
    schedule = shape(learning_rate)
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*parts), schedule


def _warmup_cosine(
  peak: float, *, warmup_steps: int, total_updates: int, decay_to: float
) -> optax.Schedule:
  """Linear warmup from 0 (none when `warmup_steps` is 0) to `peak`, cosine decay to
  `decay_to` x `peak` at `total_updates`."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0 if warmup_steps else peak,
    peak_value=peak,
    warmup_steps=warmup_steps,
    decay_steps=max(total_updates, warmup_steps + 1),
    end_value=peak * decay_to,
  )


def finite_leaves(tree) -> jax.Array:
  """[n] bool: for each floating-point leaf of `tree` (None leaves skipped), whether it holds
  only finite values."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones(0, bool)


def all_finite(*trees) -> jax.Array:
  """[] bool: whether every floating-point value in `trees` is finite."""
  return jnp.all(finite_leaves(trees))


def guarded_update(tx: optax.GradientTransformation, grads, opt_state, params, loss=None):
  """One optimiser step that is skipped when the loss, the gradient, the update or the new
  parameters hold a non-finite value: parameters and optimiser state then stay as they were.
  Returns (params, opt_state, skipped [] int32: 1 if skipped)."""
  updates, new_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  ok = all_finite(loss, grads, updates, new_params)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
  return keep(new_params, params), keep(new_state, opt_state), (~ok).astype(jnp.int32)
