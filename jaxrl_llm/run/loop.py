"""`train_and_evaluate(config, workdir)`: the loop of a run (no flag parsing).

Order of a run: parse and check the config → assemble mesh, task, model, programs → restore
the latest checkpoint of `workdir` if there is one, else run the supervised warm start (if
configured) → RL updates with periodic held-out evaluation, TensorBoard summaries and orbax
checkpoints → the closing summary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging

from jaxrl_llm import checkpoint as ckpt_lib
from jaxrl_llm import distributed, paths, sharding
from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.config import Config, ConfigError, parse
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rl import init_reference
from jaxrl_llm.run import record
from jaxrl_llm.run.assemble import NUMERICS_ONLY, Experiment, build, to_global_batch
from jaxrl_llm.run.guard import SkipGuard, VerifierGuard
from jaxrl_llm.run.preempt import StopSignals
from jaxrl_llm.run.warm_start import warm_start


class Evaluator:
  """The held-out set on the devices and the evaluations made so far."""

  def __init__(self, exp: Experiment, writer):
    cfg, task = exp.config, exp.task
    eval_np, self.answers = task.eval_set(multiple_of=sharding.batch_size_divisor(exp.mesh))
    # Every process holds the whole evaluation set and feeds the rows its devices hold.
    own = distributed.own_block(exp.batch_sharding, (len(eval_np["tokens"]),))[0]
    self.batch = to_global_batch({k: v[own] for k, v in eval_np.items()}, exp.batch_sharding)
    self.key = jax.random.PRNGKey(cfg.seed + 7)
    self.exp, self.writer = exp, writer
    self.history: list[tuple[int, dict[str, float]]] = []

  def __call__(self, step: int, params) -> dict[str, float]:
    """Evaluates `params`, writes and logs the scalars at `step`."""
    if not self.history:
      logging.info("compiling the held-out evaluation (its first run includes compilation) ...")
    t = time.time()
    m = self.exp.eval_fn(params, self.batch, self.key, self.answers)
    m = metrics_lib.flatten_metrics(m)
    self.writer.scalars(step, m)
    self.history.append((step, m))
    logging.info("eval step %d: %s (%.1fs)", step, eval_line(m), time.time() - t)
    return m


def eval_line(m: dict[str, float]) -> str:
  """An evaluation's scalars as one log line: `accuracy 0.5 pass@4 0.75 ...`."""
  return " ".join(f"{k.removeprefix('eval/')} {v:.3g}" for k, v in m.items())


def resume_target(state, meta: dict, keys: Sequence[str] = ("model",)):
  """(abstract `state`, MetaCheck of `meta` under `keys`): what a resume restores into and
  holds the saved meta against (model fields added since an old checkpoint default)."""
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
  )
  defaults = {"model": ModelConfig().to_dict()}  # fields added since it was written
  return abstract, ckpt_lib.MetaCheck(meta, keys=keys, defaults=defaults, ignore=NUMERICS_ONLY)


