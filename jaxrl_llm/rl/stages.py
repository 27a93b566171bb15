"""The learn phase's stages, in the spec's order, as module-level pure functions.

total reward (§6) → group filtering (§7) → loss mask (§0, §6) → old pass (§0, §9) → reference
pass (§4) → advantages (§1) → behaviour weight (§3) → the `PolicyBatch` the optimiser consumes.
Each takes arrays and frozen settings and can be tested on small arrays without a model (the
two passes take the model as an argument).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import objectives, sharding
from jaxrl_llm.config.learner import (
  AdvantageSettings,
  CorrectionSettings,
  FilteringSettings,
  KLSettings,
  ShapingSettings,
)
from jaxrl_llm.sampling import Scores, score
from jaxrl_llm.types import PolicyBatch, Rollout

Metrics = dict[str, jax.Array]


def total_reward(
  rollout: Rollout,
  terms: dict[str, jax.Array],
  shaping: ShapingSettings,
  reward_weights: tuple[tuple[str, float], ...],
  max_len: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """R = Σ_k w_k R^k [B] float32 and the terms, with the soft overlong term added (§6)."""
  terms = {k: jnp.asarray(v, jnp.float32) for k, v in terms.items()}
  weights = dict(reward_weights)
  if shaping.name == "soft_overlong":
    terms["overlong"] = objectives.soft_overlong(
      rollout.lengths, rollout.truncated, max_len, shaping.cache_len
    )
    weights["overlong"] = shaping.weight
  used = {k: w for k, w in weights.items() if isinstance(w, jax.Array) or w}  # traced: per run
  reward = sum(w * terms[name] for name, w in used.items())
  return jnp.asarray(reward, jnp.float32) * jnp.ones(rollout.lengths.shape, jnp.float32), terms


def filter_groups(
  rollout: Rollout,
  reward: jax.Array,
  terms: dict[str, jax.Array],
  filtering: FilteringSettings,
  group_size: int,
  keep_prompts: int,
) -> tuple[Rollout, jax.Array, dict[str, jax.Array], jax.Array, Metrics]:
  """Group filtering (§7): returns (rollout, reward, terms, seq_valid [B] bool, metrics).

  Dynamic sampling gathers the first `keep_prompts` groups with reward spread (static shapes);
  Reinforce-Rej keeps every group and marks zero-spread ones invalid.
  """
  num_groups = rollout.lengths.shape[0] // group_size
  metrics: Metrics = {}
  if filtering.name == "dynamic_sampling":
    idx, group_valid, metrics = objectives.dynamic_sampling(reward, group_size, keep_prompts)
    sampled = rollout.lengths.shape[0]
    take = lambda x: x[idx] if x.ndim and x.shape[0] == sampled else x  # noqa: E731
    rollout, reward, terms = jax.tree.map(take, (rollout, reward, terms))
  elif filtering.name == "reinforce_rej":
    group_valid = objectives.reinforce_rej(reward, group_size)
    metrics["filter/zero_std_frac"] = 1.0 - jnp.mean(group_valid.astype(jnp.float32))
    metrics["filter/groups_used"] = jnp.sum(group_valid.astype(jnp.float32))
  else:
    group_valid = jnp.ones((num_groups,), bool)
  return rollout, reward, terms, objectives.expand_groups(group_valid, group_size), metrics


def loss_mask(rollout: Rollout, seq_valid: jax.Array, shaping: ShapingSettings) -> jax.Array:
  """m [B, T] float32: generated tokens of kept groups, minus truncated ones if filtered (§6)."""
  mask = rollout.loss_mask * seq_valid[:, None].astype(jnp.float32)
  if shaping.overlong_filter:
    mask = objectives.overlong_filter(mask, rollout.truncated)
  return mask


def split_leading(tree, parts: int, block: int = 1):
  """Every leaf [N, ...] → [parts, N / parts, ...], slice j holding blocks j, j + parts, ...
  of `block` consecutive rows.

  Strided, so that each slice of a row-sharded minibatch takes the same number of rows from
  every device; blocks keep rows that share a prompt together.
  """

  def split(x):
    n = x.shape[0]
    x = x.reshape(n // (parts * block), parts, block, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(parts, n // parts, *x.shape[3:])

  return jax.tree.map(split, tree)


def merge_leading(tree, block: int = 1):
  """The inverse of `split_leading`: every leaf [parts, N / parts, ...] → [N, ...]."""

  def merge(x):
    parts, rows = x.shape[:2]
    x = x.reshape(parts, rows // block, block, *x.shape[2:]).swapaxes(0, 1)
    return x.reshape(parts * rows, *x.shape[3:])

  return jax.tree.map(merge, tree)


def rescore(
  model,
  params,
  rollout: Rollout,
  temperature: float,
  routing=None,
  prompt_group: int = 1,
  chunks: int = 1,
) -> Scores:
  """Stop-gradient learner scores of the rollout's completions under `params` (§0).

  `prompt_group` G > 1: the group-major rows' prompts run once per group (`sampling.score`).
  `chunks` > 1: the rows are scored in that many slices, one after another under a
  `lax.map` (the learner's microbatches: the same activation memory as one of them), each
  slice taking the same rows of every device. Per-token outputs are exactly those of one
  pass; the MoE load and z-loss are the token-weighted means of the slices' (= the whole
  batch's); the load-balance loss is the slices' token-weighted mean (no stage reads it).
  """
  is_moe = bool(model.cfg.moe_layers)
  whole = (rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, routing)
  whole += (rollout.loss_mask if is_moe else None,)
  if chunks == 1:
    return jax.lax.stop_gradient(_score(model, params, *whole, temperature, prompt_group))
  block = math.gcd(prompt_group, rollout.tokens.shape[0] // chunks)
  sliced = sharding.constrain_rows(split_leading(whole, chunks, block), axis=1)

  def one(part):
    sc = _score(model, params, *part, temperature, prompt_group)
    completion = part[2].size if part[4] is None else jnp.sum(part[4] > 0)
    tokens = jnp.sum(part[1]) + completion  # real prompt + completion tokens
    return jax.lax.stop_gradient(sc), tokens.astype(jnp.float32)

  scores, tokens = jax.lax.map(one, sliced)
  moe = scores.moe
  scores = scores.replace(moe=None)
  out = merge_leading(scores, block)
  if moe is not None:
    w = tokens / jnp.sum(tokens)  # [chunks]
    mean = lambda x: jnp.tensordot(w, x, axes=1)  # noqa: E731
    rows = merge_leading(
      (moe.routing, moe.used_logprobs, moe.probe_logprobs, moe.own_differs), block
    )
    moe = moe.replace(
      routing=rows[0],
      used_logprobs=rows[1],
      probe_logprobs=rows[2],
      own_differs=rows[3],
      load=mean(moe.load),
      aux_loss=mean(moe.aux_loss),
      z_loss=mean(moe.z_loss),
    )
  return out.replace(moe=moe)


def _score(model, params, prompt_tokens, prompt_mask, tokens, routing, completion, temp, group):
  """`sampling.score` of one slice of rows (MoE statistics over its real tokens)."""
  return score(
    model,
    params,
    prompt_tokens,
    prompt_mask,
    tokens,
    temp,
    routing=routing,
    group_size=group,
    completion_mask=completion,
  )


def old_pass(
  model,
  params,
  rollout: Rollout,
  temperature: float,
  replay: str,
  prompt_group: int = 1,
  chunks: int = 1,
) -> Scores:
  """ℓ^old (and V, routing) of the parameters at the start of the update (§0); under r3 the
  sampler's routing is replayed so ℓ^old uses the experts the sampler used (§9)."""
  routing = rollout.routing if replay == "r3" else None
  return rescore(model, params, rollout, temperature, routing, prompt_group, chunks)


def reference_pass(
  model,
  ref_params,
  rollout: Rollout,
  old_logp: jax.Array,
  mask: jax.Array,
  temperature: float,
  prompt_group: int = 1,
  chunks: int = 1,
) -> tuple[jax.Array, jax.Array, Metrics]:
  """ℓ^ref [B, T], the k1 estimate of KL(π_old‖π_ref) per token and its mean (§4).

  k1 is unclamped: with the KL in the reward it is what R loses (§4)."""
  ref_logp = rescore(
    model, ref_params, rollout, temperature, prompt_group=prompt_group, chunks=chunks
  ).logp
  k1, metrics = reference_kl(old_logp, ref_logp, mask)
  return ref_logp, k1, metrics


def reference_kl(old_logp: jax.Array, ref_logp: jax.Array, mask: jax.Array):
  """k1 [B, T] of KL(π_old‖π_ref) per token (unclamped, §4) and its masked mean `kl/ref_kl`."""
  k1 = objectives.kl_penalty(old_logp, ref_logp, estimator="k1", mask=mask)
  return k1, {"kl/ref_kl": objectives.masked_mean(k1, mask)}


def terminal_rewards(reward: jax.Array, lengths: jax.Array, t_max: int) -> jax.Array:
  """Per-token rewards [B, T] for GAE: the sequence reward on its last token, 0 elsewhere."""
  last = jnp.clip(lengths - 1, 0, t_max - 1)
  return jax.nn.one_hot(last, t_max, dtype=jnp.float32) * reward[:, None]


def stats_rows(rollout: Rollout, seq_valid: jax.Array, shaping: ShapingSettings) -> jax.Array:
  """[B] bool rows that count in group statistics: kept groups, minus truncated completions
  when overlong filtering also removes them from the statistics (§6)."""
  if shaping.overlong_filter and not shaping.overlong_in_group_stats:
    return seq_valid & ~rollout.truncated.astype(bool)
  return seq_valid


def advantages(
  reward: jax.Array,
  rollout: Rollout,
  mask: jax.Array,
  valid: jax.Array,
  values: jax.Array | None,
  kl_tok: jax.Array | None,
  advantage: AdvantageSettings,
  kl: KLSettings,
  group_size: int,
) -> tuple[jax.Array, jax.Array | None]:
  """Advantages [B] or [B, T] and GAE returns (None unless `gae`) (§1).

  `valid` [B] marks the rows in the group statistics (`stats_rows`). With the KL in the reward
  (§4), β·Σ_t k1 is subtracted from R (or β·k1 per token for GAE).
  """
  in_reward = kl_tok is not None and kl.placement == "reward"
  returns = None
  if advantage.name == "gae":
    token_r = terminal_rewards(reward, rollout.lengths, mask.shape[1])
    if in_reward:
      token_r = token_r - kl.beta * kl_tok * mask
    adv, returns = objectives.gae(
      token_r, values, mask, advantage.gamma, advantage.lam, carry_masked=advantage.gae_carry_masked
    )
  else:
    if in_reward:
      reward = reward - kl.beta * jnp.sum(kl_tok * mask, axis=-1)
    estimator = objectives.get_advantage(advantage.name)
    extra = {"mask": mask} if "mask" in inspect.signature(estimator).parameters else {}
    adv = estimator(reward, group_size, valid=valid, **extra)
  if advantage.whiten:
    where = mask if adv.ndim == 2 else valid.astype(jnp.float32)
    adv = objectives.whiten(adv, where, variance=advantage.whiten_variance)
  return adv, returns


def behaviour_weight(
  old_logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array, correction: CorrectionSettings
) -> tuple[jax.Array, Metrics]:
  """The §3 behaviour weight w [B, T] of the configured correction and its metrics."""
  return objectives.behaviour_weight(
    old_logp,
    behaviour_logp,
    mask,
    name=correction.name,
    cap=correction.cap,
    geo_low=correction.geo_low,
    geo_high=correction.geo_high or None,
  )


def policy_batch(
  rollout: Rollout,
  mask: jax.Array,
  old: Scores | None,
  adv: jax.Array,
  weight: jax.Array | None,
  *,
  ref_logp: jax.Array | None,
  returns: jax.Array | None,
  replay: str,
) -> PolicyBatch:
  """The typed batch of the optimiser steps; routing travels with its sequences (§9).

  Without an old pass (`old` None) the loss takes ℓ^old = sg[ℓ] and computes w from ℓ^μ.
  """
  extra: dict[str, Any] = {}
  if old is None:
    extra = dict(behaviour_logp=rollout.logprobs)
  elif old.moe is not None:
    extra = dict(
      sampler_routing=rollout.routing,
      old_routing=old.moe.routing,
      old_router_logp=old.moe.used_logprobs,
      replay={"r2": old.moe.routing, "r3": rollout.routing}.get(replay),
    )
  return PolicyBatch(
    prompt_tokens=rollout.prompt_tokens,
    prompt_mask=rollout.prompt_mask,
    tokens=rollout.tokens,
    loss_mask=mask,
    old_logp=None if old is None else old.logp,
    adv=adv,
    weight=weight,
    ref_logp=ref_logp,
    old_values=old.values if old is not None and returns is not None else None,
    returns=returns,
    **extra,
  )
