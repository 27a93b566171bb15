"""Assembly of a run from its settings tree: the mesh, the task, the model (random or from a
Hugging Face checkpoint), the initial state straight into its shardings, and the jitted
programs (the fused RL step, or sample → host verifiers → learn, and the evaluation)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import (
  distributed,
  fast_paths,  # noqa: F401  (registers the checks `auto` needs)
  quant,
  sharding,
)
from jaxrl_llm.config import Config, ConfigError, Settings, check, traced_dtype, typed
from jaxrl_llm.data import file_task, pipeline, tasks
from jaxrl_llm.data.task import Task
from jaxrl_llm.kernels import verify
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import Transformer, positions_from_mask
from jaxrl_llm.rl import RLProgram, make_rl_step
from jaxrl_llm.rl.step import run_axes
from jaxrl_llm.run import from_checkpoint
from jaxrl_llm.run.evaluate import make_eval_fn
from jaxrl_llm.types import PromptBatch, TrainState


@dataclasses.dataclass
class Experiment:
  """Everything built from a config, before any step runs (static pieces + initial state)."""

  config: Config
  mesh: Mesh
  task: Task  # in-graph verifiers (built-in tasks) or host verifiers (prompt files)
  model: Transformer
  state: TrainState
  state_shardings: TrainState  # a TrainState of NamedShardings
  program: RLProgram
  eval_fn: Callable[..., dict[str, Any]]
  schedule: optax.Schedule
  batch_sharding: NamedSharding
  meta: dict
  rules: tuple = sharding.DEFAULT_RULES  # logical -> mesh axis rules of params and activations
  prompt_len: int = 0  # S of the step's prompt batch (the task's, or a memory plan's override)

  @property
  def settings(self) -> Settings:
    """The learner's frozen settings (objective hyperparameters resolved)."""
    return self.program.learner.settings

  @property
  def rl_step(self):
    """The fused jitted update `(state, batch, rng) -> (state, metrics)`."""
    return self.program.step

  def stored(self, state: TrainState) -> TrainState:
    """What a checkpoint holds of `state`: all of it, but of a model with adapters only the
    adapters (the base comes from the config; the checkpoint's meta names it, `run_meta`)."""
    if not lora.has_adapters(state.params):
      return state
    return state.replace(params=lora.split_adapters(state.params)[1])

  def from_stored(self, stored: TrainState) -> TrainState:
    """The state of a checkpoint's `stored` one: this run's base put back under the adapters."""
    if not lora.has_adapters(self.state.params):
      return stored
    return stored.replace(
      params=lora.join_adapters(lora.split_adapters(self.state.params)[0], stored.params)
    )

  def update(self, state: TrainState, np_batch: dict, rng: jax.Array):
    """One RL update on a host batch of this process's prompts: the fused step, or
    sample → host verifiers → learn for a task whose verifiers run on the host."""
    if self.task.rewards_on_host:
      return host_reward_step(self, state, np_batch, rng)
    return self.rl_step(state, to_global_batch(np_batch, self.batch_sharding), rng)


def to_global_batch(np_batch: dict, batch_sharding: NamedSharding) -> PromptBatch:
  """Host numpy batch (this process's rows) -> globally sharded `PromptBatch`.

  Batches of text prompts carry string answers for host verifiers; those stay on the host and
  the device batch gets an empty answer.
  """
  pb = pipeline.to_prompt_batch(device_columns(np_batch))
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(batch_sharding, np.asarray(x)), pb
  )


def device_columns(np_batch: dict) -> dict:
  """The columns of a host batch that go to the devices: a batch of text prompts (string
  answers, or none) gets a [..., 1] empty answer stub; its answers stay on the host."""
  if np_batch.get("answer") is not None and np.asarray(np_batch["answer"]).dtype != object:
    return np_batch
  lead = np.shape(np_batch["tokens"])[:-1]
  return {
    "tokens": np_batch["tokens"],
    "mask": np_batch["mask"],
    "answer": np.zeros((*lead, 1), np.int32),
    "answer_mask": np.zeros((*lead, 1), bool),
  }


