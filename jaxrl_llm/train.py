"""`train_and_evaluate(config, workdir)`: the training loop (no flag parsing).

Order of a run: validate the config → build mesh, task, model, data → restore the latest
checkpoint of `workdir` if there is one, else run the supervised warm start (if configured)
→ RL updates with periodic held-out evaluation, TensorBoard summaries and orbax checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import (
  __version__,
  config_lib,
  distributed,
  metric_info,
  paths,
  quant,
  sharding,
)
from jaxrl_llm import checkpoint as ckpt_lib
from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.data import file_task, pipeline, tasks
from jaxrl_llm.data.task import Task
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import Transformer, positions_from_mask
from jaxrl_llm.optim import guarded_update, make_optimizer
from jaxrl_llm.rl import RLProgram, Settings, init_reference, make_rl_step
from jaxrl_llm.sampling import sample, score
from jaxrl_llm.types import PromptBatch, TrainState

HPARAM_FIELDS = (  # the HParams columns of every run (plus any field set on the command line)
  "objective.name",
  "aggregation.name",
  "advantage.name",
  "objective.clip_low",
  "objective.clip_high",
  "sampling.temperature",
  "sampling.group_size",
  "rl.num_prompts",
  "optim.learning_rate",
  "kl.beta",
  "kl.name",
  "correction.name",
  "task.name",
  "model.num_layers",
  "model.d_model",
  "seed",
)


@dataclasses.dataclass
class Experiment:
  """Everything built from a config, before any step runs (static pieces + initial state)."""

  config: ml_collections.ConfigDict
  mesh: Mesh
  task: Task
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

  def update(self, state: TrainState, np_batch: dict, rng: jax.Array):
    """One RL update on this process's host batch: the fused step, or, for a task scored on
    the host, sample -> host verifiers -> learn (`host_reward_step`)."""
    if self.task.rewards_on_host:
      return host_reward_step(self, state, np_batch, rng)
    return self.rl_step(state, to_global_batch(np_batch, self.batch_sharding), rng)


def build_task(config):
  """The built-in task named by `config.task` (extra fields go to the task constructor)."""
  kwargs = {k: v for k, v in config.task.items() if k not in ("name", "reward_weights")}
  return tasks.get_task(config.task.name, **kwargs)


def to_global_batch(np_batch: dict, batch_sharding: NamedSharding) -> PromptBatch:
  """Host numpy batch (this process's rows) -> globally sharded `PromptBatch`.

  Batches of text prompts carry string answers for host verifiers; those stay on the host and
  the device batch gets an empty answer.
  """
  if np_batch.get("answer") is None or np.asarray(np_batch["answer"]).dtype == object:
    n = len(np_batch["tokens"])
    np_batch = {
      "tokens": np_batch["tokens"],
      "mask": np_batch["mask"],
      "answer": np.zeros((n, 1), np.int32),
      "answer_mask": np.zeros((n, 1), bool),
    }
  pb = pipeline.to_prompt_batch(np_batch)
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(batch_sharding, np.asarray(x)), pb
  )


def make_eval_fn(model, task, config, mesh, rules=sharding.DEFAULT_RULES):
  """Held-out evaluation: greedy accuracy and pass@k at the sampling temperature.

  Sampling is one jitted program; a pure-JAX verifier runs inside it, a host verifier (file
  tasks) scores the decoded completions afterwards. Returns `eval_fn(params, batch, rng,
  answers)`: `answers` are the eval set's host reference answers (None for in-graph tasks).
  """
  greedy_cfg = config_lib.sampling_config(config, task, greedy=True, group_size=1)
  k = config.train.pass_k
  passk_cfg = config_lib.sampling_config(config, task, group_size=max(k, 1))
  repl = NamedSharding(mesh, PartitionSpec())
  host = task.rewards_on_host

  def correct(rollout, batch, g):
    answer = jnp.repeat(batch.answer, g, axis=0)
    answer_mask = jnp.repeat(batch.answer_mask, g, axis=0)
    terms = task.reward_terms(
      rollout.prompt_tokens, rollout.tokens, rollout.loss_mask, answer, answer_mask
    )
    return terms["correct"]

  def summarise(acc, pk, lengths):
    return {
      "eval/accuracy": jnp.mean(acc),
      f"eval/pass@{k}": jnp.mean(jnp.max(pk, axis=1)),
      "eval/sample_accuracy": jnp.mean(pk),
      "eval/length_mean": jnp.mean(lengths.astype(jnp.float32)),
    }

  def eval_fn(params, batch: PromptBatch, rng):
    greedy = sample(model, params, batch.tokens, batch.mask, rng, greedy_cfg)
    sampled = sample(model, params, batch.tokens, batch.mask, rng, passk_cfg)
    if host:
      return greedy.tokens, sampled.tokens, greedy.lengths
    pk = correct(sampled, batch, k).reshape(-1, k)
    return summarise(correct(greedy, batch, 1), pk, greedy.lengths)

  eval_fn = sharding.traced_with_rules(eval_fn, mesh, rules)
  if not host:  # the answers are token arrays in `batch`, checked in-graph
    in_graph = jax.jit(eval_fn, out_shardings=repl)
    return lambda params, batch, rng, answers=None: in_graph(params, batch, rng)
  sample_fn = jax.jit(eval_fn, out_shardings=repl)

  def host_eval(params, batch, rng, answers):
    greedy, sampled, lengths = jax.device_get(sample_fn(params, batch, rng))
    acc, _ = task.host_reward_terms(greedy, answers)
    pk, _ = task.host_reward_terms(sampled, np.repeat(answers, k))
    return summarise(acc["correct"], pk["correct"].reshape(-1, k), lengths)

  return host_eval


def _sft_phase(exp: Experiment, workdir: str, log_every: int) -> TrainState:
  """Supervised warm start on prompt → reference answer.

  Logged under `sft/` in its own TensorBoard run, `<workdir>/sft`, with its own step axis
  (1..sft.steps): RL steps in `<workdir>` then start at 0 and compare cleanly across runs.
  """
  config, task, model = exp.config, exp.task, exp.model
  steps = config.sft.steps
  tx, schedule = make_optimizer(
    config.sft.learning_rate,
    steps,
    warmup_steps=min(10, steps // 10),
    b1=config.optim.b1,
    b2=config.optim.b2,
    grad_clip=config.optim.grad_clip,
  )
  it = task.train_iterator(
    config.sft.batch_size // jax.process_count(),
    config.seed + 1,
    shard_index=jax.process_index(),
    shard_count=jax.process_count(),
  )

  def loss_fn(params, batch):
    logp = score(model, params, batch.tokens, batch.mask, batch.answer, 1.0).logp
    m = batch.answer_mask.astype(jnp.float32)
    return -jnp.sum(logp * m) / jnp.maximum(jnp.sum(m), 1.0)

  def sft_update(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params, opt_state, skipped = guarded_update(tx, grads, opt_state, params, loss)
    return params, opt_state, loss, skipped

  sft_step = jax.jit(sharding.traced_with_rules(sft_update, exp.mesh, exp.rules))

  params = exp.state.params
  opt_state = sharding.init_opt_state(
    tx, params, jax.tree.map(lambda x: x.sharding, params), exp.mesh
  )
  t0 = time.time()
  guard = SkipGuard(config.train.max_skipped_updates, "sft")
  writer = metrics_lib.SummaryWriter(paths.join(workdir, "sft"))
  logging.info("supervised warm start: %d steps (events in %s)", steps, writer.logdir)
  for i in range(steps):
    batch = to_global_batch(next(it), exp.batch_sharding)
    params, opt_state, loss, skipped = sft_step(params, opt_state, batch)
    guard.update(i + 1, int(skipped), updates=1)
    if (i + 1) % log_every == 0 or i + 1 == steps:
      loss = float(loss)
      scalars = {"sft/loss": loss, "sft/learning_rate": float(schedule(i))}
      scalars["sft/skipped_updates"] = float(guard.total)
      writer.scalars(i + 1, scalars)
      guard.finite_metrics(scalars)
      logging.info("sft %d/%d loss %.4f (%.1fs)", i + 1, steps, loss, time.time() - t0)
  writer.close()
  return exp.state.replace(params=params)


class NonFiniteError(RuntimeError):
  """The run stopped: too many consecutive optimiser updates were non-finite."""


class SkipGuard:
  """Counts optimiser updates the step skipped for a non-finite loss, gradient or update, and
  stops the run (NonFiniteError) after `limit` consecutive ones."""

  def __init__(self, limit: int, phase: str):
    self.limit, self.phase = limit, phase
    self.consecutive = self.total = 0
    self.last_finite: dict[str, float] = {}

  def update(self, step: int, skipped: int, updates: int) -> None:
    """Adds one step's `skipped` of its `updates`; raises once `limit` in a row were skipped."""
    self.total += skipped
    self.consecutive = self.consecutive + skipped if skipped == updates else skipped
    if skipped:
      logging.warning(
        "%s step %d: %d of %d optimiser updates skipped (non-finite loss, gradient or update)",
        self.phase,
        step,
        skipped,
        updates,
      )
    if self.consecutive >= self.limit:
      shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(self.last_finite.items())[:12])
      raise NonFiniteError(
        f"{self.phase} step {step}: {self.consecutive} consecutive optimiser updates had a "
        f"non-finite loss, gradient or update and were skipped (train.max_skipped_updates="
        f"{self.limit}); parameters and optimiser state are those of the last finite update "
        f"and no non-finite state was saved. Last finite metrics: {shown or 'none logged'}. "
        "Lower the learning rate, keep optim.grad_clip > 0, or use float32 parameters."
      )

  def finite_metrics(self, scalars: dict[str, float]) -> None:
    """Remembers `scalars` of a logged step if they are all finite (shown when stopping)."""
    if all(np.isfinite(v) for v in scalars.values()):
      self.last_finite = dict(scalars)


