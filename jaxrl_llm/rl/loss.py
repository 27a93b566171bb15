"""The learner's loss on one microbatch (spec §2-§5, §8, §9): module-level pure functions.

loss = aggregate_m(−w·J)                     policy (§2), behaviour weight w (§3), §5
       + β·aggregate_m'(k)                   KL in the loss (§4)
       − c_e·aggregate_m'(H)                 entropy bonus (§8)
       + c_v·aggregate_m'(L_V)               critic (§2.9)
       + MoE auxiliary and z losses          (§8)
m is the loss mask; m' = m·1[w > 0] drops the tokens a behaviour correction rejects, so such a
token contributes to no term, value or normaliser (§3). Each mask has its own normaliser,
computed once per optimiser minibatch (`normalizers`), so summing microbatch losses gives the
minibatch loss exactly (§5).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm import objectives
from jaxrl_llm.config.fields import is_on
from jaxrl_llm.config.learner import Settings
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.rl import metrics as rl_metrics
from jaxrl_llm.rl import stages
from jaxrl_llm.sampling import Scores, score
from jaxrl_llm.types import PolicyBatch

Metrics = dict[str, jax.Array]


@struct.dataclass
class Normalizers:
  """Minibatch-level aggregation normalisers (§5) of the two masks of the loss."""

  policy: jax.Array  # [] of the loss mask m (policy term)
  kept: jax.Array  # [] of m' = m·1[w > 0] (KL, entropy and value terms)
  tokens: jax.Array  # [] Σ m, for token means of metrics that add up over microbatches


def kept_mask(mb: PolicyBatch) -> jax.Array:
  """m' = m·1[w > 0] [B, T]: the loss mask without the tokens the correction rejected (§3).

  Without w in the batch (computed in the loss) the correction never rejects: m' = m.
  """
  if mb.weight is None:
    return mb.loss_mask
  return mb.loss_mask * (mb.weight > 0).astype(mb.loss_mask.dtype)


def on_policy_inputs(sc: Scores, mb: PolicyBatch, norms: Normalizers, settings: Settings):
  """ℓ^old = sg[ℓ] and the §3 weight from it when the batch has no old pass; else as given.

  `kl/ref_kl` is this microbatch's share of the minibatch token mean (summed over microbatches,
  `metrics.SUMMED`); the behaviour/* scalars are averaged over microbatches.
  """
  if mb.old_logp is not None:
    return mb, {}
  old = jax.lax.stop_gradient(sc.logp)
  weight, metrics = stages.behaviour_weight(
    old, mb.behaviour_logp, mb.loss_mask, settings.correction
  )
  if mb.ref_logp is not None:
    k1, _ = stages.reference_kl(old, mb.ref_logp, mb.loss_mask)
    metrics["kl/ref_kl"] = jnp.sum(k1 * mb.loss_mask) / jnp.maximum(norms.tokens, 1.0)
  return mb.replace(old_logp=old, weight=weight), metrics


def normalizers(mb: PolicyBatch, settings: Settings, max_len: int) -> Normalizers:
  """The §5 normalisers of a whole minibatch, for both masks."""
  agg = settings.aggregation
  norm = lambda m: objectives.normalizer(  # noqa: E731
    m, agg.name, max_len, sum_norm_sequences=agg.sum_norm_sequences
  )
  return Normalizers(
    policy=norm(mb.loss_mask), kept=norm(kept_mask(mb)), tokens=jnp.sum(mb.loss_mask)
  )


def objective_inputs(spec: objectives.ObjectiveSpec, sc: Scores, mb: PolicyBatch, max_len: int):
  """The extra inputs a registry row declares, computed from the scores and the batch."""
  if not spec.inputs:
    return {}
  s = mb.prompt_tokens.shape[1]
  window = slice(s - 1, s - 1 + max_len)  # router log-probs at each completion token's logits
  available = {
    "router_logp": lambda: sc.moe.probe_logprobs[:, window],
    "old_router_logp": lambda: mb.old_router_logp[:, window],
  }
  return {name: available[name]() for name in spec.inputs}


def policy_term(sc: Scores, mb: PolicyBatch, norm: jax.Array, settings: Settings, max_len: int):
  """aggregate(−w·J) of the configured objective and its §11 metrics (§2, §3, §5).

  For a sequence objective (gspo, gmpo, rspo) a per-token weight w becomes the sequence's
  weight by its masked mean over the completion (§3; `objectives.policy_loss`).
  """
  spec = settings.objective.spec
  loss, metrics = objectives.policy_loss(
    sc.logp,
    mb.old_logp,
    mb.adv,
    mb.loss_mask,
    objective=spec.name,
    aggregation=settings.aggregation.name,
    behaviour_weight=mb.weight,
    max_len=max_len,
    normalizer=norm,
    **objective_inputs(spec, sc, mb, max_len),
    **settings.objective.hyperparameters,
  )
  ratio = jnp.exp(jnp.clip(sc.logp - mb.old_logp, -20.0, 20.0))
  ratio_mean = objectives.masked_mean(ratio, mb.loss_mask)
  metrics["policy/ratio_var"] = jax.lax.stop_gradient(
    objectives.masked_mean((ratio - ratio_mean) ** 2, mb.loss_mask)
  )
  return loss, metrics


def add_regularizers(
  loss, sc: Scores, mb: PolicyBatch, norm: jax.Array, settings: Settings, max_len: int
):
  """`loss` plus the KL in the loss (§4), the entropy bonus (§8) and the critic (§2.9), each
  over the kept mask m' with its own minibatch normaliser `norm`."""
  mask, agg_name = kept_mask(mb), settings.aggregation.name
  agg = lambda x: objectives.aggregate(x, mask, agg_name, max_len=max_len, normalizer=norm)  # noqa: E731
  metrics = {}
  kl = settings.kl
  if is_on(kl.beta) and kl.placement == "loss":
    k = objectives.kl_penalty(
      sc.logp, mb.ref_logp, mb.old_logp, estimator=kl.name, mask=mask, k3_clamp=kl.k3_clamp
    )
    metrics["kl/loss"] = agg(k)
    loss = loss + kl.beta * metrics["kl/loss"]
  entropy = sc.entropy  # of the τ_s-scaled distribution, float32
  if is_on(settings.rl.entropy_coef):
    loss = loss - settings.rl.entropy_coef * agg(entropy)
  metrics["policy/entropy"] = objectives.masked_mean(jax.lax.stop_gradient(entropy), mask)
  if sc.values is not None and mb.returns is not None:
    o = settings.objective
    vl = objectives.value_loss(sc.values, mb.old_values, mb.returns, mask, o.value_clip)
    metrics["value/loss"] = agg(vl)
    loss = loss + o.value_coef * metrics["value/loss"]
    metrics["value/mean"] = objectives.masked_mean(jax.lax.stop_gradient(sc.values), mask)
  return loss, metrics


def loss_from_scores(
  sc: Scores, mb: PolicyBatch, norms: Normalizers, *, settings: Settings, max_len: int, moe=None
) -> tuple[jax.Array, Metrics]:
  """The loss and metrics of one microbatch given the learner's scores of it."""
  mb, on_policy_metrics = on_policy_inputs(sc, mb, norms, settings)
  total, metrics = policy_term(sc, mb, norms.policy, settings, max_len)
  metrics.update(on_policy_metrics)
  if moe is not None:
    total = total + moe.aux_loss_coef * sc.moe.aux_loss + moe.z_loss_coef * sc.moe.z_loss
    metrics.update(rl_metrics.moe_routing(sc.moe, mb))
  total, reg_metrics = add_regularizers(total, sc, mb, norms.kept, settings, max_len)
  metrics.update(reg_metrics)
  metrics.update(rl_metrics.token_counts(mb.loss_mask, kept_mask(mb)))
  metrics["policy/total_loss"] = total
  return total, metrics


def prompt_block(prompt_group: int, rows: int) -> int:
  """Rows per shared-prompt block in a slice of `rows` group-major rows: gcd(G, rows)."""
  return math.gcd(prompt_group, rows)


def loss(
  params,
  mb: PolicyBatch,
  norms: Normalizers,
  *,
  model: Transformer,
  settings: Settings,
  temperature: float,
  max_len: int,
  prompt_group: int = 1,
  dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
  """The microbatch loss `(params, mb, norms) -> (loss, metrics)` of spec §2-§5, §8, §9.

  `prompt_group` G > 1: the rows come in blocks of `prompt_block(G, rows)` sharing a prompt
  (`update.optimise` arranges them so), each prompt run once per block. `dropout_key`: the
  adapters' dropout in this (differentiated) pass (`model.lora_dropout`); None: none.
  """
  probe = "router_logp" in settings.objective.spec.inputs
  sc = score(
    model,
    params,
    mb.prompt_tokens,
    mb.prompt_mask,
    mb.tokens,
    temperature,
    routing=mb.replay,
    probe_experts=mb.old_routing if probe else None,
    group_size=prompt_block(prompt_group, mb.tokens.shape[0]),
    completion_mask=mb.loss_mask if model.cfg.moe_layers else None,
    dropout_key=dropout_key,
  )
  return loss_from_scores(sc, mb, norms, settings=settings, max_len=max_len, moe=model.cfg.moe)
