"""The fused RL update: sample → score → advantages → old/ref log-probs → epochs × minibatches.

`make_rl_step` binds the static pieces (model, optimiser, task, settings) and returns ONE
jitted function `(TrainState, PromptBatch, rng) -> (TrainState, metrics)` with explicit
shardings and the state donated. Nothing leaves the device between sampling and learning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import objectives
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.sampling import SamplingConfig, sample, score
from jaxrl_llm.types import PromptBatch, Rollout, TrainState


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """Static settings of the learner half of the step."""

  num_epochs: int = 1  # passes over the rollout
  num_minibatches: int = 1  # optimiser steps per epoch
  advantage: str = "grpo"  # §1 estimator name
  objective: str = "ppo_clip"  # §2 objective name
  aggregation: str = "seq_mean_token_mean"  # §5 mode
  clip_low: float = 0.2  # ε_low
  clip_high: float = 0.2  # ε_high
  kl_beta: float = 0.0  # β (0 = no reference forward pass)
  kl_estimator: str = "k3"  # §4 estimator
  reward_weights: tuple[tuple[str, float], ...] = (("correct", 1.0),)  # §6 weights


def _masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _masked_max(x, mask):
  return jnp.max(jnp.where(mask > 0, x, -jnp.inf))


def _masked_min(x, mask):
  return jnp.min(jnp.where(mask > 0, x, jnp.inf))


def rollout_metrics(rollout: Rollout, terms: dict[str, jax.Array], reward, adv, group_size):
  """Rollout-side scalars of spec §11 (reward, accuracy, lengths, truncation, advantages)."""
  lengths = rollout.lengths.astype(jnp.float32)
  ones = jnp.ones_like(lengths)
  m = {
    "rollout/reward_mean": jnp.mean(reward),
    "rollout/reward_std": jnp.std(reward),
    "rollout/length_mean": jnp.mean(lengths),
    "rollout/length_min": jnp.min(lengths),
    "rollout/length_max": jnp.max(lengths),
    "rollout/truncated_frac": jnp.mean(rollout.truncated.astype(jnp.float32)),
    "adv/mean": jnp.mean(adv),
    "adv/std": jnp.std(adv),
    "adv/abs_max": jnp.max(jnp.abs(adv)),
  }
  for name, value in terms.items():
    m[f"reward/{name}"] = jnp.mean(value)
  if "correct" in terms:
    correct = terms["correct"]
    m["rollout/accuracy"] = jnp.mean(correct)
    m["rollout/length_correct_mean"] = _masked_mean(lengths, correct)
    m["rollout/length_incorrect_mean"] = _masked_mean(lengths, ones - correct)
  groups = reward.reshape(-1, group_size)
  m["rollout/zero_std_group_frac"] = jnp.mean(
    (jnp.max(groups, axis=1) == jnp.min(groups, axis=1)).astype(jnp.float32)
  )
  return m


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


def make_rl_step(
  model: Transformer,
  optimizer: optax.GradientTransformation,
  schedule: optax.Schedule,
  reward_fn: Callable[..., dict[str, jax.Array]],
  sampling: SamplingConfig,
  rl: RLConfig,
  mesh: Mesh,
  state_shardings: Any,
):
  """Builds the fused jitted RL update.

  `reward_fn(prompt_tokens, completion, completion_mask, answer, answer_mask)` returns named
  [B] reward terms (a pure JAX verifier). Returns `step(state, batch, rng) -> (state, metrics)`.
  """
  g = sampling.group_size
  weights = dict(rl.reward_weights)
  updates_per_step = rl.num_epochs * rl.num_minibatches
  batch_axis = NamedSharding(mesh, PartitionSpec("data"))

  def constrain(tree):
    return jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(x, batch_axis) if x.ndim else x, tree
    )

  def loss_fn(params, mb):
    logp, logits = score(
      model, params, mb["prompt_tokens"], mb["prompt_mask"], mb["tokens"], sampling.temperature
    )
    mask = mb["loss_mask"]
    loss, metrics = objectives.policy_loss(
      logp,
      mb["old_logp"],
      mb["adv"],
      mask,
      objective=rl.objective,
      aggregation=rl.aggregation,
      max_len=sampling.max_new_tokens,
      clip_low=rl.clip_low,
      clip_high=rl.clip_high,
    )
    if rl.kl_beta > 0:
      kl = objectives.kl_penalty(logp, mb["ref_logp"], mb["old_logp"], estimator=rl.kl_estimator)
      kl_loss = objectives.aggregate(kl, mask, rl.aggregation, max_len=sampling.max_new_tokens)
      loss = loss + rl.kl_beta * kl_loss
      metrics["kl/ref_kl"] = kl_loss
    ent = objectives.entropy_from_logits(jax.lax.stop_gradient(logits), 1.0)
    metrics["policy/entropy"] = _masked_mean(ent, mask)
    metrics["policy/loss"] = loss
    return loss, metrics

  def minibatch_update(carry, mb):
    params, opt_state = carry
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
    metrics["optim/grad_norm"] = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), metrics

  def step(state: TrainState, batch: PromptBatch, rng: jax.Array):
    sample_key, shuffle_key = jax.random.split(rng)
    rollout = constrain(sample(model, state.params, batch.tokens, batch.mask, sample_key, sampling))
    answer = jnp.repeat(batch.answer, g, axis=0)
    answer_mask = jnp.repeat(batch.answer_mask, g, axis=0)
    terms = reward_fn(rollout.prompt_tokens, rollout.tokens, rollout.loss_mask, answer, answer_mask)
    reward = sum(w * terms[name] for name, w in weights.items() if w)
    reward = jnp.asarray(reward, jnp.float32) * jnp.ones(rollout.lengths.shape, jnp.float32)
    adv = objectives.get_advantage(rl.advantage)(reward, g)

    score_fn = lambda p: score(  # noqa: E731
      model, p, rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, sampling.temperature
    )
    old_logp, _ = jax.lax.stop_gradient(score_fn(state.params))
    data = {
      "prompt_tokens": rollout.prompt_tokens,
      "prompt_mask": rollout.prompt_mask,
      "tokens": rollout.tokens,
      "loss_mask": rollout.loss_mask,
      "old_logp": old_logp,
      "adv": adv,
    }
    if rl.kl_beta > 0:
      data["ref_logp"] = jax.lax.stop_gradient(score_fn(state.ref_params)[0])

    b = rollout.lengths.shape[0]
    mb_size = b // rl.num_minibatches
    perms = jax.vmap(lambda k: jax.random.permutation(k, b))(
      jax.random.split(shuffle_key, rl.num_epochs)
    )  # [E, B]
    order = perms.reshape(updates_per_step, mb_size)  # [E*M, B/M]
    minibatches = jax.tree.map(lambda x: x[order], data)  # leaves [E*M, B/M, ...]
    (params, opt_state), mb_metrics = jax.lax.scan(
      minibatch_update, (state.params, state.opt_state), minibatches
    )

    metrics = rollout_metrics(rollout, terms, reward, adv, g)
    metrics.update(jax.tree.map(jnp.mean, mb_metrics))
    metrics["policy/clip_frac_first_minibatch"] = (
      mb_metrics["policy/clip_frac_low"][0] + mb_metrics["policy/clip_frac_high"][0]
    )
    _, behaviour = objectives.behaviour_weight(
      old_logp, rollout.logprobs, rollout.loss_mask, name="none"
    )
    metrics.update(behaviour)
    metrics["optim/learning_rate"] = schedule(state.step * updates_per_step)
    metrics["perf/generated_tokens"] = jnp.sum(rollout.lengths).astype(jnp.float32)
    metrics["perf/learner_tokens"] = jnp.float32(
      b
      * (rollout.tokens.shape[1] + rollout.prompt_tokens.shape[1])
      * updates_per_step
      / rl.num_minibatches
    )
    n_show = min(8, b // g)
    metrics["hist/reward"] = reward
    metrics["hist/length"] = rollout.lengths
    metrics["hist/advantage"] = adv
    metrics["samples/prompt"] = rollout.prompt_tokens[::g][:n_show]
    metrics["samples/tokens"] = rollout.tokens[::g][:n_show]
    metrics["samples/reward"] = reward[::g][:n_show]
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  repl = NamedSharding(mesh, PartitionSpec())
  batch_shardings = PromptBatch(
    tokens=batch_axis, mask=batch_axis, answer=batch_axis, answer_mask=batch_axis
  )
  return jax.jit(
    step,
    in_shardings=(state_shardings, batch_shardings, repl),
    out_shardings=(state_shardings, repl),
    donate_argnums=(0,),
  )