def host_reward_step(exp: Experiment, state: TrainState, np_batch: dict, rng: jax.Array):
  """One RL update with host verifiers: jitted sampler → decode + verify → jitted learner.

  Each process decodes and scores its own rows (its prompts' groups); the learner gets the
  global reward terms. Verifier counts are summed over processes."""
  batch = to_global_batch(np_batch, exp.batch_sharding)
  rollout = exp.program.sample(state, batch, rng)
  completions = distributed.local_block(rollout.tokens)
  terms, stats = verify_on_host(exp, completions, np_batch["answer"])
  to_global = functools.partial(jax.make_array_from_process_local_data, exp.batch_sharding)
  terms = distributed.placed_like(terms, rollout.lengths, to_global)  # the rollout's rows
  if jax.process_count() > 1:
    keys = sorted(stats)
    stats = dict(zip(keys, distributed.summed(np.asarray([stats[k] for k in keys], np.float64))))
  state, metrics = exp.program.learn(state, rollout, terms, rng)
  metrics = dict(metrics)
  metrics.update({k: np.float32(v) for k, v in stats.items()})
  return state, metrics


def verify_on_host(exp: Experiment, completions: np.ndarray, answers) -> tuple[dict, dict]:
  """The host verifiers' reward terms [B] and failure counts of `completions` (G rows per
  prompt, group-major) against their prompts' reference `answers` [P]."""
  references = np.repeat(np.asarray(answers), exp.config.sampling.group_size)
  return exp.task.host_reward_terms(completions, references)


def build_task(cfg: Config):
  """The run's task: prompt files with host verifiers, or the built-in task of `cfg.task`."""
  if cfg.uses_files:
    return file_task.build_file_task(cfg, cfg.model.checkpoint)
  try:
    return tasks.get_task(cfg.task.name, **cfg.task.task_fields)
  except ValueError as err:
    raise ConfigError(f"invalid task config (task.*): {err}") from None


def _mesh(cfg: Config, devices: list[jax.Device], runs: int) -> tuple[Mesh, tuple]:
  """The device mesh and the logical -> mesh axis rules (a runs axis only for a pack)."""
  m = cfg.mesh
  if m.runs > 1 and not runs:
    raise ConfigError(
      f"mesh.runs={m.runs} splits a pack's runs over device groups; a single run needs "
      "mesh.runs=1 (train packs with tools/sweep.py --packed)"
    )
  try:
    mesh = sharding.make_mesh(m.data, m.model, devices, expert=m.expert, fsdp=m.fsdp, runs=m.runs)
  except ValueError as err:
    raise ConfigError(str(err)) from None
  return mesh, m.rule_table


def _abstract_like(tree, shardings):
  """ShapeDtypeStructs of `tree` (arrays or structs) carrying `shardings`."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def _init_params(model, task, mesh, rules, init_key, *, abstract: bool, adapters_only=False):
  """Randomly initialised params straight into their shardings (ShapeDtypeStructs if abstract);
  with `adapters_only`, the adapters alone (the base's initialisation is dead code then)."""
  dummy = jnp.zeros((1, task.prompt_len), jnp.int32)
  dummy_mask = jnp.ones((1, task.prompt_len), bool)
  boxed_init = lambda r: model.init(r, dummy, positions_from_mask(dummy_mask), dummy_mask)[  # noqa: E731
    "params"
  ]
  if adapters_only:
    full_init = boxed_init
    boxed_init = lambda r: lora.fresh_parts(full_init(r))  # noqa: E731
  if abstract:
    boxed = jax.eval_shape(boxed_init, init_key)
    shardings = sharding.param_shardings(boxed, mesh, rules)
    return _abstract_like(nn.unbox(boxed), shardings), shardings
  return sharding.init_sharded(boxed_init, init_key, mesh, rules)


def _fresh_state(cfg: Config, tx, params, param_shardings, mesh, rng, *, abstract: bool):
  """The TrainState before any step (abstract: shapes and shardings only, nothing allocated).
  The optimiser state covers the trainable parameters: the adapters when the model has them."""
  repl = NamedSharding(mesh, PartitionSpec())
  trained, trained_shardings = lora.trainable(params)[1], lora.trainable(param_shardings)[1]
  if not abstract:
    return TrainState(
      step=jax.device_put(jnp.zeros((), jnp.int32), repl),
      params=params,
      opt_state=sharding.init_opt_state(tx, trained, trained_shardings, mesh),
      ref_params=None,
      rng=jax.device_put(rng, repl),
    )
  opt_abstract, opt_shardings = sharding.opt_state_shardings(tx, trained, trained_shardings, mesh)
  copies_reference = cfg.kl.beta > 0 and not lora.has_adapters(params)
  return TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32, sharding=repl),
    params=params,
    opt_state=_abstract_like(opt_abstract, opt_shardings),
    ref_params=params if copies_reference else None,  # the frozen copy the run will make
    rng=jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=repl),
  )


