"""The one loop of a run: `train(trainee)` trains a single run (`SingleRun`, from
`train_and_evaluate`) or a pack of runs (`run.packed.PackedRuns`, from `train_pack`) through
the same path. A single run is a pack of one: one member, no runs axis.

Order: check the records of what each run learned (a changed learner setting is refused
without train.resume_changed) → restore the newest checkpoint that verifies, else run the
supervised warm start (if configured), else start fresh → RL updates with periodic held-out
evaluation, TensorBoard summaries, profiling and orbax checkpoints (SIGTERM: save and stop) →
each run's closing summary. Each run keeps its own folder, events, log lines and evaluations;
the checkpoints and the profile trace are the trainee's (`root`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from jaxrl_llm import checkpoint as ckpt_lib
from jaxrl_llm import checkpoint_compat, distributed, paths, sigterm
from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.config import Config, ConfigError, tagged
from jaxrl_llm.models.config import RESUME_SPELLINGS, ModelConfig
from jaxrl_llm.rl import init_reference
from jaxrl_llm.run import changes, held_out, preempt, record
from jaxrl_llm.run.assemble import Experiment, build
from jaxrl_llm.run.guard import NonFiniteError, SkipGuard, VerifierError
from jaxrl_llm.run.held_out import Evaluator
from jaxrl_llm.run.preempt import StopSignals
from jaxrl_llm.run.step_log import Logger, Profiler
from jaxrl_llm.run.warm_start import warm_start


@dataclasses.dataclass
class Member:
  """One run of a trainee as its user sees it: its name (its log lines' prefix; "" for a
  single run), its `Experiment` view (its own config; the shared task, mesh and programs), its
  folder, events, evaluations and logger."""

  name: str
  exp: Experiment
  workdir: str
  writer: Any = None
  history: list = dataclasses.field(default_factory=list)  # (step, eval scalars)
  logger: Logger | None = None
  stopped: str = ""  # why its guards stopped it (a pack's other runs go on); "" while it runs
  label: str = ""  # its short name in a pack's progress lines (its HParams trial id)

  @property
  def config(self) -> Config:
    """The run's settings."""
    return self.exp.config

  @property
  def prefix(self) -> str:
    """What starts the run's log lines: `[name] ` in a pack, nothing alone."""
    return f"[{self.name}] " if self.name else ""


class SingleRun:
  """A single run as the loop trains it: a pack of one, its programs without a runs axis, its
  checkpoints in its own workdir."""

  resume_keys = ("model", "base")  # the checkpoint meta a resume must match
  varied: tuple[str, ...] = ()  # fields that differ between the members (none)
  intro = ""  # what the loop says of the trainee after the banner

  def __init__(self, exp: Experiment, workdir: str):
    self.exp, self.root = exp, workdir
    self.members = [Member("", exp, workdir)]
    self.key = jax.random.PRNGKey(exp.config.seed + 7)  # the evaluation's (pass@k draws)

  def meta(self) -> dict:
    """What the run's checkpoints record (`assemble.run_meta`)."""
    return self.exp.meta

  def fresh_state(self):
    """The state before any update (no reference copy yet)."""
    return self.exp.state

  def warm_started(self):
    """The state after the supervised warm start."""
    return warm_start(self.exp, self.root)

  def step_of(self, state) -> int:
    """The RL updates `state` has taken."""
    return int(state.step)

  def data(self):
    """This process's share of every update's prompts, resumable."""
    return train_iterator(self.exp)

  def update(self, state, np_batch: dict, step: int):
    """One RL update: (state, [its metrics])."""
    state, metrics = self.exp.update(state, np_batch, jax.random.fold_in(state.rng, step))
    return state, [metrics]

  def evaluate(self, params, batch, answers) -> list[dict]:
    """[the held-out evaluation's metrics of `params`]."""
    return [self.exp.eval_fn(params, batch, self.key, answers)]


def resume_target(state, meta: dict, keys: Sequence[str] = ("model",)):
  """(abstract `state` or None, MetaCheck of `meta` under `keys`): what a resume restores into
  and holds the saved meta against (model fields added since an old checkpoint default; fields
  declared numerics-only may differ; adapter targets compare as the projections they name)."""
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
  )
  defaults, spell = {"model": ModelConfig().to_dict()}, RESUME_SPELLINGS
  return abstract, checkpoint_compat.MetaCheck(meta, keys, defaults, tagged("numerics"), spell)


