"""Metrics of the RL update (spec §11): rollout, routing and the step summary.

All keys are namespaced (`rollout/`, `adv/`, `reward/`, `moe/`, `optim/`, `perf/`, `hist/`,
`samples/`); scalars become TensorBoard scalars, `hist/` histograms and `samples/` the text table.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import objectives
from jaxrl_llm.types import PolicyBatch, Rollout

Metrics = dict[str, jax.Array]


def rollout_metrics(rollout: Rollout, terms: Metrics, reward, adv, group_size: int) -> Metrics:
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
    "rollout/decode_steps": rollout.decode_steps.astype(jnp.float32),
    "adv/mean": jnp.mean(adv),
    "adv/std": jnp.std(adv),
    "adv/abs_max": jnp.max(jnp.abs(adv)),
  }
  for name, value in terms.items():
    m[f"reward/{name}"] = jnp.mean(value)
  if "correct" in terms:
    correct = terms["correct"]
    m["rollout/accuracy"] = jnp.mean(correct)
    # 0 (not NaN) when none is correct / none incorrect: the studies' seed tables read these
    # tags and refuse a NaN (docs/tensorboard.md).
    m["rollout/length_correct_mean"] = objectives.masked_mean(lengths, correct)
    m["rollout/length_incorrect_mean"] = objectives.masked_mean(lengths, ones - correct)
  groups = reward.reshape(-1, group_size)
  m["rollout/zero_std_group_frac"] = jnp.mean(
    (jnp.max(groups, axis=1) == jnp.min(groups, axis=1)).astype(jnp.float32)
  )
  if rollout.tool_calls is not None:
    m.update(tool_metrics(rollout, reward))
  return m


def tool_metrics(rollout: Rollout, reward: jax.Array) -> Metrics:
  """A multi-turn rollout's tool use: turns and calls per episode, the calls the tool could
  not evaluate, the share of tokens the tool wrote, and the reward of the episodes that
  called it and of those that did not."""
  calls = rollout.tool_calls.astype(jnp.float32)
  used = (calls > 0).astype(jnp.float32)
  env_tokens = jnp.sum(rollout.env_mask)
  return {
    "tool/turns_mean": jnp.mean(calls + 1.0),
    "tool/calls_mean": jnp.mean(calls),
    "tool/errors_mean": jnp.mean(rollout.tool_errors.astype(jnp.float32)),
    "tool/error_frac": jnp.sum(rollout.tool_errors) / jnp.maximum(jnp.sum(calls), 1.0),
    "tool/used_frac": jnp.mean(used),
    "tool/env_token_frac": env_tokens / jnp.maximum(jnp.sum(rollout.lengths), 1),
    "tool/reward_with_calls": objectives.masked_mean(reward, used),
    "tool/reward_without_calls": objectives.masked_mean(reward, 1.0 - used),
  }


def _sets_differ(a: jax.Array, b: jax.Array) -> jax.Array:
  """[..., K] expert index sets -> [...] bool, True where the sets differ."""
  return jnp.any(jnp.sort(a, axis=-1) != jnp.sort(b, axis=-1), axis=-1)


def moe_routing(moe, mb: PolicyBatch) -> Metrics:
  """Routing metrics of one learner forward (§9, §11): disagreement with the sampler's and
  the old policy's expert sets, router preference under replay, aux and z losses."""
  valid = jnp.concatenate([mb.prompt_mask.astype(jnp.float32), mb.loss_mask], axis=1)[..., None]
  valid = jnp.broadcast_to(valid, moe.own_differs.shape)  # [B, S+T, Lm]
  frac = lambda x: objectives.masked_mean(x.astype(jnp.float32), valid)  # noqa: E731
  return jax.lax.stop_gradient(
    {
      "moe/route_disagree_sampler": frac(_sets_differ(moe.routing, mb.sampler_routing)),
      "moe/route_disagree_old": frac(_sets_differ(moe.routing, mb.old_routing)),
      "moe/router_prefers_other": frac(moe.own_differs),
      "moe/aux_loss": moe.aux_loss,
      "moe/z_loss": moe.z_loss,
    }
  )


def moe_load(moe, layers: Sequence[int]) -> Metrics:
  """Expert load of the old policy on this batch: max/mean per layer and a histogram each,
  named by its model layer (`layers`: the model's MoE layers, in order, one per row of load)."""
  if moe is None:
    return {}
  load = moe.load  # [Lm, E]
  assert load.shape[0] == len(layers), (load.shape, layers)  # static: checked when traced
  m = {"moe/load_max_over_mean": jnp.mean(jnp.max(load, -1) / jnp.mean(load, -1))}
  for row, layer in enumerate(layers):
    m[f"hist/moe_load_layer{layer}"] = load[row]
  return m