def _model(cfg: Config, task, mesh, rules, *, abstract: bool, devices) -> tuple:
  """(ModelConfig, Transformer, params, their shardings), after the config's cross checks."""
  pretrained_cfg = from_checkpoint.architecture(cfg) if cfg.model.checkpoint else None
  check(cfg, num_devices=len(devices), task=task, model=pretrained_cfg, device=devices[0])
  pretrained = None  # the weights, loaded once the checks passed (the mesh rules among them)
  if not abstract and cfg.model.checkpoint:
    pretrained_cfg, pretrained = from_checkpoint.load(cfg, mesh, rules)
  mc = pretrained_cfg or cfg.model.arch
  model = Transformer(mc, attention=cfg.model.attention)
  if pretrained is None:  # random init (or, for a plan, a checkpoint's shapes)
    params, shardings = _init_params(model, task, mesh, rules, _init_key(cfg), abstract=abstract)
  else:
    params, shardings = pretrained, jax.tree.map(lambda x: x.sharding, pretrained)
    if mc.lora_rank:  # fresh adapters (and int8 scales) on the checkpoint's weights
      fresh, fresh_shardings = _init_params(
        model, task, mesh, rules, _init_key(cfg), abstract=False, adapters_only=True
      )
      params = lora.join_adapters(params, fresh)
      shardings = lora.join_adapters(shardings, fresh_shardings)
  if mc.lora_base_dtype == "int8":  # the frozen base's projections rounded to int8 once
    if abstract:
      params = _abstract_like(jax.eval_shape(lora.quantize_base, params), shardings)
    else:
      params = jax.jit(lora.quantize_base, out_shardings=shardings, donate_argnums=0)(params)
  return mc, model, params, shardings


def _init_key(cfg: Config) -> jax.Array:
  """The key of the random parameter initialisation (from `seed`)."""
  return jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 0x5EED)


def fresh_run_state(exp: Experiment, cfg: Config) -> TrainState:
  """The fresh state of run `cfg`, one of a pack sharing `exp`'s programs: parameters from
  its own seed (or `exp`'s pretrained ones, with adapters from its own seed), a fresh
  optimiser state and its own key."""
  params = exp.state.params
  param_shardings = exp.state_shardings.params
  init = functools.partial(_init_params, exp.model, exp.task, exp.mesh, exp.rules, _init_key(cfg))
  if cfg.seed != exp.config.seed and not cfg.model.checkpoint:
    params, _ = init(abstract=False)
  elif cfg.seed != exp.config.seed and cfg.model.arch.lora_rank:  # its adapters, the same base
    fresh, _ = init(abstract=False, adapters_only=True)
    params = lora.join_adapters(params, lora.split_adapters(fresh)[1])  # not the int8 scales
  tx, rng = exp.program.learner.optimizer, jax.random.PRNGKey(cfg.seed)
  return _fresh_state(cfg, tx, params, param_shardings, exp.mesh, rng, abstract=False)


def _optimizer(cfg: Config):
  """(optimiser, schedule, {optim field: value} -> both): the last builds a packed run's own."""
  total_updates = cfg.schedule_updates
  tx, schedule = cfg.optim.build(total_updates)
  rebuild = lambda fields: dataclasses.replace(cfg.optim, **fields).build(total_updates)  # noqa: E731
  return tx, schedule, rebuild


