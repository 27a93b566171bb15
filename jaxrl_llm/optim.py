"""The optimiser: AdamW with warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import sharding


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
  if isinstance(learning_rate, jax.Array):  # a traced rate (a pack's or run's): optax's schedules
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
  `decay_to` x `peak` at `total_updates`. Without decay (`decay_to` 1) the rate after warmup
  is `peak` however long the run, so the schedule leaves `total_updates` out: a relaunch with
  more train.num_steps runs the program it compiled (it compiled anew)."""
  decay_steps = max(total_updates, warmup_steps + 1) if decay_to != 1 else warmup_steps + 1
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0 if warmup_steps else peak,
    peak_value=peak,
    warmup_steps=warmup_steps,
    decay_steps=decay_steps,
    end_value=peak * decay_to,
  )


SCHEDULE_STATE = "ScaleByScheduleState"  # optax's state of `adamw`'s learning-rate schedule


def schedule_count(opt_state) -> jax.Array | None:
  """[] int32: the count of the learning-rate schedule's state (optax's `ScaleByScheduleState`
  in `make_optimizer`'s chain) in `opt_state`: the updates applied so far. An update that
  `guarded_update` skips leaves it as it was; a reset by `reset_moments` carries it over.
  None when the chain has no schedule (a constant rate)."""
  found = optax.tree_utils.tree_get_all_with_path(opt_state, SCHEDULE_STATE)
  return found[0][1].count if found else None


def applied_rate(schedule: optax.Schedule, opt_state) -> jax.Array:
  """The learning rate the last applied update of `opt_state` used: `schedule(count - 1)` at
  the schedule's count (`schedule_count`), so exact after skipped updates and optimiser
  resets; `schedule(0)`, the rate the first will use, while none has been applied."""
  count = schedule_count(opt_state)
  return schedule(0 if count is None else jnp.maximum(count - 1, 0))


def reset_moments(optimizer: optax.GradientTransformation, params, opt_state):
  """A fresh optimiser state for `params` (`optimizer.init`: Adam's moments and their
  bias-correction count start afresh) that keeps `opt_state`'s learning-rate schedule where it
  was: the warmup / decay goes on from its count rather than from update 0."""
  fresh = optimizer.init(params)
  found = optax.tree_utils.tree_get_all_with_path(opt_state, SCHEDULE_STATE)
  if not found:
    return fresh
  return optax.tree_utils.tree_set(fresh, **{SCHEDULE_STATE: found[0][1]})


def finite_leaves(tree) -> jax.Array:
  """[n] bool: for each floating-point leaf of `tree` (None leaves skipped), whether it holds
  only finite values."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones(0, bool)


def finite_norm(tree) -> jax.Array:
  """[] bool: whether the float32 global norm of `tree`'s floating-point leaves is finite: false
  when a value is NaN or inf, or the norm overflows float32 (above about 1.8e19).

  The leaves' sums of squares are sorted before they are added: a sort is an op XLA never
  fuses, so the total is computed once. Added directly, they form a chain of one add per leaf
  that XLA fuses into every consumer; in a vmapped pack, where the guard's `lax.cond` becomes a
  select in every leaf of parameters and Adam state, that is leaves x leaves adds: a pack of 2
  Qwen2.5-0.5B runs compiled in 264 s against 64 s sorted (55 s unguarded; the CPU backend)."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not leaves:
    return jnp.bool_(True)
  squares = jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves])
  return jnp.isfinite(jnp.sum(jnp.sort(squares)))


# The compilers for which `guarded_update` computes the update twice rather than holding it.
RECOMPUTE_ON = frozenset({"tpu"})


def guarded_update(
  tx: optax.GradientTransformation,
  grads,
  opt_state,
  params,
  loss=None,
  *,
  recompute: bool | None = None,
):
  """One optimiser step that is skipped when the loss, the gradient or the update holds a
  non-finite value, or the norm of the gradient or the update overflows float32: parameters and
  optimiser state then stay as they were. Returns (params, opt_state, skipped [] int32: 1 if
  skipped). From finite parameters the new ones are then finite too: each update moves a value
  by less than 1.9e19, which would take some 1e19 updates to overflow float32's 3.4e38.

  The update is computed only for a finite gradient and applied only when finite (`lax.cond`).
  `recompute` (None: for the platform compiled for, `RECOMPUTE_ON`) computes it twice: once
  for its norm, reduced leaf by leaf and dropped, and again where it is applied. The TPU
  compiler then never holds the whole float32 update: Qwen2.5-7B's step plans 30.5 GiB of temp
  per v5p chip (as unguarded) against 33.9 GiB, and Qwen3-30B-A3B in bfloat16 45.9 GiB, where
  the held update made the TPU compiler refuse it (99.5 GiB). The CPU backend instead
  materialises the first computation's leaves beside the rest and plans more (7B 114.9 against
  113.5 GiB on one device; 30B-A3B 57.5 against 44.4 GiB on 8), so it holds the update; GPUs
  too: an H200's compiler plans 7B's step the same either way (docs/cpu_runs/guard_memory/).
  Both forms give equal results.

  The same checks as a select of new against old values in every leaf, with every leaf's new
  value checked too, made XLA compile Qwen2.5-0.5B's fused step in 499 s; so it takes 106 s,
  and 70 s unguarded (the CPU backend of this project's 2-core machine)."""
  if recompute is None:
    recompute = (sharding.active_platform() or jax.default_backend()) in RECOMPUTE_ON
  kept = lambda: (params, opt_state, jnp.int32(1))  # noqa: E731

  def apply(updates, new_state):
    return optax.apply_updates(params, updates), new_state, jnp.int32(0)

  def update():
    updates, new_state = tx.update(grads, opt_state, params)
    if recompute:  # only the first update's norm is used, reduced leaf by leaf
      applied = lambda: apply(*tx.update(grads, opt_state, params))  # noqa: E731
    else:
      applied = lambda: apply(updates, new_state)  # noqa: E731
    return jax.lax.cond(finite_norm(updates), applied, kept)

  ok = finite_norm(grads)
  if loss is not None:
    ok = ok & jnp.all(jnp.isfinite(loss))
  return jax.lax.cond(ok, update, kept)
