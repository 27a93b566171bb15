"""The fused RL update: sample → score → filter → advantages → old/ref log-probs → learn.

`make_rl_step` binds the static pieces (model, optimiser, verifier, settings) and returns an
`RLProgram` whose `step` is ONE jitted function `(TrainState, PromptBatch, rng) -> (TrainState,
metrics)` with explicit shardings and the state donated: nothing leaves the device between
sampling and learning. Its `sample` and `learn` halves serve verifiers that must run on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import objectives, quant
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.sampling import SamplingConfig, sample, score
from jaxrl_llm.types import PromptBatch, Rollout, TrainState


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """Static settings of the learner half of the step (built from the config sections)."""

  num_epochs: int = 1  # passes over the rollout
  num_minibatches: int = 1  # optimiser steps per epoch
  num_microbatches: int = 1  # gradient-accumulation slices of one minibatch
  entropy_coef: float = 0.0  # c_e of the entropy bonus (§8)
  advantage: str = "grpo"  # §1 estimator
  whiten: bool = False  # whiten advantages over the batch (§1)
  gae_gamma: float = 1.0  # γ of GAE
  gae_lambda: float = 0.95  # λ of GAE
  objective: str = "ppo_clip"  # §2 objective
  objective_kwargs: tuple[tuple[str, Any], ...] = (("clip_low", 0.2), ("clip_high", 0.2))
  value_coef: float = 0.5  # c_v of the clipped value loss (§2.9)
  value_clip: float = 0.2  # ε_v of the clipped value loss (§2.9)
  aggregation: str = "seq_mean_token_mean"  # §5
  correction: str = "none"  # §3, e.g. "tis_token" or "tis_token+geo_mask"
  correction_cap: float = 2.0  # C of §3
  geo_low: float = 0.0  # C_low of geo_mask
  geo_high: float | None = None  # C_high of geo_mask (None = correction_cap)
  kl_beta: float = 0.0  # β (0 = no reference forward pass)
  kl_estimator: str = "k3"  # §4
  kl_placement: str = "loss"  # "loss" | "reward"
  ref_update: str = "frozen"  # "frozen" | "reset_every" | "ema"
  ref_reset_every: int = 0  # N of reset_every
  ref_ema: float = 0.0  # α of ema
  ref_reset_optimizer: bool = False  # reset optimiser state when the reference is reset
  overlong_penalty: bool = False  # DAPO soft overlong punishment as a reward term (§6)
  overlong_cache_len: int = 0  # L_cache of §6
  overlong_weight: float = 1.0  # weight of the overlong reward term
  overlong_filter: bool = False  # truncated completions get no gradient (§6)
  replay: str = "none"  # §9 routing replay: "none" | "r2" | "r3" (MoE only)
  gamma_min: float = 0.1  # γ_min of RSPO's router-shift weight (§2.8)
  filtering: str = "none"  # §7: "none" | "dynamic_sampling" | "reinforce_rej"
  keep_prompts: int = 0  # P groups kept by dynamic sampling (0 = every sampled group)
  reward_weights: tuple[tuple[str, float], ...] = (("correct", 1.0),)  # §6 weights


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
    m["rollout/length_correct_mean"] = objectives.masked_mean(lengths, correct)
    m["rollout/length_incorrect_mean"] = objectives.masked_mean(lengths, ones - correct)
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


def terminal_rewards(reward: jax.Array, lengths: jax.Array, t_max: int) -> jax.Array:
  """Per-token rewards [B, T] for GAE: the sequence reward on its last token, 0 elsewhere."""
  last = jnp.clip(lengths - 1, 0, t_max - 1)
  return jax.nn.one_hot(last, t_max, dtype=jnp.float32) * reward[:, None]


def _sets_differ(a: jax.Array, b: jax.Array) -> jax.Array:
  """[..., K] expert index sets -> [...] bool, True where the sets differ."""
  return jnp.any(jnp.sort(a, axis=-1) != jnp.sort(b, axis=-1), axis=-1)


def moe_metrics(moe, mb, mask) -> dict[str, jax.Array]:
  """Routing metrics of one learner forward (§9, §11): disagreement with the sampler's and
  the old policy's expert sets, router preference under replay, aux and z losses."""
  valid = jnp.concatenate([mb["prompt_mask"].astype(jnp.float32), mask], axis=1)[..., None]
  valid = jnp.broadcast_to(valid, moe.own_differs.shape)  # [B, S+T, Lm]
  frac = lambda x: objectives.masked_mean(x.astype(jnp.float32), valid)  # noqa: E731
  return jax.lax.stop_gradient(
    {
      "moe/route_disagree_sampler": frac(_sets_differ(moe.routing, mb["sampler_routing"])),
      "moe/route_disagree_old": frac(_sets_differ(moe.routing, mb["old_routing"])),
      "moe/router_prefers_other": frac(moe.own_differs),
      "moe/aux_loss": moe.aux_loss,
      "moe/z_loss": moe.z_loss,
    }
  )


