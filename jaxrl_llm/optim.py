"""The optimiser: AdamW with warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import optax


def make_optimizer(
  learning_rate: float,
  total_updates: int,
  *,
  warmup_steps: int = 0,
  decay_to: float = 0.1,
  weight_decay: float = 0.0,
  b1: float = 0.9,
  b2: float = 0.999,
  grad_clip: float = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup + cosine decay and global-norm clipping; returns (tx, schedule)."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0 if warmup_steps else learning_rate,
    peak_value=learning_rate,
    warmup_steps=warmup_steps,
    decay_steps=max(total_updates, warmup_steps + 1),
    end_value=learning_rate * decay_to,
  )
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))
  return optax.chain(*parts), schedule