def train_iterator(exp: Experiment, shard: tuple[int, int] | None = None):
  """This process's share of the prompts of every RL update, resumable: block `shard` =
  (index, count) of each batch's rows (default: the block its devices hold of a run's batch)."""
  cfg = exp.config
  prompts = cfg.sampled_prompts
  index, count = shard or distributed.shard_of(exp.batch_sharding, (prompts,), 0)
  setting = f"rl.num_prompts={cfg.rl.num_prompts}" + (
    f" (x filtering.oversample: {prompts} drawn)" if prompts != cfg.rl.num_prompts else ""
  )
  return exp.task.train_iterator(
    prompts // count, cfg.seed, shard_index=index, shard_count=count, setting=setting
  )


def restore(trainee, ckpt, data, state=None):
  """The trainee's newest checkpoint that verifies (bad ones set aside) as its state, the data
  positions set; None without one. Refused: another run, grid or model, or a misnamed step.
  `state`: the fresh state with its reference copy, when the caller made it already."""
  if state is None:
    state = init_reference(trainee.fresh_state(), trainee.exp.config.kl.beta)
  abstract, expect = resume_target(trainee.exp.stored(state), trainee.meta(), trainee.resume_keys)
  resumed = ckpt.restore_latest(abstract, data_iter=data, expect=expect)
  if resumed and trainee.step_of(state := trainee.exp.from_stored(resumed[1])) != resumed[0]:
    raise ckpt.misnamed(resumed[0], trainee.step_of(state))  # a folder renamed or copied in
  return state if resumed else None


def _start_state(trainee, ckpt, data):
  """The newest checkpoint, else the warm start (saved as step 0, so a relaunch does not redo
  it), else the fresh state."""
  beta = trainee.exp.config.kl.beta
  fresh = init_reference(trainee.fresh_state(), beta)
  state = restore(trainee, ckpt, data, fresh)
  if state is not None:
    logging.info("resumed from %s at step %d", trainee.root, trainee.step_of(state))
    return state
  if trainee.exp.config.sft.steps:
    state = init_reference(trainee.warm_started(), beta)
    ckpt.save(0, trainee.exp.stored(state), data_iter=data, meta=trainee.meta(), force=True)
    sigterm.unsaved(False)  # checkpoint 0 holds it: a stop in the first evaluation loses nothing
    return state
  return fresh


def _changed_settings(trainee, ckpt) -> list[str]:
  """Each run's learner settings that differ from those its folder recorded (`[name] ` in
  front in a pack); raises ConfigError unless train.resume_changed, and always for a term
  switched on or off (`changes.switched`). A checkpoint of another model or grid is refused
  first (CheckpointMismatchError, as the restore would): no setting lets a resume cross that."""
  changed, switched, steps = [], [], ckpt.all_steps()
  at = steps[-1] if steps else None  # records of launches that saved nothing past it: unread
  for member in trainee.members:
    cfg, workdir, prefix = member.config, member.workdir, member.prefix
    changed += [prefix + c for c in changes.changed_learner(cfg, workdir, at)]
    changed += [prefix + c for c in changes.changed_data(cfg, workdir, at)]
    switched += [prefix + c for c in changes.switched(cfg, workdir, at)]
  if (changed or switched) and steps:
    ckpt.check_meta(steps[-1], resume_target(None, trainee.meta(), trainee.resume_keys)[1])
  if switched:
    raise ConfigError(
      f"{trainee.root} holds a run whose checkpoints differ in kind from this one's "
      f"({'; '.join(switched)}: on or off, the reference model or the optimiser's clip state "
      "is in the checkpoint or not); no resume crosses that, train.resume_changed or not: keep "
      "each on (> 0) or off (0) as it was, or give a fresh --workdir"
    )
  if changed and not trainee.exp.config.train.resume_changed:
    raise ConfigError(
      f"{trainee.root} holds a run with other settings of what is learned "
      f"({'; '.join(changed)}): resume it under these with "
      "--config.train.resume_changed=True, or give a fresh --workdir"
    )
  return changed