def make_loss_fn(model: Transformer, sampling: SamplingConfig, rl: RLConfig):
  """The per-microbatch loss `(params, mb, norm) -> (loss, metrics)` of spec §2-§5, §8.

  `norm` is the minibatch-level aggregation normaliser, so summing microbatch losses gives the
  minibatch loss exactly (§5).
  """
  obj_kwargs = dict(rl.objective_kwargs)
  max_len = sampling.max_new_tokens
  moe_cfg = model.cfg.moe
  agg = lambda x, m, n: objectives.aggregate(x, m, rl.aggregation, max_len=max_len, normalizer=n)  # noqa: E731

  def loss_fn(params, mb, norm):
    rspo = rl.objective == "rspo"
    sc = score(
      model,
      params,
      mb["prompt_tokens"],
      mb["prompt_mask"],
      mb["tokens"],
      sampling.temperature,
      routing=mb.get("replay"),
      probe_experts=mb["old_routing"] if rspo else None,
    )
    mask = mb["loss_mask"]
    kwargs = dict(obj_kwargs)
    if rspo:  # router-shift weight of each token's logits position (§2.8)
      s = mb["prompt_tokens"].shape[1]
      window = slice(s - 1, s - 1 + max_len)
      kwargs["router_gamma"] = objectives.router_shift_gamma(
        sc.moe.probe_logprobs[:, window], mb["old_router_logp"][:, window], gamma_min=rl.gamma_min
      )
    loss, metrics = objectives.policy_loss(
      sc.logp,
      mb["old_logp"],
      mb["adv"],
      mask,
      objective=rl.objective,
      aggregation=rl.aggregation,
      behaviour_weight=mb["weight"],
      max_len=max_len,
      normalizer=norm,
      **kwargs,
    )
    ratio = jnp.exp(jnp.clip(sc.logp - mb["old_logp"], -20.0, 20.0))
    ratio_mean = objectives.masked_mean(ratio, mask)
    metrics["policy/ratio_var"] = jax.lax.stop_gradient(
      objectives.masked_mean((ratio - ratio_mean) ** 2, mask)
    )
    if moe_cfg is not None:
      loss = loss + moe_cfg.aux_loss_coef * sc.moe.aux_loss + moe_cfg.z_loss_coef * sc.moe.z_loss
      metrics.update(moe_metrics(sc.moe, mb, mask))
    if rl.kl_beta > 0 and rl.kl_placement == "loss":
      kl = objectives.kl_penalty(
        sc.logp, mb["ref_logp"], mb["old_logp"], estimator=rl.kl_estimator, mask=mask
      )
      kl_loss = agg(kl, mask, norm)
      loss = loss + rl.kl_beta * kl_loss
      metrics["kl/loss"] = kl_loss
    # float32 entropy of the temperature-scaled distribution (§8); bonus only when c_e > 0.
    entropy = objectives.entropy_from_logits(sc.logits, 1.0)
    ent = agg(entropy, mask, norm)
    if rl.entropy_coef:
      loss = loss - rl.entropy_coef * ent
    metrics["policy/entropy"] = objectives.masked_mean(jax.lax.stop_gradient(entropy), mask)
    if sc.values is not None and rl.objective == "ppo_critic":
      vl = objectives.value_loss(sc.values, mb["old_values"], mb["returns"], mask, rl.value_clip)
      v_loss = agg(vl, mask, norm)
      loss = loss + rl.value_coef * v_loss
      metrics["value/loss"] = v_loss
      metrics["value/mean"] = objectives.masked_mean(jax.lax.stop_gradient(sc.values), mask)
    metrics["policy/total_loss"] = loss
    return loss, metrics

  return loss_fn