def _sampler_dtype(dtype: str, platform: str) -> str:
  """`sampling.param_dtype` made concrete: `auto`'s bfloat16 copy is kept on this process's
  device only where its check passes (`jaxrl_llm/fast_paths.py`), else float32."""
  resolved = quant.resolve_sampler_dtype(dtype, platform)
  if dtype == "auto" and resolved == "bfloat16" and platform == jax.default_backend():
    return verify.choose("sampler_bfloat16", "bfloat16", "float32")
  return resolved


def _learner_settings(
  cfg: Config, params, mesh, seq_len: int, samp, prompt_len: int | None, runs: int, varied
) -> Settings:
  """The learner settings with the `auto` microbatching and remat made concrete
  (`rl.microbatch_tokens=auto`: from the device's compile-only plans, `plan.auto_learner`)."""
  settings, rl = cfg.learner, cfg.learner.rl
  num_params = sum(x.size for x in jax.tree.leaves(params))
  rows = rl.num_prompts * samp.group_size // rl.num_minibatches // sharding.batch_size_divisor(mesh)
  if rl.microbatch_tokens == "auto" and rl.num_microbatches == 0:
    from jaxrl_llm import plan

    logging.info("rl.microbatch_tokens=auto: sizing the learner's slices by compile-only plans")
    start, kw = time.perf_counter(), {"prompt_len": prompt_len, "runs": runs, "varied": varied}
    k, remat, tried = plan.auto_learner(cfg, max(rows, 1), list(mesh.devices.flat), **kw)
    msg = "rl.microbatch_tokens=auto: %d slice(s), remat %s, from %d plan(s) in %.1fs"
    logging.info(msg, k, remat, len(tried), time.perf_counter() - start)
    rl = dataclasses.replace(rl, num_microbatches=k, remat=remat)
  rl = rl.resolved(rows_per_device=max(rows, 1), seq_len=seq_len, num_params=num_params)
  return dataclasses.replace(settings, rl=rl)  # `record.log_banner` shows the resolved values


def run_meta(cfg: Config, mc: ModelConfig, *, abstract: bool = False) -> dict:
  """What a checkpoint records of the run `cfg` (of model `mc`), to refuse resuming it under
  another one (`abstract`, a plan: the base's weight files are not read for their digest)."""
  meta = {
    "model": mc.to_dict(),
    "hf_model_type": from_checkpoint.model_type(cfg.model.checkpoint),
    "objective": {"name": cfg.objective.name, **cfg.objective.hyperparameters},
    "task": cfg.task.task_fields | {"name": cfg.task.name, "data": cfg.data.train_files},
  }
  if mc.lora_rank:  # the checkpoints hold the adapters alone: what they sit on
    meta["base"] = base_identity(cfg, digest=not abstract)
  return meta


def base_identity(cfg: Config, *, digest: bool = True) -> dict:
  """The base a run's adapters sit on: its Hugging Face checkpoint and a digest of its weight
  files (None without `digest`), or the seed of its random initialisation."""
  from jaxrl_llm.models import hf

  path = cfg.model.checkpoint
  if path:
    return {
      "checkpoint": os.path.abspath(path),
      "digest": hf.weights_digest(path) if digest else None,
    }
  return {"checkpoint": None, "init_seed": cfg.seed}