def _load_pretrained(config, mesh, rules):
  """(ModelConfig, params) of `model.checkpoint` (a Hugging Face directory), or (None, None)."""
  path = config.model.checkpoint
  if not path:
    return None, None
  from jaxrl_llm.models import hf

  if not os.path.isdir(path):
    raise config_lib.ConfigError(
      f"model.checkpoint={path!r} is not a directory; point it at a local Hugging Face "
      f"checkpoint (config.json + *.safetensors)"
    )
  return hf.load_checkpoint(
    path,
    mesh=mesh,
    rules=rules,
    param_dtype=config.model.param_dtype,
    dtype=config.model.dtype,
    scan_layers=config.model.scan_layers,
  )


def _hf_model_type(path: str) -> str:
  """The `model_type` of a Hugging Face checkpoint directory ("" when not starting from one)."""
  if not path:
    return ""
  with open(os.path.join(path, "config.json")) as f:
    return str(json.load(f).get("model_type", ""))


def _abstract_like(tree, shardings):
  """ShapeDtypeStructs of `tree` (arrays or structs) carrying `shardings`."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def _init_params(model, task, mesh, rules, init_key, *, abstract: bool):
  """Randomly initialised params straight into their shardings (ShapeDtypeStructs if abstract)."""
  dummy = jnp.zeros((1, task.prompt_len), jnp.int32)
  dummy_mask = jnp.ones((1, task.prompt_len), bool)
  boxed_init = lambda r: model.init(r, dummy, positions_from_mask(dummy_mask), dummy_mask)[  # noqa: E731
    "params"
  ]
  if abstract:
    boxed = jax.eval_shape(boxed_init, init_key)
    shardings = sharding.param_shardings(boxed, mesh, rules)
    return _abstract_like(nn.unbox(boxed), shardings), shardings
  with mesh:
    return sharding.init_sharded(boxed_init, init_key, mesh, rules)


def _initial_state(config, tx, params, param_shardings, mesh, rng, *, abstract: bool):
  """The TrainState before any step (abstract: shapes and shardings only, nothing allocated)."""
  repl = NamedSharding(mesh, PartitionSpec())
  if not abstract:
    opt_state = sharding.init_opt_state(tx, params, param_shardings, mesh)
    return TrainState(
      step=jax.device_put(jnp.zeros((), jnp.int32), repl),
      params=params,
      opt_state=opt_state,
      ref_params=None,
      rng=jax.device_put(rng, repl),
    )
  opt_abstract, opt_shardings = sharding.opt_state_shardings(tx, params, param_shardings, mesh)
  return TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32, sharding=repl),
    params=params,
    opt_state=_abstract_like(opt_abstract, opt_shardings),
    ref_params=params if config.kl.beta > 0 else None,  # the frozen copy the run will make
    rng=jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=repl),
  )


def _pretrained_config(config):
  """The ModelConfig of `model.checkpoint`'s config.json, with the config's dtypes and layout."""
  from jaxrl_llm.models import hf_config

  with open(os.path.join(config.model.checkpoint, "config.json")) as f:
    mc = hf_config.config_from_hf(json.load(f), source=config.model.checkpoint)
  return dataclasses.replace(
    mc,
    dtype=config.model.dtype,
    param_dtype=config.model.param_dtype,
    scan_layers=config.model.scan_layers,
  )


# Model fields that pick an implementation, not the function: a run resumes across them.
NUMERICS_ONLY = ("model.moe_impl",)


def build(
  config: ml_collections.ConfigDict,
  *,
  abstract: bool = False,
  devices: list[jax.Device] | None = None,
  prompt_len: int | None = None,
) -> Experiment:
  """Validates `config` and builds the mesh, task, model, initial state and jitted programs.

  With `abstract=True` nothing is allocated or loaded: the state's leaves are
  ShapeDtypeStructs with their shardings, so the programs can be lowered and compiled ahead of
  time (`program.step.lower(exp.state, batch, rng).compile()`) to read their memory.
  `devices` (default `jax.devices()`) builds the mesh from other devices: fake CPU devices, or
  a TPU topology's (`jax.experimental.topologies`) for an abstract build compiled for TPU.
  `prompt_len` (planning only) sizes the step for prompts of another length than the task's.
  """
  config_lib.check_required(config)
  if config.data.train_files:
    task = file_task.build_file_task(config, config.model.checkpoint)
  else:
    try:
      task = build_task(config)
    except ValueError as err:
      raise config_lib.ConfigError(f"invalid task config (task.*): {err}") from None
  devices = list(devices if devices is not None else jax.devices())
  try:
    mesh = sharding.make_mesh(
      config.mesh.data,
      config.mesh.model,
      devices,
      expert=config.mesh.expert,
      fsdp=config.mesh.fsdp,
    )
  except ValueError as err:
    raise config_lib.ConfigError(str(err)) from None
  try:
    rules = sharding.rules_from_config(config.mesh.rules)
  except ValueError as err:
    raise config_lib.ConfigError(str(err)) from None
  pretrained_cfg, pretrained = None, None
  if abstract and config.model.checkpoint:
    pretrained_cfg = _pretrained_config(config)
  elif not abstract:
    pretrained_cfg, pretrained = _load_pretrained(config, mesh, rules)
  config_lib.validate(config, num_devices=len(devices), task=task, model_override=pretrained_cfg)
  mc = pretrained_cfg or config_lib.model_config(config)
  model = Transformer(mc, attention=config.model.attention)
  samp = config_lib.sampling_config(config, task)
  settings = config_lib.learner_settings(config)
  rl = settings.rl
  logging.info("objective %s: %s", settings.objective.name, settings.objective.hyperparameters)

  rng = jax.random.PRNGKey(config.seed)
  init_key = jax.random.fold_in(rng, 0x5EED)
  if pretrained is not None:
    params, param_shardings = pretrained, jax.tree.map(lambda x: x.sharding, pretrained)
  else:
    params, param_shardings = _init_params(model, task, mesh, rules, init_key, abstract=abstract)
  total_updates = config.train.num_steps * rl.num_epochs * rl.num_minibatches
  tx, schedule = make_optimizer(
    config.optim.learning_rate,
    total_updates,
    warmup_steps=config.optim.warmup_steps,
    decay_to=config.optim.decay_to,
    weight_decay=config.optim.weight_decay,
    b1=config.optim.b1,
    b2=config.optim.b2,
    grad_clip=config.optim.grad_clip,
  )
  state = _initial_state(config, tx, params, param_shardings, mesh, rng, abstract=abstract)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  rows = rl.num_prompts * samp.group_size // rl.num_minibatches // sharding.batch_size_divisor(mesh)
  rl = rl.resolved(
    rows_per_device=max(rows, 1),
    seq_len=(prompt_len or task.prompt_len) + samp.max_new_tokens,
    num_params=num_params,
  )
  settings = dataclasses.replace(settings, rl=rl)
  logging.info(
    "%.3gM parameters; learner: %d microbatch(es) per minibatch, remat %s",
    num_params / 1e6,
    rl.num_microbatches,
    rl.remat,
  )
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  program = make_rl_step(
    model,
    tx,
    schedule,
    task.reward_terms,
    samp,
    settings,
    mesh,
    state_shardings,
    sampler_dtype=quant.resolve_sampler_dtype(config.sampling.param_dtype, devices[0].platform),
    rules=rules,
  )
  meta = {
    "model": mc.to_dict(),
    "hf_model_type": _hf_model_type(config.model.checkpoint),
    "objective": {"name": settings.objective.name, **settings.objective.hyperparameters},
    "task": {k: v for k, v in config.task.to_dict().items() if k != "reward_weights"}
    | {"data": config.data.train_files},
  }
  return Experiment(
    config=config,
    mesh=mesh,
    task=task,
    model=model,
    state=state,
    state_shardings=state_shardings,
    program=program,
    eval_fn=make_eval_fn(model, task, config, mesh, rules),
    schedule=schedule,
    batch_sharding=sharding.rows(mesh),
    meta=meta,
    rules=rules,
    prompt_len=prompt_len or task.prompt_len,
  )


def abstract_batch(exp: Experiment) -> PromptBatch:
  """ShapeDtypeStructs of one RL step's prompt batch (for ahead-of-time compilation)."""
  p = config_lib.num_sampled_prompts(exp.config)
  s, a = exp.prompt_len, exp.task.answer_len
  shape = lambda n, dt: jax.ShapeDtypeStruct((p, n), dt, sharding=exp.batch_sharding)  # noqa: E731
  return PromptBatch(
    tokens=shape(s, jnp.int32),
    mask=shape(s, jnp.bool_),
    answer=shape(a, jnp.int32),
    answer_mask=shape(a, jnp.bool_),
  )