# Scalars that add up over microbatches: each is one slice of a minibatch-level sum (§5).
SUMMED = ("policy/loss", "policy/total_loss", "kl/loss", "value/loss", "kl/ref_kl")
# The tokens a slice's (microbatch's, then minibatch's) means are over, carried beside its
# metrics to weight their reduction and dropped by `update_summary`: the loss mask m and the
# kept mask m' (§3). A slice that trained no token (dynamic sampling or the overlong filter
# left none) has no entropy, ratio or clip fraction: it must not count as 0.
TOKENS, KEPT = "_tokens", "_kept_tokens"
TOKEN_MEANS = ("policy/", "behaviour/", "value/")  # masked means over m: weighted by TOKENS
OVER_KEPT = ("policy/entropy", "value/mean")  # masked means over m': weighted by KEPT


def token_counts(loss_mask: jax.Array, kept_mask: jax.Array) -> Metrics:
  """{TOKENS, KEPT} of one microbatch: the counts its token means are over."""
  return {
    TOKENS: jnp.sum(loss_mask, dtype=jnp.float32),
    KEPT: jnp.sum(kept_mask, dtype=jnp.float32),
  }


def _reduce(metrics: Metrics, plain) -> Metrics:
  """Stacked slice metrics [N] → one value each: a token mean weighted by its slices' tokens
  (NaN where none had one), a token `_min`/`_max` over the slices that had tokens, the counts
  summed, anything else `plain(key, values)` (so without counts: as before)."""
  out = {}
  for key, v in metrics.items():
    counted = TOKENS in metrics and v.ndim == 1 and key not in SUMMED
    if key in (TOKENS, KEPT):
      out[key] = jnp.sum(v)
    elif counted and key.startswith(TOKEN_MEANS):
      n = metrics[KEPT if key in OVER_KEPT else TOKENS]
      has = n > 0
      if key.endswith(("_min", "_max")):
        pick, fill = (jnp.min, jnp.inf) if key.endswith("_min") else (jnp.max, -jnp.inf)
        out[key] = jnp.where(jnp.any(has), pick(jnp.where(has, v, fill)), jnp.nan)
      else:  # 0 / 0 = NaN: no token, no value
        out[key] = jnp.sum(jnp.where(has, v, 0.0) * n) / jnp.sum(n)
    else:
      out[key] = plain(key, v)
  return out


def microbatch_mean(metrics: Metrics, num_microbatches: int) -> Metrics:
  """Reduces stacked microbatch metrics: the SUMMED slices are summed, token means weighted
  by their microbatches' tokens (`_reduce`), the rest averaged."""
  return _reduce(metrics, lambda k, v: jnp.mean(v) * (num_microbatches if k in SUMMED else 1))


def update_summary(mb_metrics: Metrics) -> Metrics:
  """Per-minibatch metrics [E*M] → one value each (token means weighted by their minibatches'
  tokens, `_reduce`; skipped updates counted; the rest averaged), plus the first minibatch's
  clip fraction."""
  count = "optim/skipped_updates"  # a count over the step's updates
  out = _reduce(mb_metrics, lambda k, v: jnp.sum(v) if k == count else jnp.mean(v))
  out["policy/clip_frac_first_minibatch"] = (
    mb_metrics["policy/clip_frac_low"][0] + mb_metrics["policy/clip_frac_high"][0]
  )
  out.pop(TOKENS, None)
  out.pop(KEPT, None)
  return out


def sequence_advantage(adv: jax.Array, mask: jax.Array) -> jax.Array:
  """One advantage per sequence [B]: A_i, or the masked token mean of a [B, T] advantage."""
  return adv if adv.ndim == 1 else jnp.sum(adv * mask, -1) / jnp.maximum(mask.sum(-1), 1.0)


def step_summary(
  rollout: Rollout,
  reward: jax.Array,
  seq_adv: jax.Array,
  *,
  group_size: int,
  learner_tokens: int,
  learning_rate: jax.Array,
) -> Metrics:
  """Histograms, the text-table samples (the first completion of every prompt, in batch order:
  the loop shows the first `train.text_samples`) and throughput counters of one step (§11)."""
  return {
    "optim/learning_rate": learning_rate,
    "perf/generated_tokens": jnp.sum(rollout.lengths).astype(jnp.float32),  # learn: pre-filter
    "perf/learner_tokens": jnp.float32(learner_tokens),
    "hist/reward": reward,
    "hist/length": rollout.lengths,
    "hist/advantage": seq_adv,
    "samples/prompt": rollout.prompt_tokens[::group_size],
    "samples/tokens": rollout.tokens[::group_size],
    "samples/reward": reward[::group_size],
  }


def grad_norm(grads) -> Metrics:
  """The global gradient norm of one minibatch (before clipping)."""
  return {"optim/grad_norm": optax.tree_utils.tree_norm(grads)}