def make_rl_step(
  model: Transformer,
  optimizer: optax.GradientTransformation,
  schedule: optax.Schedule,
  reward_fn: Callable[..., dict[str, jax.Array]],
  sampling: SamplingConfig,
  rl: RLConfig,
  mesh: Mesh,
  state_shardings: Any,
  *,
  sampler_dtype: str = "float32",
) -> RLProgram:
  """Builds the jitted RL programs (fused step, and the sample / learn halves).

  `reward_fn(prompt_tokens, completion, completion_mask, answer, answer_mask)` returns named
  [B] reward terms (a pure JAX verifier). The sampler runs on `sampler_dtype`'s copy of the
  policy (float32 | bfloat16 | int8). `reward_fn` may be None for the host-reward path only.
  """
  g = sampling.group_size
  t_max = sampling.max_new_tokens
  weights = dict(rl.reward_weights)
  if rl.overlong_penalty:
    weights["overlong"] = rl.overlong_weight
  updates_per_step = rl.num_epochs * rl.num_minibatches
  batch_axis = NamedSharding(mesh, PartitionSpec("data"))
  sampler_model = model
  if sampler_dtype == "bfloat16":
    sampler_model = Transformer(dataclasses.replace(model.cfg, dtype="bfloat16"))
  loss_fn = make_loss_fn(model, sampling, rl)

  def constrain(tree):
    return jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(x, batch_axis) if x.ndim else x, tree
    )

  def minibatch_update(carry, mb):
    params, opt_state = carry
    norm = objectives.normalizer(mb["loss_mask"], rl.aggregation, t_max)
    k = rl.num_microbatches
    micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), mb)

    def accumulate(grads, one):
      (_, metrics), g_one = jax.value_and_grad(loss_fn, has_aux=True)(params, one, norm)
      return jax.tree.map(jnp.add, grads, g_one), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, metrics = jax.lax.scan(accumulate, zeros, micro)
    metrics = jax.tree.map(jnp.mean, metrics)
    for key in ("policy/loss", "policy/total_loss", "kl/loss", "value/loss"):
      if key in metrics:  # losses add up over microbatches (each is a slice of one sum)
        metrics[key] = metrics[key] * k
    metrics["optim/grad_norm"] = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), metrics

  def update_reference(state: TrainState, params, opt_state):
    """Reference policy update after the step (§4): frozen, reset_every N, or EMA."""
    ref = state.ref_params
    if ref is None or rl.ref_update == "frozen":
      return ref, opt_state
    if rl.ref_update == "ema":
      a = rl.ref_ema
      return jax.tree.map(lambda r, p: a * p + (1.0 - a) * r, ref, params), opt_state
    reset = (state.step + 1) % rl.ref_reset_every == 0
    ref = jax.tree.map(lambda r, p: jnp.where(reset, p, r), ref, params)
    if rl.ref_reset_optimizer:
      fresh = optimizer.init(params)
      opt_state = jax.tree.map(lambda o, f: jnp.where(reset, f, o), opt_state, fresh)
    return ref, opt_state

  def sample_phase(state: TrainState, batch: PromptBatch, rng: jax.Array) -> Rollout:
    """Samples G completions per prompt with the sampler's copy of the policy."""
    sample_key, _ = jax.random.split(rng)
    policy = quant.sampler_params(state.params, sampler_dtype)
    return constrain(sample(sampler_model, policy, batch.tokens, batch.mask, sample_key, sampling))

  def learn_phase(state: TrainState, rollout: Rollout, terms: dict[str, jax.Array], rng):
    """Shaping, filtering, advantages, old/ref passes and the optimiser steps."""
    _, shuffle_key = jax.random.split(rng)
    terms = {k: jnp.asarray(v, jnp.float32) for k, v in terms.items()}
    if rl.overlong_penalty:
      terms["overlong"] = objectives.soft_overlong(
        rollout.lengths, rollout.truncated, t_max, rl.overlong_cache_len
      )
    reward = sum(w * terms[name] for name, w in weights.items() if w)
    reward = jnp.asarray(reward, jnp.float32) * jnp.ones(rollout.lengths.shape, jnp.float32)

    metrics: dict[str, jax.Array] = {}
    num_groups = rollout.lengths.shape[0] // g
    if rl.filtering == "dynamic_sampling":
      idx, group_valid, fm = objectives.dynamic_sampling(reward, g, rl.keep_prompts)
      metrics.update(fm)
      sampled = rollout.lengths.shape[0]
      take = lambda x: x[idx] if x.ndim and x.shape[0] == sampled else x  # noqa: E731
      rollout, reward, terms = jax.tree.map(take, (rollout, reward, terms))
      rollout = constrain(rollout)
    elif rl.filtering == "reinforce_rej":
      group_valid = objectives.reinforce_rej(reward, g)
      metrics["filter/zero_std_frac"] = 1.0 - jnp.mean(group_valid.astype(jnp.float32))
      metrics["filter/groups_used"] = jnp.sum(group_valid.astype(jnp.float32))
    else:
      group_valid = jnp.ones((num_groups,), bool)
    seq_valid = objectives.expand_groups(group_valid, g)
    mask = rollout.loss_mask * seq_valid[:, None].astype(jnp.float32)
    if rl.overlong_filter:
      mask = objectives.overlong_filter(mask, rollout.truncated)

    score_fn = lambda p, routing=None: score(  # noqa: E731
      model,
      p,
      rollout.prompt_tokens,
      rollout.prompt_mask,
      rollout.tokens,
      sampling.temperature,
      routing=routing,
    )
    old = jax.lax.stop_gradient(
      score_fn(state.params, rollout.routing if rl.replay == "r3" else None)
    )
    data = {
      "prompt_tokens": rollout.prompt_tokens,
      "prompt_mask": rollout.prompt_mask,
      "tokens": rollout.tokens,
      "loss_mask": mask,
      "old_logp": old.logp,
    }
    if old.moe is not None:  # routing masks travel with their sequences through minibatching
      data["sampler_routing"] = rollout.routing
      data["old_routing"] = old.moe.routing
      data["old_router_logp"] = old.moe.used_logprobs
      if rl.replay == "r2":
        data["replay"] = old.moe.routing
      elif rl.replay == "r3":
        data["replay"] = rollout.routing
      load = old.moe.load  # [Lm, E] expert load of the old policy on this batch
      metrics["moe/load_max_over_mean"] = jnp.mean(jnp.max(load, -1) / jnp.mean(load, -1))
      for i in range(load.shape[0]):
        metrics[f"hist/moe_load_layer{i}"] = load[i]
    adv_reward = reward
    if rl.kl_beta > 0:
      ref_logp = jax.lax.stop_gradient(score_fn(state.ref_params).logp)
      data["ref_logp"] = ref_logp
      k1 = objectives.kl_penalty(old.logp, ref_logp, estimator="k1", mask=mask)
      metrics["kl/ref_kl"] = jnp.sum(k1 * mask) / jnp.maximum(jnp.sum(mask), 1.0)
      if rl.kl_placement == "reward" and rl.advantage != "gae":
        adv_reward = reward - rl.kl_beta * jnp.sum(k1 * mask, axis=-1)
    if rl.advantage == "gae":
      token_r = terminal_rewards(reward, rollout.lengths, t_max)
      if rl.kl_beta > 0 and rl.kl_placement == "reward":
        token_r = token_r - rl.kl_beta * k1 * mask
      adv, returns = objectives.gae(token_r, old.values, mask, rl.gae_gamma, rl.gae_lambda)
      data["old_values"], data["returns"] = old.values, returns
    else:
      adv = objectives.get_advantage(rl.advantage)(adv_reward, g, valid=seq_valid)
    if rl.whiten:
      adv = objectives.whiten(adv, mask if adv.ndim == 2 else seq_valid.astype(jnp.float32))
    data["adv"] = adv
    weight, behaviour = objectives.behaviour_weight(
      old.logp,
      rollout.logprobs,
      mask,
      name=rl.correction,
      cap=rl.correction_cap,
      geo_low=rl.geo_low,
      geo_high=rl.geo_high,
    )
    data["weight"] = weight
    metrics.update(behaviour)

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
    ref_params, opt_state = update_reference(state, params, opt_state)

    seq_adv = adv if adv.ndim == 1 else jnp.sum(adv * mask, -1) / jnp.maximum(mask.sum(-1), 1.0)
    metrics.update(rollout_metrics(rollout, terms, reward, seq_adv, g))
    metrics.update(jax.tree.map(jnp.mean, mb_metrics))
    metrics["policy/clip_frac_first_minibatch"] = (
      mb_metrics["policy/clip_frac_low"][0] + mb_metrics["policy/clip_frac_high"][0]
    )
    metrics["optim/learning_rate"] = schedule(state.step * updates_per_step)
    metrics["perf/generated_tokens"] = jnp.sum(rollout.lengths).astype(jnp.float32)
    metrics["perf/learner_tokens"] = jnp.float32(
      b * (t_max + rollout.prompt_tokens.shape[1]) * rl.num_epochs
    )
    n_show = min(8, b // g)
    metrics["hist/reward"] = reward
    metrics["hist/length"] = rollout.lengths
    metrics["hist/advantage"] = seq_adv
    metrics["samples/prompt"] = rollout.prompt_tokens[::g][:n_show]
    metrics["samples/tokens"] = rollout.tokens[::g][:n_show]
    metrics["samples/reward"] = reward[::g][:n_show]
    new_state = state.replace(
      step=state.step + 1, params=params, opt_state=opt_state, ref_params=ref_params
    )
    return new_state, metrics

  def step(state: TrainState, batch: PromptBatch, rng: jax.Array):
    rollout = sample_phase(state, batch, rng)
    answer = jnp.repeat(batch.answer, g, axis=0)
    answer_mask = jnp.repeat(batch.answer_mask, g, axis=0)
    terms = reward_fn(rollout.prompt_tokens, rollout.tokens, rollout.loss_mask, answer, answer_mask)
    return learn_phase(state, rollout, terms, rng)

  repl = NamedSharding(mesh, PartitionSpec())
  batch_shardings = PromptBatch(
    tokens=batch_axis, mask=batch_axis, answer=batch_axis, answer_mask=batch_axis
  )
  return RLProgram(
    step=jax.jit(
      step,
      in_shardings=(state_shardings, batch_shardings, repl),
      out_shardings=(state_shardings, repl),
      donate_argnums=(0,),
    ),
    sample=jax.jit(sample_phase, in_shardings=(state_shardings, batch_shardings, repl)),
    learn=jax.jit(learn_phase, out_shardings=(state_shardings, repl), donate_argnums=(0,)),
  )


@dataclasses.dataclass(frozen=True)
class RLProgram:
  """The jitted programs of one RL update.

  `step(state, batch, rng)` is the fused update (sampling, a pure-JAX verifier and learning in
  one program). Verifiers that need Python (decoded text, external checkers) use the
  host-reward path instead: `rollout = sample(state, batch, rng)`, reward terms computed on the
  host from the rollout, then `learn(state, rollout, terms, rng)`; the same rng gives the same
  update as the fused step for the same rewards.
  """

  step: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
  sample: Callable[..., Rollout]
  learn: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
