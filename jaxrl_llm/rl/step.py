"""The fused RL update: sample → score → learn, ONE jitted program with the state donated.

`make_rl_step` binds the static pieces (a `Learner`: model, optimiser, settings) to the
module-level functions below and jits them once each:
  step(state, batch, rng)          sampling, a pure-JAX verifier and `learn` in one program
  sample(state, batch, rng)        the sampler alone (host verifiers score its rollout) ...
  learn(state, rollout, terms, rng) ... then the learner; the same rng gives the same update
Nothing leaves the device between generating a token and applying the gradient in `step`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import optim, quant, sharding
from jaxrl_llm.config.fields import is_on
from jaxrl_llm.config.learner import Settings
from jaxrl_llm.kernels import attention
from jaxrl_llm.models import lora
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.rl import loss, stages, update
from jaxrl_llm.rl import metrics as rl_metrics
from jaxrl_llm.sampling import SamplingConfig, sample
from jaxrl_llm.sampling import with_values as with_sampling_values
from jaxrl_llm.turns import final_segment
from jaxrl_llm.types import PromptBatch, Rollout, TrainState


@dataclasses.dataclass(frozen=True)
class Learner:
  """The static pieces of one RL update (bound once; never traced)."""

  model: Transformer  # the policy (and reference) network
  sampler_model: Transformer  # the policy network at the sampler's compute dtype
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule  # learning rate per optimiser update (for the metrics)
  sampling: SamplingConfig  # G, T, τ_s and the decoding rule
  settings: Settings  # every learner config section
  sampler_dtype: str  # the sampler's copy of the weights: float32 | bfloat16 | int8 | int4
  batch_sharding: NamedSharding  # rows over the batch mesh axes (data x fsdp x expert)
  prompt_group: int = 1  # G when learner passes run each prompt once per group, else 1
  decode_shardings: Any = None  # the sampler's weight layout (FSDP gathered), None = as stored
  rebuild_optimizer: Callable[[Any], tuple] | None = (
    None  # {optim field: value} -> (optimizer, schedule)
  )

  def with_values(self, values: Mapping[str, jax.Array] | None) -> Learner:
    """This learner with traced values (a pack's per-run or a single run's own; dotted field) in
    place of the settings they name (see `run.pack.packable_fields`); None: itself."""
    if not values:
      return self
    optimizer, schedule = self.optimizer, self.schedule
    optim = {k.partition(".")[2]: v for k, v in values.items() if k.startswith("optim.")}
    if optim:  # a per-run peak rate: the schedule scales it
      optimizer, schedule = self.rebuild_optimizer(optim)
    return dataclasses.replace(
      self,
      sampling=with_sampling_values(self.sampling, values),
      settings=self.settings.with_values(values),
      optimizer=optimizer,
      schedule=schedule,
    )

  @property
  def score_chunks(self) -> int:
    """Slices of the batch the old and reference passes score one after another: as many as
    the learner's microbatches over all minibatches, so a pass holds one microbatch's
    activations (the learner's own bound)."""
    return self.settings.rl.num_minibatches * self.settings.rl.num_microbatches

  @property
  def loss_fn(self):
    """The microbatch loss `(params, mb, norms) -> (loss, metrics)` with everything bound."""
    return functools.partial(
      loss.loss,
      model=self.model,
      settings=self.settings,
      temperature=self.sampling.temperature,
      max_len=self.sampling.max_new_tokens,
      prompt_group=self.prompt_group,
    )


def constrain(tree, sharding: NamedSharding):
  """Pins every non-scalar leaf's rows to the data axis (after gathers that may move them)."""
  return jax.tree.map(
    lambda x: jax.lax.with_sharding_constraint(x, sharding) if x.ndim else x, tree
  )


def sample_phase(
  ctx: Learner, state: TrainState, batch: PromptBatch, rng: jax.Array, values=None
) -> Rollout:
  """G completions per prompt from the sampler's copy of the policy (§0: records ℓ^μ)."""
  ctx = ctx.with_values(values)
  sample_key, _ = jax.random.split(rng)
  policy = quant.sampler_params(state.params, ctx.sampler_dtype)
  if ctx.decode_shardings is not None:  # one gather per RL step, before the decode loop
    policy = jax.lax.with_sharding_constraint(policy, ctx.decode_shardings)
  policy = quant.fuse_projections(policy)  # one qkv and one gate-up matmul a layer
  rollout = sample(ctx.sampler_model, policy, batch.tokens, batch.mask, sample_key, ctx.sampling)
  return constrain(rollout, ctx.batch_sharding)


def rewards_and_mask(ctx: Learner, rollout: Rollout, terms):
  """Total reward (§6), group filtering (§7) and the loss mask m (§0, §6)."""
  s, g = ctx.settings, ctx.sampling.group_size
  reward, terms = stages.total_reward(
    rollout, terms, s.shaping, s.reward_weights, ctx.sampling.max_new_tokens
  )
  rollout, reward, terms, seq_valid, metrics = stages.filter_groups(
    rollout, reward, terms, s.filtering, g, s.rl.num_prompts
  )
  rollout = constrain(rollout, ctx.batch_sharding)
  return rollout, reward, terms, seq_valid, stages.loss_mask(rollout, seq_valid, s.shaping), metrics


def on_policy_batch(ctx: Learner, state: TrainState, rollout, reward, seq_valid, mask):
  """The batch without an old pass (ℓ^old = sg[ℓ], §0): w and its metrics come from the loss."""
  s = ctx.settings
  ref_logp = None
  if is_on(s.kl.beta):  # in the loss (`skips_old_pass` excludes the reward placement)
    ref_logp = stages.rescore(
      ctx.model,
      update.reference_params(state),
      rollout,
      ctx.sampling.temperature,
      prompt_group=ctx.prompt_group,
      chunks=ctx.score_chunks,
    ).logp
  valid = stages.stats_rows(rollout, seq_valid, s.shaping)
  adv, _ = stages.advantages(
    reward, rollout, mask, valid, None, None, s.advantage, s.kl, ctx.sampling.group_size
  )
  return stages.policy_batch(
    rollout, mask, None, adv, None, returns=None, replay="none", ref_logp=ref_logp
  ), {}


def make_policy_batch(ctx: Learner, state: TrainState, rollout, reward, seq_valid, mask):
  """Old pass (§0, §9), reference pass (§4), advantages (§1), behaviour weight (§3)."""
  s, temp = ctx.settings, ctx.sampling.temperature
  if s.skips_old_pass(ctx.model.cfg.moe is not None):
    return on_policy_batch(ctx, state, rollout, reward, seq_valid, mask)
  old = stages.old_pass(
    ctx.model, state.params, rollout, temp, s.replay.name, ctx.prompt_group, ctx.score_chunks
  )
  metrics = rl_metrics.moe_load(old.moe, ctx.model.cfg.moe_layers)
  ref_logp = kl_tok = None
  if is_on(s.kl.beta):
    ref_logp, kl_tok, ref_metrics = stages.reference_pass(
      ctx.model,
      update.reference_params(state),
      rollout,
      old.logp,
      mask,
      temp,
      ctx.prompt_group,
      ctx.score_chunks,
    )
    metrics.update(ref_metrics)
  valid = stages.stats_rows(rollout, seq_valid, s.shaping)
  adv, returns = stages.advantages(
    reward, rollout, mask, valid, old.values, kl_tok, s.advantage, s.kl, ctx.sampling.group_size
  )
  weight, behaviour = stages.behaviour_weight(old.logp, rollout.logprobs, mask, s.correction)
  metrics.update(behaviour)
  batch = stages.policy_batch(
    rollout,
    mask,
    old,
    adv,
    weight,
    returns=returns,
    replay=s.replay.name,
    ref_logp=ref_logp if s.kl.placement == "loss" else None,
  )
  return batch, metrics


def learn(ctx: Learner, state: TrainState, rollout: Rollout, terms, rng: jax.Array, values=None):
  """The learn phase, the spec's stages in order; returns (new state, metrics)."""
  ctx = ctx.with_values(values)
  s = ctx.settings
  _, shuffle_key = jax.random.split(rng)
  generated = jnp.sum(rollout.lengths).astype(jnp.float32)  # every row, those §7 drops too
  rollout, reward, terms, seq_valid, mask, metrics = rewards_and_mask(ctx, rollout, terms)
  batch, batch_metrics = make_policy_batch(ctx, state, rollout, reward, seq_valid, mask)
  params, opt_state, mb_metrics = update.optimise(  # §2-§5
    ctx.loss_fn,
    ctx.optimizer,
    state.params,
    state.opt_state,
    batch,
    shuffle_key,
    settings=s,
    max_len=ctx.sampling.max_new_tokens,
    prompt_group=ctx.prompt_group,
    dropout_key=update.adapter_dropout_key(ctx.model.cfg, shuffle_key),  # None: dropout off
  )
  ref_params, opt_state = update.update_reference(  # §4
    state, params, opt_state, kl=s.kl, optimizer=ctx.optimizer
  )
  seq_adv = rl_metrics.sequence_advantage(batch.adv, mask)
  metrics.update(batch_metrics)
  metrics.update(step_metrics(ctx, opt_state, rollout, terms, reward, seq_adv, mb_metrics))
  metrics["perf/generated_tokens"] = generated
  new_state = state.replace(
    step=state.step + 1, params=params, opt_state=opt_state, ref_params=ref_params
  )
  return new_state, metrics


def step_metrics(ctx: Learner, opt_state, rollout, terms, reward, seq_adv, mb_metrics):
  """Rollout, optimiser and summary metrics of one update (§11); `optim/learning_rate` is the
  rate the last applied update used, read from the step's new `opt_state`."""
  rl, g = ctx.settings.rl, ctx.sampling.group_size
  b, s = rollout.prompt_tokens.shape
  m = rl_metrics.rollout_metrics(rollout, terms, reward, seq_adv, g)
  m.update(rl_metrics.update_summary(mb_metrics))
  m.update(
    rl_metrics.step_summary(
      rollout,
      reward,
      seq_adv,
      group_size=g,
      learner_tokens=b * (ctx.sampling.max_new_tokens + s) * rl.num_epochs,
      learning_rate=optim.applied_rate(ctx.schedule, opt_state),
    )
  )
  return m


def fused_step(
  ctx: Learner, reward_fn, state: TrainState, batch: PromptBatch, rng: jax.Array, values=None
):
  """Sample, score with the pure-JAX verifier `reward_fn`, learn: one RL update. `values`:
  a run's traced settings (dotted field -> traced scalar: a pack's per-run values, or a single
  run's own, `run.assemble.own_values`), None: every setting a constant."""
  ctx = ctx.with_values(values)
  rollout = sample_phase(ctx, state, batch, rng)
  g = ctx.sampling.group_size
  answer = jnp.repeat(batch.answer, g, axis=0)
  answer_mask = jnp.repeat(batch.answer_mask, g, axis=0)
  tokens, mask = final_segment(rollout)  # after a tool's last answer (multi-turn)
  terms = reward_fn(rollout.prompt_tokens, tokens, mask, answer, answer_mask)
  return learn(ctx, state, rollout, terms, rng)


def shares_prompt(share_prompt: str, model: Transformer) -> bool:
  """Whether learner passes run each prompt once per group (`rl.share_prompt`).

  Dense models only. `auto` shares unless the full pass gets cuDNN flash attention: the
  completions' pass from a prefix cache runs einsum attention (cuDNN's causal mask has no
  offset), whose [B, H, T, S+T] scores cost more at long completions than the prompt saves.
  """
  if share_prompt == "never" or model.cfg.moe_layers:
    return False
  cfg = model.cfg
  full_pass = attention.select(model.attention, cfg.compute_dtype, cfg.head_dim, 0)
  return share_prompt == "always" or full_pass != "cudnn"


@dataclasses.dataclass(frozen=True)
class RLProgram:
  """The jitted programs of one RL update (see the module docstring)."""

  step: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
  sample: Callable[..., Rollout]
  learn: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
  learner: Learner
  values: Mapping[str, Any] | None = None  # a single run's traced values its parts are bound to


class Bound:
  """A jitted program whose last argument, a single run's traced values, is bound: called,
  lowered and compiled ahead (`.lower(...).compile()`, then called) as the program without it.
  Every other attribute is the wrapped function's, lowering's or executable's."""

  def __init__(self, fn, values: Mapping[str, Any]):
    self.fn, self.values = fn, values

  def __call__(self, *args):
    """Runs the program (or its compiled executable) on `args` and the bound values."""
    return self.fn(*args, self.values)

  def lower(self, *args) -> Bound:
    """The program lowered for `args` and the bound values (its `compile()` stays bound)."""
    return Bound(self.fn.lower(*args, self.values), self.values)

  def compile(self, *args, **kwargs) -> Bound:
    """The lowered program compiled: an executable called without the bound values."""
    return Bound(self.fn.compile(*args, **kwargs), self.values)

  def __getattr__(self, attr: str):
    return getattr(self.fn, attr)


def make_learner(
  model, optimizer, schedule, sampling, settings, sampler_dtype, mesh, param_shardings
) -> Learner:
  """The `Learner`: the sampler's network at its dtype and weight layout (`param_shardings`
  with FSDP gathered), the learner's with its remat policy (which acts on gradients only), and
  how many rows share a prompt in learner passes.

  A shared prompt block never straddles devices: it is gcd(G, rows one device of the `mesh`
  holds of a microbatch), so each device runs whole blocks of its own rows."""
  sampler_model = model
  if sampler_dtype == "bfloat16":
    sampler_cfg = dataclasses.replace(model.cfg, dtype="bfloat16")
    sampler_model = type(model)(sampler_cfg, attention=model.attention)
  learner_model = type(model)(model.cfg, remat=settings.rl.remat, attention=model.attention)
  shared = shares_prompt(settings.rl.share_prompt, learner_model)
  rl = settings.rl
  slices = rl.num_minibatches * rl.num_microbatches * sharding.batch_size_divisor(mesh)
  device_micro_rows = max(rl.num_prompts * sampling.group_size // slices, 1)
  return Learner(
    learner_model,
    sampler_model,
    optimizer,
    schedule,
    sampling,
    settings,
    sampler_dtype,
    sharding.rows(mesh),
    prompt_group=math.gcd(sampling.group_size, device_micro_rows) if shared else 1,
    decode_shardings=sharding.decode_shardings(param_shardings),
  )


def make_rl_step(
  model: Transformer,
  optimizer: optax.GradientTransformation,
  schedule: optax.Schedule,
  reward_fn: Callable[..., dict[str, jax.Array]] | None,
  sampling: SamplingConfig,
  settings: Settings,
  mesh: Mesh,
  state_shardings: Any,
  *,
  sampler_dtype: str = "float32",
  rules=sharding.DEFAULT_RULES,
  rebuild_optimizer: Callable[[Any], tuple] | None = None,
  runs: int = 0,
  runs_at_once: int = 0,
  values: Mapping[str, Any] | None = None,
) -> RLProgram:
  """Jits the fused step and its sample / learn halves, each once, with explicit shardings.
  `reward_fn(prompt_tokens, completion, completion_mask, answer, answer_mask)` returns named
  [B] reward terms (a pure-JAX verifier; None: host rewards). `runs` > 0: a pack's programs
  (`_packed_program`), `runs_at_once` of each device group's runs at a time (0 = all).
  `values` (a single run; dotted field -> replicated scalar or its ShapeDtypeStruct): settings
  the programs take as traced arguments, bound (`Bound`), instead of compile-time constants,
  so runs that differ only in them share one program; None: every setting a constant."""
  if settings.rl.num_microbatches < 1 or settings.rl.remat == "auto":
    raise ValueError("rl.num_microbatches / rl.remat are 'auto': pass settings.rl.resolved(...)")
  ctx = make_learner(
    model, optimizer, schedule, sampling, settings, sampler_dtype, mesh, state_shardings.params
  )
  ctx = dataclasses.replace(ctx, rebuild_optimizer=rebuild_optimizer)
  traced = lambda fn: sharding.traced_with_rules(fn, mesh, rules)  # noqa: E731
  if runs:
    return _packed_program(ctx, reward_fn, traced, mesh, state_shardings, runs_at_once)
  return _single_program(ctx, reward_fn, traced, mesh, state_shardings, values)


def _single_program(ctx: Learner, reward_fn, traced, mesh: Mesh, state_shardings, values):
  """The programs of a single run, bound to its traced `values` (`Bound`) when it has any."""
  rows, repl = sharding.rows(mesh), NamedSharding(mesh, PartitionSpec())
  batch_shardings = PromptBatch(tokens=rows, mask=rows, answer=rows, answer_mask=rows)
  taken = (repl,) if values else ()  # the bound values' sharding
  program = RLProgram(
    step=jax.jit(
      traced(functools.partial(fused_step, ctx, reward_fn)),
      in_shardings=(state_shardings, batch_shardings, repl, *taken),
      out_shardings=(state_shardings, repl),
      donate_argnums=(0,),
    ),
    sample=jax.jit(
      traced(functools.partial(sample_phase, ctx)),
      in_shardings=(state_shardings, batch_shardings, repl, *taken),
    ),
    learn=jax.jit(
      traced(functools.partial(learn, ctx)),
      out_shardings=(state_shardings, repl),
      donate_argnums=(0,),
    ),
    learner=ctx,
  )
  if not values:
    return program
  parts = {p: Bound(getattr(program, p), values) for p in ("step", "sample", "learn")}
  return dataclasses.replace(program, values=values, **parts)


def packed_sharding(one_run: NamedSharding) -> NamedSharding:
  """The sharding of a pack's array whose runs axis comes first and each run's slice is laid
  out as `one_run`: the runs axis over the mesh's `runs` axis."""
  return NamedSharding(one_run.mesh, PartitionSpec(sharding.RUNS_AXIS, *one_run.spec))


def shared_leaf(path: tuple, adapters: bool) -> bool:
  """Whether the TrainState leaf at `path` (a `tree_map_with_path` key path) is frozen base
  weight of a policy with adapters: one copy of it serves every run of a pack."""
  keys = [str(getattr(k, "name", getattr(k, "key", ""))) for k in path]
  return adapters and keys[:1] == ["params"] and not lora.is_adapter(keys[1:])


def over_runs(state: TrainState, batched: Callable, shared: Callable = lambda x: x) -> Any:
  """`state` (a TrainState of arrays, shardings or shapes) with `batched` applied to each leaf
  a pack holds per run and `shared` to the frozen base its runs share (with adapters)."""
  adapters = lora.has_adapters(state.params)
  return jax.tree_util.tree_map_with_path(
    lambda path, x: shared(x) if shared_leaf(path, adapters) else batched(x), state
  )


def run_axes(state: TrainState) -> Any:
  """A pack's vmap axes of `state`: 0 (the runs axis) for every leaf but the shared base, and
  for the KL reference, a per-run copy made after the build (`init_reference`; under adapters
  the reference is the base and there is none)."""
  return over_runs(state, lambda _: 0, lambda _: None).replace(ref_params=0)


def _packed_program(
  ctx: Learner, reward_fn, traced, mesh: Mesh, state_shardings, at_once: int = 0
) -> RLProgram:
  """The programs of a pack: each vmapped (or, one run at a time, stepped run by run) over the
  runs axis of (state, batch | rollout, ..., rng, values), that axis over the mesh's `runs`
  axis (inner constraints gain it too), jitted once for every run of the pack. Under adapters the frozen base has no runs axis: one copy,
  read by every run (`run_axes`). `at_once` > 0: each device group steps that many of its runs
  at a time and the rest in turn (`sharding.vmap_runs`)."""
  axes = run_axes(state_shardings)
  groups = mesh.shape[sharding.RUNS_AXIS]
  if not sharding.in_turn(at_once, groups):  # the decode loops of a vmapped block stop together
    sampling = dataclasses.replace(ctx.sampling, loop_axis=sharding.PACK_AXIS)
    ctx = dataclasses.replace(ctx, sampling=sampling)

  def packed(fn, n_args: int, out_axes: Any = 0, update_first: bool = False):
    in_axes = (axes,) + (0,) * (n_args - 1)
    vmapped = sharding.vmap_runs(
      fn, in_axes, out_axes, at_once=at_once, groups=groups, update_first=update_first
    )
    return traced(vmapped)

  states = over_runs(state_shardings, packed_sharding)
  per_run = packed_sharding(NamedSharding(mesh, PartitionSpec()))
  rows = packed_sharding(sharding.rows(mesh))
  batch = PromptBatch(tokens=rows, mask=rows, answer=rows, answer_mask=rows)
  return RLProgram(
    step=jax.jit(
      packed(functools.partial(fused_step, ctx, reward_fn), 4, (axes, 0), update_first=True),
      in_shardings=(states, batch, per_run, per_run),
      out_shardings=(states, per_run),
      donate_argnums=(0,),
    ),
    sample=jax.jit(
      packed(functools.partial(sample_phase, ctx), 4),
      in_shardings=(states, batch, per_run, per_run),
    ),
    learn=jax.jit(
      packed(functools.partial(learn, ctx), 5, (axes, 0), update_first=True),
      out_shardings=(states, per_run),
      donate_argnums=(0,),
    ),
    learner=ctx,
  )