def host_reward_step(exp: Experiment, state: TrainState, np_batch: dict, rng: jax.Array):
  """One RL update with host verifiers: jitted sampler → decode + verify → jitted learner.

  Each process decodes and scores its own rows (its prompts' groups); the learner gets the
  global reward terms. Verifier counts are summed over processes."""
  batch = to_global_batch(np_batch, exp.batch_sharding)
  rollout = exp.program.sample(state, batch, rng)
  completions = distributed.local_rows(rollout.tokens)
  references = np.repeat(np.asarray(np_batch["answer"]), exp.config.sampling.group_size)
  terms, stats = exp.task.host_reward_terms(completions, references)
  if jax.process_count() > 1:
    terms = {
      k: jax.make_array_from_process_local_data(exp.batch_sharding, np.asarray(v, np.float32))
      for k, v in terms.items()
    }
    keys = sorted(stats)
    summed = multihost_utils.process_allgather(np.asarray([stats[k] for k in keys], np.float64))
    stats = dict(zip(keys, np.sum(np.asarray(summed), axis=0)))
  state, metrics = exp.program.learn(state, rollout, terms, rng)
  metrics = dict(metrics)
  metrics.update({k: np.float32(v) for k, v in stats.items()})
  return state, metrics


def _text_summary(task, m: dict, limit: int) -> str:
  prompts, comps, rewards = m["samples/prompt"], m["samples/tokens"], m["samples/reward"]
  rows = ["| prompt | completion | reward |", "|---|---|---|"]
  for p, c, r in list(zip(prompts, comps, rewards))[:limit]:
    prompt_str, comp_str = task.describe(p, c)
    rows.append(f"| `{prompt_str}` | `{comp_str}` | {float(r):.2f} |")
  return "\n".join(rows)