@dataclasses.dataclass
class _Pass:
  """What one invocation of the loop carries from step to step."""

  trainee: Any
  data: Any  # the prompt iterator (its position is checkpointed)
  ckpt: Any
  evaluate: Evaluator
  profiler: Profiler
  start: int  # the step this invocation resumed from
  end: int  # the step it stops after
  t0: float = dataclasses.field(default_factory=time.time)  # when the first update began


def _loop(trainee, state, data, ckpt, evaluate: Evaluator):
  """RL updates of every member from the trainee's step to the end of this invocation;
  returns (state, end). On SIGTERM it saves the step just finished and raises `Preempted`; on
  SIGINT, KeyboardInterrupt (after the step when a library caught the first one)."""
  tr, start = trainee.exp.config.train, trainee.step_of(state)
  end = min(tr.num_steps, start + tr.stop_after_steps) if tr.stop_after_steps else tr.num_steps
  what = f" of {len(trainee.members)} runs" if len(trainee.members) > 1 else ""
  logging.info("compiling the RL step%s (its first run includes compilation) ...", what)
  run = _Pass(
    trainee, data, ckpt, evaluate, Profiler(tr.profile_steps, start, end, trainee.root), start, end
  )
  with StopSignals() as signals:
    for step in range(start, end):
      state = _step(run, state, step)
      stored = trainee.exp.stored(state)
      signals.after_step(step + 1, end, ckpt, stored, data_iter=data, meta=trainee.meta())
  return state, end


def _how_built(program) -> str:
  """How the RL programs this process compiled (the fused step, or the sample and learn halves)
  came to be: "loaded from the compilation cache" when every one did, else "compiled"."""
  parts = [getattr(program, p) for p in ("step", "sample", "learn")]
  built = [p for p in parts if getattr(p, "ready", None)]
  loaded = built and all(p.loaded for p in built)
  return "loaded from the compilation cache" if loaded else "compiled"


def _step(run: _Pass, state, step: int):
  """Every member's RL update with its logging, its checkpoint and then its evaluation."""
  trainee = run.trainee
  cfg = trainee.exp.config
  tr, updates = cfg.train, cfg.rl.num_epochs * cfg.rl.num_minibatches
  run.profiler.before(step)
  state, per_run = trainee.update(state, next(run.data), step)
  sigterm.unsaved(True)  # until saved: a stop while the evaluation compiles waits to save it
  done = step + 1
  for r, (member, metrics) in enumerate(zip(trainee.members, per_run, strict=True)):
    skipped = int(metrics["optim/skipped_updates"])
    _guarded(trainee, r, state, done, member.logger.guard.update, done, skipped, updates=updates)
  run.profiler.after(done, state)
  if done == run.start + 1:  # one notice per program; the first evaluation is not in it
    took = time.time() - run.t0
    logging.info("RL step %s; first update done in %.1fs", _how_built(trainee.exp.program), took)
  for r, (member, metrics) in enumerate(zip(trainee.members, per_run, strict=True)):
    _guarded(trainee, r, state, done, member.logger.step, done, metrics)
  if any(m.stopped for m in trainee.members):
    state = trainee.held(state)
  # Saved before its evaluation, which it then outlives: a relaunch evaluates a saved step
  # whose evaluation failed or stopped.
  saved = _save(run, state, done, force=done in (run.end, tr.num_steps))
  sigterm.unsaved(not saved)  # a stop during a compilation then waits to save these steps
  if held_out.evaluation_due(tr, done):
    try:
      run.evaluate(done, state.params)
    except Exception:  # out of memory, a verifier: the step is saved first (Ctrl-C saves nothing)
      if not saved and jax.process_count() == 1:  # a save is every process's: peers may not come
        _save_failed_evaluation(run, state, done)
      raise
  return state


def _save(run: _Pass, state, done: int, force: bool) -> bool:
  """Saves `state` as step `done` with the prompts' position and the run's meta when due (or
  `force`); returns whether a save began."""
  trainee = run.trainee
  stored, meta = trainee.exp.stored(state), trainee.meta()
  return run.ckpt.save(done, stored, data_iter=run.data, meta=meta, force=force)