def build(
  config: Config,
  *,
  abstract: bool = False,
  devices: list[jax.Device] | None = None,
  prompt_len: int | None = None,
  runs: int = 0,
  varied: Sequence[str] | None = None,
) -> Experiment:
  """Builds the mesh, task, model, initial state and jitted programs of a run (`config`: its
  `Config`; an experiment ConfigDict is `config.parse`d by the caller).

  With `abstract=True` nothing is allocated or loaded: the state's leaves are ShapeDtypeStructs
  with their shardings, so the programs can be lowered and compiled to read their memory.
  `devices` (default `jax.devices()`) builds the mesh from other devices: fake CPU devices, or
  a TPU topology's (`jax.experimental.topologies`) for an abstract build compiled for TPU.
  `prompt_len` (planning only) sizes the step for prompts of another length than the task's.
  `runs` > 0 builds the programs of a pack of that many runs (`run.pack`) varying the traced
  fields `varied` (what `rl.microbatch_tokens=auto` plans), from the first run's state; a
  single run's take its own traced values (`own_values`)."""
  cfg = typed(config, "build")
  from_checkpoint.check_dir(cfg.model.checkpoint)
  task = build_task(cfg)
  devices = list(devices if devices is not None else jax.devices())
  mesh, rules = _mesh(cfg, devices, runs)
  from_checkpoint.check_context(cfg, task, prompt_len or task.prompt_len)  # before the weights load
  mc, model, params, param_shardings = _model(
    cfg, task, mesh, rules, abstract=abstract, devices=devices
  )
  samp = cfg.sampling.sampler(task, tool_timeout_s=cfg.data.verifier_timeout_s)
  tx, schedule, rebuild = _optimizer(cfg)
  rng = jax.random.PRNGKey(cfg.seed)
  state = _fresh_state(cfg, tx, params, param_shardings, mesh, rng, abstract=abstract)
  seq_len = (prompt_len or task.prompt_len) + samp.max_new_tokens
  settings = _learner_settings(cfg, params, mesh, seq_len, samp, prompt_len, runs, varied)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  sampler_dtype = _sampler_dtype(cfg.sampling.param_dtype, devices[0].platform)
  reward_fn = task.reward_terms  # None when the verifiers run on the host
  program = make_rl_step(
    model, tx, schedule, reward_fn, samp, settings, mesh, state_shardings,
    sampler_dtype=sampler_dtype, rules=rules, rebuild_optimizer=rebuild, runs=runs,
    runs_at_once=cfg.mesh.runs_at_once, values=None if runs else own_values(cfg, mesh, abstract),
  )  # fmt: skip
  return Experiment(
    config=cfg,
    mesh=mesh,
    task=task,
    model=model,
    state=state,
    state_shardings=state_shardings,
    program=_compiled_ahead(program),
    eval_fn=make_eval_fn(
      model, task, cfg, mesh, rules, runs, run_axes(state).params, program.values
    ),
    schedule=schedule,
    batch_sharding=sharding.rows(mesh),
    meta=run_meta(cfg, mc, abstract=abstract),
    rules=rules,
    prompt_len=prompt_len or task.prompt_len,
  )


def own_values(cfg: Config, mesh: Mesh, abstract: bool = False) -> dict[str, Any]:
  """A single run's traced values (`Config.step_values(constants=False)`: the clip ranges,
  temperature, learning rate, ...), replicated over `mesh` (ShapeDtypeStructs when
  `abstract`): its programs take them as arguments, not constants, so runs that differ only
  in them share one program, which the compilation cache keeps for each of them."""
  repl = NamedSharding(mesh, PartitionSpec())
  host = {f: np.asarray(v, traced_dtype(v)) for f, v in cfg.step_values(constants=False).items()}
  if abstract:
    return {f: jax.ShapeDtypeStruct((), x.dtype, sharding=repl) for f, x in host.items()}
  return jax.device_put(host, repl)


def _compiled_ahead(program: RLProgram) -> RLProgram:
  """`program` whose jitted parts compile ahead, stoppable, and start together on every process
  (`distributed.program`)."""
  said = {"step": "the RL step", "sample": "the RL sampler", "learn": "the RL learner"}
  parts = {p: distributed.program(getattr(program, p), f"rl-{p}", w) for p, w in said.items()}
  return dataclasses.replace(program, **parts)


def abstract_batch(exp: Experiment) -> PromptBatch:
  """ShapeDtypeStructs of one RL step's prompt batch (for ahead-of-time compilation)."""
  p = exp.config.sampled_prompts
  s, a = exp.prompt_len, exp.task.answer_len
  shape = lambda n, dt: jax.ShapeDtypeStruct((p, n), dt, sharding=exp.batch_sharding)  # noqa: E731
  return PromptBatch(
    tokens=shape(s, jnp.int32),
    mask=shape(s, jnp.bool_),
    answer=shape(a, jnp.int32),
    answer_mask=shape(a, jnp.bool_),
  )