def _commit() -> str | None:
  """The git commit of the installed package's checkout, when it is one."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    out = subprocess.run(
      ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


def run_hparams(
  config: ml_collections.ConfigDict, exp: Experiment | None = None, extra: Sequence[str] = ()
) -> dict[str, bool | int | float | str]:
  """The run's HParams: `HPARAM_FIELDS` plus the fields named in `extra` (e.g. those a sweep
  sets), with the objective's clip widths resolved to the values it uses, and the parameter
  count when `exp` is given. Unset fields read 'default'."""
  resolved = config_lib.learner_settings(config).objective.hyperparameters
  out: dict[str, bool | int | float | str] = {}
  for field in dict.fromkeys([*HPARAM_FIELDS, *extra]):
    node = config
    for part in field.split("."):
      node = node[part]
    if field.startswith("objective.") and field.split(".", 1)[1] in resolved:
      node = resolved[field.split(".", 1)[1]]
    if isinstance(node, (bool, int, float, str)):
      out[field] = node
    else:
      out[field] = "default" if node is None else json.dumps(node)
  if exp is not None:
    out["params"] = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(exp.state.params))
  return out


def record_run(
  config: ml_collections.ConfigDict,
  workdir: str,
  writer,
  step: int,
  hparams: Mapping[str, bool | int | float | str] | None = None,
) -> str | None:
  """Records the run's resolved config in `workdir` (process 0): `config.json` with every field
  after overrides plus the package version and commit, JAX version, backend and device count,
  the same fields as a TensorBoard text table (tag `config`), and `hparams` as the run's
  HParams session (metrics: `metric_info.HPARAMS_METRICS`). A resumed run with the same config
  writes nothing; one with a changed config writes `config.resume-<step>.json` (and a new
  table at `step`; the HParams session stays the first one). Returns the file written, or
  None."""
  if jax.process_index() != 0:
    return None
  fields = json.loads(config.to_json_best_effort())
  path = paths.join(workdir, "config.json")
  first = not paths.exists(path)
  if not first:
    if json.loads(paths.read_text(path)).get("config") == fields:
      return None
    path = paths.join(workdir, f"config.resume-{step}.json")
  record = {
    "config": fields,
    "jaxrl_llm": __version__,
    "commit": _commit(),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
    "processes": jax.process_count(),
    "step": step,
    "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  paths.makedirs(workdir)
  paths.write_text(path, json.dumps(record, indent=2, sort_keys=True))
  flat: dict[str, object] = {}
  ckpt_lib._flatten_json("", fields, flat)
  rows = ["| field | value |", "|---|---|"]
  rows += [f"| `{k}` | `{json.dumps(v)}` |" for k, v in sorted(flat.items())]
  rows.append(f"\n{paths.as_path(path).name}: jaxrl_llm {__version__}, JAX {jax.__version__}, ")
  rows[-1] += f"{record['backend']} x {record['devices']} devices, commit {record['commit']}"
  writer.text(step, "config", "\n".join(rows))
  if first and hparams:
    declared = [
      (tag, name, metric_info.info(tag).meaning) for tag, name in metric_info.HPARAMS_METRICS
    ]
    trial = paths.as_path(workdir).name
    writer.hparams(hparams, declared, trial_id=trial, start_time=time.time())
  return path


def parameter_counts(exp: Experiment) -> tuple[int, int]:
  """(total, active per token) parameter counts: a MoE layer's experts count top_k / E."""
  mc = exp.model.cfg
  total = active = 0
  for path, x in jax.tree_util.tree_leaves_with_path(exp.state.params):
    n = int(np.prod(x.shape))
    keys = [getattr(k, "key", "") for k in path]
    total += n
    if mc.moe_num_experts and "moe" in keys and keys[-1] in ("gate", "up", "down"):
      n = n * mc.moe_top_k // mc.moe_num_experts
    active += n
  return total, active