def _save_failed_evaluation(run: _Pass, state, done: int) -> None:
  """Saves step `done`, whose evaluation failed, before the error ends the run (a relaunch
  resumes there and evaluates it first); a failing save is a warning, the evaluation's error
  the one said."""
  try:
    _save(run, state, done, force=True)
    run.ckpt.wait()
    sigterm.unsaved(False)
  except Exception as e:
    logging.warning("step %d, whose evaluation failed, is not saved: %s", done, e)


def _guarded(trainee, r: int, state, done: int, check, *args, **kwargs) -> None:
  """Runs member `r`'s `check` (its guards); when they stop it: alone, the error propagates;
  in a pack, that run alone stops (named, recorded in its folder, its state kept as it is in
  `state`) while the others go on, unless it was the last one running."""
  member = trainee.members[r]
  if member.stopped:
    return
  try:
    check(*args, **kwargs)
  except (NonFiniteError, VerifierError) as err:
    why = str(err) if str(err).startswith(member.prefix) else f"{member.prefix}{err}"
    if not [m for m in trainee.members if not m.stopped and m is not member]:
      raise type(err)(why) from None  # the last run running: the trainee stops
    _stop(trainee, r, state, why, done)


def _stop(trainee, r: int, state, why: str, done: int) -> None:
  """Stops member `r` of a pack: one error line, `<its folder>/stopped.json`, its state kept."""
  member = trainee.members[r]
  member.stopped = why
  logging.error("%s (the pack's other runs go on)", why)
  record.write_stopped(member.workdir, done, why)
  trainee.hold(r, state)


def _resume_stopped(trainee, state) -> None:
  """The runs of a pack its earlier launches stopped (`stopped.json`): kept as they are."""
  for r, member in enumerate(trainee.members):
    saved = record.read_stopped(member.workdir) if len(trainee.members) > 1 else None
    if saved:
      member.stopped = saved["why"]
      logging.warning("%sstopped at step %d earlier: kept as it is", member.prefix, saved["step"])
      trainee.hold(r, state)


def _open_members(trainee, start: int, hparam_fields: Sequence[str]) -> None:
  """Each run's events (data statistics from step 0, config record, HParams with the fields
  the command line sets and the pack varies) and its logger from step `start`."""
  fields = [*hparam_fields, *trainee.varied]
  clock = {}  # the step whose clock line a pack's runs have logged
  for member in trainee.members:
    cfg = member.config
    member.writer = metrics_lib.SummaryWriter(member.workdir)
    hparams = record.run_hparams(cfg, trainee.exp.state.params, fields)
    trial = record.trial_name(cfg, fields, member.name or paths.as_path(member.workdir).name)
    member.label = f"[{trial}] " if member.name else ""
    record.record_run(cfg, member.workdir, member.writer, start, hparams, trial, fields)
    member.writer.restart(start + 1)  # what a launch logged past the checkpoint resumed from goes
    if start == 0:
      member.writer.scalars(0, trainee.exp.task.data_stats)  # file data: read, dropped, kept
    guard = SkipGuard(cfg.train.max_skipped_updates, "rl")
    member.logger = Logger(member, guard, start, clock)


def _close_members(trainee, ckpt, span: tuple[int, int], wall_start: float, evaluate) -> None:
  """Each run's session end (when it reached train.num_steps) and closing summary; a line
  when `train.stop_after_steps` ended the invocation before the end."""
  tr = trainee.exp.config.train
  last = tr.num_steps
  for member in trainee.members:
    if member.stopped:
      member.writer.session_end(last, "failure")
    elif span[1] == last:
      member.writer.session_end(last)
    log = member.logger
    times = (time.time() - wall_start, log.t_loop, log.t_compiled, time.time())
    compiling = evaluate.compiling_after(log.t_compiled)
    evals = member.history
    record.log_summary(
      member.workdir, str(ckpt.directory), span, times, log.tokens, evals, compiling, member.label
    )
  if span[1] < last:
    evaluated = max((m.history[-1][0] for m in trainee.members if m.history), default=None)
    seen = "" if evaluated is None else f"; the last evaluation was at step {evaluated}"
    logging.info(
      "stopped after step %d of train.num_steps=%d (train.stop_after_steps=%d)%s; the same "
      "command resumes from step %d", span[1], last, tr.stop_after_steps, seen, span[1],
    )  # fmt: skip