def train_iterator(exp: Experiment, shard: tuple[int, int] | None = None):
  """This process's share of the prompts of every RL update, resumable: block `shard` =
  (index, count) of each batch's rows (default: the block its devices hold of a run's batch)."""
  cfg = exp.config
  prompts = cfg.sampled_prompts
  index, count = shard or distributed.shard_of(exp.batch_sharding, (prompts,), 0)
  return exp.task.train_iterator(prompts // count, cfg.seed, shard_index=index, shard_count=count)


def _initial_state(exp: Experiment, ckpt, train_iter, workdir: str):
  """The newest checkpoint that verifies (bad ones set aside), else the warm start (saved as
  step 0, so a relaunch does not redo it), else the fresh state."""
  beta = exp.config.kl.beta
  state = init_reference(exp.state, beta)
  abstract, expect = resume_target(exp.stored(state), exp.meta, keys=("model", "base"))
  resumed = ckpt.restore_latest(abstract, data_iter=train_iter, expect=expect)
  if resumed is not None:
    latest, stored, _ = resumed
    state = exp.from_stored(stored)
    logging.info("resumed from %s at step %d", workdir, latest)
  elif exp.config.sft.steps:
    state = init_reference(warm_start(exp, workdir), beta)
    ckpt.save(0, exp.stored(state), data_iter=train_iter, meta=exp.meta, force=True)
  return state


def finished_run(workdir: str, start: int, num_steps: int) -> dict[str, float]:
  """A finished workdir's last evaluation (nothing is written)."""
  logging.info(
    "%s already holds step %d of train.num_steps=%d: nothing to train", workdir, start, num_steps
  )
  saved = metrics_lib.read_scalars(workdir) if jax.process_index() == 0 else {}
  return {k: v[-1][1] for k, v in saved.items() if k.startswith("eval/") and v}


class Logger:
  """The loop's clock and its logged steps: scalars, histograms, samples, progress line."""

  def __init__(self, exp: Experiment, writer, guard: SkipGuard, start: int, name: str = ""):
    self.exp, self.writer, self.guard, self.start = exp, writer, guard, start
    self.prefix = f"[{name}] " if name else ""  # a packed run's lines start with its name
    cfg = exp.config
    calls = cfg.rl.num_prompts * cfg.sampling.group_size  # each host term's calls per step
    timeout = cfg.data.verifier_timeout_s
    limit = cfg.train.max_failed_verifier_steps
    self.verifiers = VerifierGuard(limit, calls, timeout, self.prefix)
    self.progress = metrics_lib.Progress(exp.config.train.num_steps)
    self.t_loop = self.t_last = self.t_compiled = time.time()
    self.last_logged, self.tokens = start, 0.0

  def step(self, done: int, metrics) -> None:
    """Accounts one finished update; logs it on the logging period; stops the run
    (`VerifierError`) when a host verifier has failed every call for too many steps."""
    tr = self.exp.config.train
    if done > self.start + 1:  # tokens/s of the steady state, as the rate
      self.tokens += float(metrics["perf/generated_tokens"])
    if done == self.start + 1:  # compile + first update: excluded from the rate and ETA
      self.t_compiled = time.time()
      self.progress.mark(done, self.t_compiled)
      logging.info("RL step compiled; first update done in %.1fs", self.t_compiled - self.t_loop)
    if done % tr.log_every == 0 or done == tr.num_steps:
      self._log(done, distributed.host_values(metrics))  # rows gathered from every process
    self.verifiers.update(done, metrics)  # after the step's scalars are logged

  def _log(self, done: int, m) -> None:
    now = time.time()
    dt = (now - self.t_last) / max(done - self.last_logged, 1)
    self.t_last, self.last_logged = now, done
    if done > self.start + 1:
      self.progress.mark(done, now)
    scalars = {k: float(v) for k, v in m.items() if np.ndim(v) == 0}
    scalars["perf/step_time_s"] = dt
    scalars["perf/generated_tokens_per_s"] = scalars["perf/generated_tokens"] / dt
    scalars["perf/learner_tokens_per_s"] = scalars["perf/learner_tokens"] / dt
    self.writer.scalars(done, scalars)
    self.guard.finite_metrics(scalars)
    hists = {k[len("hist/") :]: v for k, v in m.items() if k.startswith("hist/")}
    self.writer.histograms(done, hists)
    limit = self.exp.config.train.text_samples
    self.writer.text(done, "samples", record.text_summary(self.exp.task, m, limit))
    logging.info(self.prefix + self.progress.line(done, scalars))


class Profiler:
  """A jax.profiler trace of `train.profile_steps` updates after the compiling one, into
  `<workdir>/plugins/profile` (TensorBoard's Profile tab); in a local workdir also as
  `perfetto_trace.json.gz` beside it, which `tools/trace_summary.py <workdir>` reads."""

  def __init__(self, steps: int, start: int, end: int, workdir: str):
    self.steps, self.start, self.end, self.workdir = steps, start, end, workdir
    self.active = False

  def before(self, step: int) -> None:
    """Starts the trace before the first update after the compiling one."""
    if self.steps and step == self.start + 1 and jax.process_index() == 0:
      perfetto = not paths.is_remote(self.workdir)  # JAX writes that file with pathlib only
      jax.profiler.start_trace(self.workdir, create_perfetto_trace=perfetto)
      self.active = True

  def after(self, done: int, state) -> None:
    """Stops the trace after `steps` updates (or at the end of this invocation)."""
    if self.active and (done == self.start + 1 + self.steps or done == self.end):
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active = False
      logging.info(
        "profiled steps %d..%d into %s/plugins/profile", self.start + 2, done, self.workdir
      )


def _loop(exp: Experiment, state, train_iter, ckpt, evaluate: Evaluator, logger: Logger, workdir):
  """RL updates from the state's step to the end of this invocation; returns the state. On
  SIGTERM it saves the step just finished and raises `Preempted`; on SIGINT, KeyboardInterrupt
  (after the step when a library caught the first one)."""
  tr, start = exp.config.train, int(state.step)
  end = min(tr.num_steps, start + tr.stop_after_steps) if tr.stop_after_steps else tr.num_steps
  profiler = Profiler(tr.profile_steps, start, end, workdir)
  logging.info("compiling the RL step (its first run includes compilation) ...")
  with StopSignals() as signals:
    for step in range(start, end):
      state = _step(exp, state, train_iter, ckpt, evaluate, logger, profiler, step, end)
      signals.after_step(
        step + 1, end, ckpt, exp.stored(state), data_iter=train_iter, meta=exp.meta
      )
  return state, end


def _step(exp, state, train_iter, ckpt, evaluate, logger, profiler, step: int, end: int):
  """One RL update with its logging, evaluation and checkpoint; returns the new state."""
  tr = exp.config.train
  updates = exp.config.rl.num_epochs * exp.config.rl.num_minibatches
  profiler.before(step)
  state, metrics = exp.update(state, next(train_iter), jax.random.fold_in(state.rng, step))
  done = step + 1
  logger.guard.update(done, int(metrics["optim/skipped_updates"]), updates=updates)
  profiler.after(done, state)
  logger.step(done, metrics)
  if done % tr.eval_every == 0 or done == tr.num_steps:
    evaluate(done, state.params)
  last = done in (end, tr.num_steps)
  ckpt.save(done, exp.stored(state), data_iter=train_iter, meta=exp.meta, force=last)
  return state


def train_and_evaluate(
  cfg: Config, workdir: str, *, hparam_fields: Sequence[str] = ()
) -> dict[str, float]:
  """Runs the experiment `cfg` (a `Config`; an experiment ConfigDict is parsed first) in
  `workdir`, resuming from its latest checkpoint; returns the last evaluation.
  `hparam_fields`: config fields to list in the HParams view beside `record.HPARAM_FIELDS`
  (the command line passes the fields it overrides)."""
  wall_start, cfg = time.time(), parse(cfg)
  try:
    distributed.check_same_config(cfg)
  except ValueError as err:
    raise ConfigError(str(err)) from None
  exp = build(cfg)
  rl = exp.program.learner.settings.rl
  record.log_banner(exp.state.params, exp.model.cfg, exp.mesh, workdir, cfg, rl)
  tr, writer = cfg.train, metrics_lib.SummaryWriter(workdir)
  ckpt = ckpt_lib.Checkpointer(workdir, save_every=tr.checkpoint_every, max_to_keep=tr.max_to_keep)
  try:
    train_iter = train_iterator(exp)
    evaluate = Evaluator(exp, writer)
    changed = record.changed_learner(cfg, workdir)
    if changed and not tr.resume_changed:
      raise ConfigError(
        f"{workdir} holds a run with other settings of what is learned ({'; '.join(changed)}): "
        "resume it under these with --config.train.resume_changed=True, or give a fresh --workdir"
      )
    state = _initial_state(exp, ckpt, train_iter, workdir)
    start = int(state.step)
    if start >= tr.num_steps:  # a finished workdir: report its last evaluation, write nothing
      return finished_run(workdir, start, tr.num_steps)
    if changed:
      logging.warning("resuming %s under changed settings: %s", workdir, "; ".join(changed))
    hparams = record.run_hparams(cfg, exp.state.params, hparam_fields)
    trial = record.trial_name(cfg, hparam_fields, paths.as_path(workdir).name)
    record.record_run(cfg, workdir, writer, start, hparams, trial)
    writer.restart(start + 1)  # what a launch logged past the checkpoint resumed from goes
    if start == 0:
      writer.scalars(0, exp.task.data_stats)  # file data: records read, too long (dropped), kept
      evaluate(0, state.params)
    logger = Logger(exp, writer, SkipGuard(tr.max_skipped_updates, "rl"), start)
    state, end = _loop(exp, state, train_iter, ckpt, evaluate, logger, workdir)
    ckpt.wait()
    if end == tr.num_steps:
      writer.session_end(end)
    times = (time.time() - wall_start, logger.t_loop, logger.t_compiled, time.time())
    record.log_summary(
      workdir, str(ckpt.directory), (start, end), times, logger.tokens, evaluate.history
    )
  finally:
    ckpt.close()  # pending saves finish (or fail) before the error propagates
    writer.close()
  return evaluate.history[-1][1] if evaluate.history else {}