def log_banner(exp: Experiment, workdir: str) -> None:
  """The run's first lines: what runs where, and how to watch it."""
  total, active = parameter_counts(exp)
  params = f"{total / 1e6:.3g}M parameters"
  if active != total:
    params += f" ({active / 1e6:.3g}M active per token)"
  mesh = " x ".join(f"{k}={v}" for k, v in exp.mesh.shape.items() if v > 1) or "one device"
  device = jax.devices()[0]
  logging.info(
    "jaxrl_llm %s | JAX %s | %s (%s) x %d devices, %d process(es) | mesh %s | %s",
    __version__,
    jax.__version__,
    device.platform,
    device.device_kind,
    jax.device_count(),
    jax.process_count(),
    mesh,
    params,
  )
  logging.info("workdir %s | watch it: tensorboard --logdir %s", workdir, workdir)


def train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: str, *, hparam_fields: Sequence[str] = ()
) -> dict[str, float]:
  """Runs the experiment in `workdir` (resuming from its latest checkpoint); returns the last
  evaluation. `hparam_fields`: config fields to list in the HParams view beside
  `HPARAM_FIELDS` (the command line passes the fields it overrides)."""
  wall_start = time.time()
  try:
    distributed.check_same_config(config)
  except ValueError as err:
    raise config_lib.ConfigError(str(err)) from None
  exp = build(config)
  log_banner(exp, workdir)
  tr = config.train
  writer = metrics_lib.SummaryWriter(workdir)
  ckpt = ckpt_lib.Checkpointer(workdir, save_every=tr.checkpoint_every, max_to_keep=tr.max_to_keep)
  try:
    per_process = config_lib.num_sampled_prompts(config) // jax.process_count()
    shard = {"shard_index": jax.process_index(), "shard_count": jax.process_count()}
    train_iter = exp.task.train_iterator(per_process, config.seed, **shard)
    writer.scalars(0, exp.task.data_stats)  # file data: records read, too long (dropped), kept
    eval_np, eval_answers = exp.task.eval_set(multiple_of=sharding.batch_size_divisor(exp.mesh))
    # Every process holds the whole evaluation set and feeds its own block of rows.
    own = distributed.process_slice(len(eval_np["tokens"]))
    eval_batch = to_global_batch({k: v[own] for k, v in eval_np.items()}, exp.batch_sharding)
    eval_key = jax.random.PRNGKey(config.seed + 7)

    state = init_reference(exp.state, config.kl.beta)
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    resumed = ckpt.restore_latest(  # the newest step that verifies; bad ones set aside
      abstract,
      data_iter=train_iter,
      current_meta=exp.meta,
      meta_defaults={"model": ModelConfig().to_dict()},  # fields added since it was written
      meta_ignore=NUMERICS_ONLY,
    )
    if resumed is not None:
      latest, state, _saved_meta = resumed
      logging.info("resumed from %s at step %d", workdir, latest)
    elif config.sft.steps:
      state = init_reference(_sft_phase(exp, workdir, tr.log_every), config.kl.beta)
      # The warm start is a checkpoint of its own (step 0): a relaunch does not redo it.
      ckpt.save(0, state, data_iter=train_iter, meta=exp.meta, force=True)

    start = int(state.step)
    record_run(config, workdir, writer, start, run_hparams(config, exp, hparam_fields))
    last_eval: dict[str, float] = {}
    evals: list[tuple[int, dict[str, float]]] = []

    def evaluate(step: int):
      nonlocal last_eval
      t = time.time()
      m = metrics_lib.flatten_metrics(exp.eval_fn(state.params, eval_batch, eval_key, eval_answers))
      writer.scalars(step, m)
      last_eval = m
      evals.append((step, m))
      shown = " ".join(f"{k.removeprefix('eval/')} {v:.3g}" for k, v in m.items())
      logging.info("eval step %d: %s (%.1fs)", step, shown, time.time() - t)

    if start >= tr.num_steps:  # a finished workdir: report its last evaluation, write nothing
      logging.info(
        "%s already holds step %d of train.num_steps=%d: nothing to train",
        workdir,
        start,
        tr.num_steps,
      )
      saved = metrics_lib.read_scalars(workdir) if jax.process_index() == 0 else {}
      return {k: v[-1][1] for k, v in saved.items() if k.startswith("eval/") and v}
    if start == 0:
      evaluate(0)
    end = tr.num_steps
    if tr.stop_after_steps:
      end = min(end, start + tr.stop_after_steps)
    guard = SkipGuard(tr.max_skipped_updates, "rl")
    updates_per_step = config.rl.num_epochs * config.rl.num_minibatches
    progress = metrics_lib.Progress(tr.num_steps)
    t_loop, t_last, last_logged, tokens = time.time(), time.time(), start, 0.0
    logging.info("compiling the RL step (its first run includes compilation) ...")
    profiling = False
    for step in range(start, end):
      if tr.profile_steps and step == start + 1 and jax.process_index() == 0:
        jax.profiler.start_trace(workdir)  # <workdir>/plugins/profile/<time>/ (Profile tab)
        profiling = True
      np_batch = next(train_iter)
      rng = jax.random.fold_in(state.rng, step)
      state, metrics = exp.update(state, np_batch, rng)
      done = step + 1
      guard.update(done, int(metrics["optim/skipped_updates"]), updates=updates_per_step)
      if step > start:  # tokens/s of the steady state, as the rate
        tokens += float(metrics["perf/generated_tokens"])
      if profiling and (done == start + 1 + tr.profile_steps or done == end):
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        profiling = False
        logging.info("profiled steps %d..%d into %s/plugins/profile", start + 2, done, workdir)
      if step == start:  # compile + first update: excluded from the rate and ETA
        t_compiled = time.time()
        progress.mark(done, t_compiled)
        logging.info("RL step compiled; first update done in %.1fs", t_compiled - t_loop)
      if done % tr.log_every == 0 or done == tr.num_steps:
        m = distributed.host_values(metrics)  # per-row arrays gathered from every process
        now = time.time()
        dt = (now - t_last) / max(done - last_logged, 1)
        t_last, last_logged = now, done
        if done > start + 1:
          progress.mark(done, now)
        scalars = {k: float(v) for k, v in m.items() if np.ndim(v) == 0}
        scalars["perf/step_time_s"] = dt
        scalars["perf/generated_tokens_per_s"] = scalars["perf/generated_tokens"] / dt
        scalars["perf/learner_tokens_per_s"] = scalars["perf/learner_tokens"] / dt
        writer.scalars(done, scalars)
        guard.finite_metrics(scalars)
        writer.histograms(
          done, {k[len("hist/") :]: v for k, v in m.items() if k.startswith("hist/")}
        )
        writer.text(done, "samples", _text_summary(exp.task, m, tr.text_samples))
        logging.info(progress.line(done, scalars))
      if done % tr.eval_every == 0 or done == tr.num_steps:
        evaluate(done)
      ckpt.save(done, state, data_iter=train_iter, meta=exp.meta, force=done in (end, tr.num_steps))
    ckpt.wait()
    if end == tr.num_steps:
      writer.session_end(end)
    times = (time.time() - wall_start, t_compiled, time.time())
    log_summary(workdir, str(ckpt.directory), start, end, *times, tokens, evals)
  finally:
    ckpt.close()  # pending saves finish (or fail) before the error propagates
    writer.close()
  return last_eval