def train(
  trainee, *, hparam_fields: Sequence[str] = (), started: float | None = None
) -> dict[str, dict[str, float]]:
  """Trains `trainee` (a `SingleRun` or a `run.packed.PackedRuns`) in its folder, resuming
  from its newest checkpoint; returns each member's last evaluation by name.
  `hparam_fields`: fields to list first in the HParams view (the command line's overrides);
  `started`: when building it began (`time.time()`; default now), the summary's wall time."""
  wall_start, exp = time.time() if started is None else started, trainee.exp
  tr = exp.config.train
  record.log_banner(
    exp.state.params,
    exp.model.cfg,
    exp.mesh,
    trainee.root,
    exp.config,
    exp.settings.rl,
    varied=trainee.varied,
  )
  if trainee.intro:
    logging.info(trainee.intro)
  # The prompts and the held-out split are read before anything is written: a file that
  # cannot serve them leaves a fresh workdir empty (`launch.remove_if_empty`).
  data, evaluate = trainee.data(), Evaluator(trainee)
  ckpt = ckpt_lib.Checkpointer(
    trainee.root, save_every=tr.checkpoint_every, max_to_keep=tr.max_to_keep
  )
  close = functools.partial(_close, trainee, ckpt)
  sigterm.unsaved(False)
  with sigterm.closing(close):  # also when a signal stops a compilation
    try:
      preempt.stop_if_asked("while the run was built, before anything was saved", trainee.root)
      changed = _changed_settings(trainee, ckpt)
      state = _start_state(trainee, ckpt, data)  # a checkpoint of another run: refused here
      start = trainee.step_of(state)
      preempt.stop_if_asked(f"while it started (at step {start})", trainee.root, start, ckpt.wait)
      _resume_stopped(trainee, state)
      missing = held_out.unevaluated(trainee, start)
      if start >= tr.num_steps and not missing:  # finished: each run's last evaluation
        return held_out.finished_run(trainee, start)
      if changed:
        logging.warning("resuming %s under changed settings: %s", trainee.root, "; ".join(changed))
      for note in changes.resume_notes(trainee.members, start):  # a schedule moved, no record
        logging.warning("resuming %s %s", trainee.root, note)
      _open_members(trainee, start, hparam_fields)
      if start == 0 or missing:
        held_out.evaluate_start(trainee, evaluate, state, start, ckpt)
      if start >= tr.num_steps:  # finished, now with its last evaluation
        for member in trainee.members:
          member.writer.session_end(start, "failure" if member.stopped else "success")
        return held_out.last_evaluations(trainee)
      state, end = _loop(trainee, state, data, ckpt, evaluate)
      ckpt.wait()
      held_out.history_from(trainee, start)
      for member in trainee.members:  # after the checkpoints: the last finite state is kept
        if not member.stopped:
          member.logger.guard.any_applied((start, end), member.prefix)
      _close_members(trainee, ckpt, (start, end), wall_start, evaluate)
    finally:
      close()  # pending saves finish (or fail) before the error propagates
  return held_out.last_evaluations(trainee)


def _close(trainee, ckpt) -> None:
  """Waits for the saves in flight and closes the members' event files."""
  ckpt.close()
  for member in trainee.members:
    if member.writer is not None:
      member.writer.close()


def train_and_evaluate(
  cfg: Config, workdir: str, *, hparam_fields: Sequence[str] = ()
) -> dict[str, float]:
  """Runs the experiment `cfg` (its `Config`) alone in `workdir`, resuming from its latest
  checkpoint; returns the last evaluation. `hparam_fields`: config fields to list first in
  the HParams view (the command line passes the fields it overrides)."""
  started = time.time()
  try:
    distributed.check_same_config(cfg)  # before anything is built: every process's config
  except ValueError as err:
    raise ConfigError(str(err)) from None
  return train(SingleRun(build(cfg), workdir), hparam_fields=hparam_fields, started=started)[""]