def log_summary(
  workdir: str,
  checkpoints: str,
  start: int,
  end: int,
  wall_s: float,
  t_compiled: float,
  t_end: float,
  tokens: float,
  evals: Sequence[tuple[int, Mapping[str, float]]],
) -> None:
  """The run's last lines: steps, wall time, RL steps/s and generated tokens/s after
  compilation, first and final evaluation, and where checkpoints and events are."""
  steady = max(t_end - t_compiled, 1e-9)
  logging.info(
    "trained RL steps %d..%d in %s wall time | %.3g steps/s, %.3g generated tokens/s after the "
    "first (compiling) step",
    start,
    end,
    metrics_lib.format_duration(wall_s),
    (end - start - 1) / steady if end - start > 1 else float("nan"),
    tokens / steady if end - start > 1 else float("nan"),
  )
  if evals:
    (s0, first), (s1, last) = evals[0], evals[-1]
    pairs = [
      f"{k.removeprefix('eval/')} {first[k]:.3g} -> {v:.3g}" for k, v in last.items() if k in first
    ]
    if s1 != s0:
      logging.info("eval from step %d to %d: %s", s0, s1, ", ".join(pairs))
  logging.info(
    "checkpoints in %s | events in %s: tensorboard --logdir %s",
    checkpoints,
    workdir,
    workdir,
  )
