"""`train_pack(configs, root)`: the loop of a pack (see `run.pack`), run for run as
`train_and_evaluate` runs one: each run's events, evaluations and summary in `ROOT/<name>`, the
pack's checkpoints in `ROOT/checkpoints`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxrl_llm import checkpoint as ckpt_lib
from jaxrl_llm import distributed, paths, sharding
from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.config import ConfigError
from jaxrl_llm.rl import init_reference
from jaxrl_llm.run import record
from jaxrl_llm.run.assemble import run_meta, to_global_batch, verify_on_host
from jaxrl_llm.run.guard import SkipGuard
from jaxrl_llm.run.loop import Logger, eval_line, finished_run, resume_target
from jaxrl_llm.run.pack import (
  Pack,
  PackIterator,
  batch_to_device,
  build_pack,
  own_runs,
  pack_iterator,
  packed_keys,
  per_run_sharding,
  to_rows,
  unstack,
)
from jaxrl_llm.run.preempt import StopSignals
from jaxrl_llm.run.warm_start import warm_start


@dataclasses.dataclass
class _Run:
  """One run of a pack as its user sees it: its folder, events, evaluations and log lines."""

  name: str
  workdir: str
  writer: Any
  history: list = dataclasses.field(default_factory=list)  # (step, eval scalars)
  logger: Logger | None = None


class PackEvaluator:
  """The held-out set on the devices, evaluated for every run of the pack in one program;
  each run's scalars go to its own events and history."""

  def __init__(self, pack: Pack, runs: list[_Run]):
    exp = pack.exp
    eval_np, self.answers = exp.task.eval_set(multiple_of=sharding.batch_size_divisor(exp.mesh))
    # Every process holds the whole evaluation set and feeds the rows its devices hold.
    own = distributed.own_block(exp.batch_sharding, (len(eval_np["tokens"]),))[0]
    self.batch = to_global_batch({k: v[own] for k, v in eval_np.items()}, exp.batch_sharding)
    keys = [np.asarray(jax.random.PRNGKey(c.seed + 7)) for c in pack.configs]  # a run's own
    self.keys = jax.device_put(np.stack(keys), per_run_sharding(exp.mesh))
    self.pack, self.runs = pack, runs

  def __call__(self, step: int, params) -> None:
    """Evaluates every run's `params` (stacked), writes and logs each run's scalars."""
    t = time.time()
    m = self.pack.exp.eval_fn(params, self.batch, self.keys, self.answers, self.pack.values)
    m = jax.device_get(m)
    for r, run in enumerate(self.runs):
      own = metrics_lib.flatten_metrics({k: v[r] for k, v in m.items()})
      run.writer.scalars(step, own)
      run.history.append((step, own))
      logging.info("[%s] eval step %d: %s", run.name, step, eval_line(own))
    logging.info("evaluated %d runs in %.1fs", len(self.runs), time.time() - t)


def _warm_started(pack: Pack, runs: list[_Run]):
  """Every run's state after the supervised warm start, run once per seed (it depends on
  nothing else a pack may vary); its events are in the first such run's `sft` folder."""
  by_seed, states = {}, []
  for r, cfg in enumerate(pack.configs):
    own = unstack(pack.state, r, pack.exp.state_shardings)
    if cfg.seed not in by_seed:
      view = dataclasses.replace(pack.run(r), state=own)
      by_seed[cfg.seed] = warm_start(view, runs[r].workdir).params
    states.append(own.replace(params=by_seed[cfg.seed]))
  return pack.stacked(states)


def _restore(pack: Pack, ckpt, data: PackIterator):
  """The pack's newest checkpoint that verifies (state, data positions), or None; one of
  another grid or model is refused with one line."""
  state = init_reference(pack.state, pack.configs[0].kl.beta)
  stored = pack.exp.stored(state)  # under adapters the adapters alone, as a single run's
  abstract, expect = resume_target(stored, pack.meta(), keys=("model", "pack", "base"))
  resumed = ckpt.restore_latest(abstract, data_iter=data, expect=expect)
  return None if resumed is None else pack.exp.from_stored(resumed[1])


def _initial_state(pack: Pack, ckpt, data: PackIterator, runs: list[_Run], root: str):
  """The pack's newest checkpoint, else the warm start (saved as step 0), else the fresh
  state."""
  state = _restore(pack, ckpt, data)
  if state is not None:
    logging.info("resumed the pack in %s at step %d", root, _step_of(state))
    return state
  state = init_reference(pack.state, pack.configs[0].kl.beta)
  if pack.configs[0].sft.steps:
    state = init_reference(_warm_started(pack, runs), pack.configs[0].kl.beta)
    ckpt.save(0, pack.exp.stored(state), data_iter=data, meta=pack.meta(), force=True)
  return state


def _step_of(state) -> int:
  """The pack's step (its runs step together), read from this process's own runs."""
  return int(distributed.local_block(state.step)[0])


def _loop(pack: Pack, state, data: PackIterator, ckpt, runs: list[_Run], evaluate):
  """RL updates of every run from the pack's step to the end of this invocation. On SIGTERM
  it saves the step just finished and raises `Preempted`; on SIGINT, KeyboardInterrupt (after
  the step when a library caught the first one), as a single run's loop."""
  cfg = pack.configs[0]
  tr, start = cfg.train, _step_of(state)
  end = min(tr.num_steps, start + tr.stop_after_steps) if tr.stop_after_steps else tr.num_steps
  logging.info("compiling the packed RL step of %d runs ...", pack.size)
  with StopSignals() as signals:
    for step in range(start, end):
      state = _step(pack, state, data, ckpt, runs, evaluate, step, end)
      signals.after_step(
        step + 1, end, ckpt, pack.exp.stored(state), data_iter=data, meta=pack.meta()
      )
  return state, end


def _step(pack: Pack, state, data: PackIterator, ckpt, runs: list[_Run], evaluate, step, end):
  """Every run's RL update with its logging, evaluation and the pack's checkpoint."""
  cfg = pack.configs[0]
  tr, updates = cfg.train, cfg.rl.num_epochs * cfg.rl.num_minibatches
  update = _host_reward_update if pack.exp.task.rewards_on_host else _fused_update
  state, host = update(pack, state, next(data), packed_keys(state.rng, step))
  done = step + 1
  for r, run in enumerate(runs):
    own = {k: v[r] for k, v in host.items()}
    run.logger.guard.update(done, int(own["optim/skipped_updates"]), updates=updates)
    run.logger.step(done, own)
  if done % tr.eval_every == 0 or done == tr.num_steps:
    evaluate(done, state.params)
  force = done in (end, tr.num_steps)
  ckpt.save(done, pack.exp.stored(state), data_iter=data, meta=pack.meta(), force=force)
  return state


def _fused_update(pack: Pack, state, np_batch: dict, keys):
  """Every run's RL update in the pack's fused step; returns (state, host metrics [R])."""
  batch = batch_to_device(np_batch, pack.exp.mesh)
  state, metrics = pack.exp.program.step(state, batch, keys, pack.values)
  return state, distributed.host_values(metrics)  # rows gathered from every process


def _host_reward_update(pack: Pack, state, np_batch: dict, keys):
  """Every run's RL update with host verifiers: the packed sampler, then each run's decoded
  completions scored against its own prompts' answers, then the packed learner (as
  `host_reward_step` does for one run: each process scores its own rows, and the verifier
  counts are summed over processes); returns (state, host metrics [R])."""
  exp = pack.exp
  rollout = exp.program.sample(state, batch_to_device(np_batch, exp.mesh), keys, pack.values)
  tokens = distributed.local_block(rollout.tokens)  # [R_local, B_local, T]
  runs = own_runs(pack)
  answers = np_batch["answer"]
  scored = [verify_on_host(pack.run(r), tokens[i], answers[i]) for i, r in enumerate(runs)]
  terms = {
    k: to_rows(np.stack([t[k] for t, _ in scored]).astype(np.float32), exp.mesh)
    for k in scored[0][0]
  }
  state, metrics = exp.program.learn(state, rollout, terms, keys, pack.values)
  host = distributed.host_values(metrics)
  names = sorted(scored[0][1])
  own = np.zeros((pack.size, len(names)), np.float64)  # runs of other processes count 0 here
  own[runs.start : runs.stop] = [[s[k] for k in names] for _, s in scored]
  counts = distributed.summed(own)
  host.update({k: counts[:, i].astype(np.float32) for i, k in enumerate(names)})
  return state, host


def _open_runs(pack: Pack, runs: list[_Run], start: int, hparam_fields: Sequence[str]) -> None:
  """Each run's events (data statistics from step 0, config record, HParams with the varied
  fields) and its logger from step `start`."""
  exp, tr = pack.exp, pack.configs[0].train
  fields = [*hparam_fields, *pack.varied]
  for r, run in enumerate(runs):
    run.writer = metrics_lib.SummaryWriter(run.workdir)
    if start == 0:
      run.writer.scalars(0, exp.task.data_stats)
    hparams = record.run_hparams(pack.configs[r], exp.state.params, fields)
    trial = record.trial_name(pack.configs[r], fields, run.name)
    record.record_run(pack.configs[r], run.workdir, run.writer, start, hparams, trial)
    run.writer.restart(start + 1)  # what a launch logged past the checkpoint resumed from goes
    guard = SkipGuard(tr.max_skipped_updates, "rl")
    run.logger = Logger(pack.run(r), run.writer, guard, start, run.name)


def _close_runs(runs: list[_Run], ckpt, span: tuple[int, int], wall_start: float, last: int):
  """Each run's session end (when the pack reached `last`) and closing summary."""
  for run in runs:
    if span[1] == last:
      run.writer.session_end(last)
    times = (time.time() - wall_start, run.logger.t_loop, run.logger.t_compiled, time.time())
    tokens = run.logger.tokens
    record.log_summary(run.workdir, str(ckpt.directory), span, times, tokens, run.history)


def train_pack(
  configs: Sequence[Any],
  root: str,
  *,
  names: Sequence[str] | None = None,
  hparam_fields: Sequence[str] = (),
) -> dict[str, dict[str, float]]:
  """Trains the runs `configs` (Configs or ConfigDicts) as one pack in `root`, resuming from
  its latest checkpoint; returns each run's last evaluation by name. `hparam_fields`: fields
  to list in the HParams view beside `record.HPARAM_FIELDS` and the varied ones."""
  wall_start = time.time()
  pack = build_pack(configs, names)
  try:
    for cfg in pack.configs:  # every process started with the same grid
      distributed.check_same_config(cfg)
  except ValueError as err:
    raise ConfigError(str(err)) from None
  tr = pack.configs[0].train
  exp = pack.exp
  rl = exp.program.learner.settings.rl
  record.log_banner(exp.state.params, exp.model.cfg, exp.mesh, root, exp.config, rl)
  logging.info("a pack of %d runs varying %s", pack.size, ", ".join(pack.varied) or "nothing")
  runs = [_Run(name, paths.join(root, name), None) for name in pack.names]
  ckpt = ckpt_lib.Checkpointer(root, save_every=tr.checkpoint_every, max_to_keep=tr.max_to_keep)
  try:
    data = pack_iterator(pack)
    state = _initial_state(pack, ckpt, data, runs, root)  # another grid: refused here
    start = _step_of(state)
    if start >= tr.num_steps:  # finished: each run's last evaluation, nothing written
      return {run.name: finished_run(run.workdir, start, tr.num_steps) for run in runs}
    _open_runs(pack, runs, start, hparam_fields)
    evaluate = PackEvaluator(pack, runs)
    if start == 0:
      evaluate(0, state.params)
    state, end = _loop(pack, state, data, ckpt, runs, evaluate)
    ckpt.wait()
    _close_runs(runs, ckpt, (start, end), wall_start, tr.num_steps)
  finally:
    ckpt.close()
    for run in runs:
      if run.writer is not None:
        run.writer.close()
  return {run.name: run.history[-1][1] if run.history else {} for run in runs}


def take_out(
  configs: Sequence[Any], root: str, name: str, workdir: str, *, names: Sequence[str] | None = None
) -> int:
  """Writes run `name` of the pack in `root` (built from `configs` and `names` as trained) as
  a single run's workdir: its events and config, and its state and data position at the
  pack's newest checkpoint, which `train_and_evaluate(its config, workdir)` (or the command
  line) continues alone. Returns that step; nothing in `root` changes."""
  pack = build_pack(configs, names)
  if name not in pack.names:
    raise ConfigError(f"the pack in {root} has no run {name!r}; its runs: {pack.names}")
  r, tr = pack.names.index(name), pack.configs[0].train
  if len(own_runs(pack)) < pack.size:
    raise ConfigError(
      f"take_out needs every run's data position in each process; mesh.runs="
      f"{pack.exp.mesh.shape[sharding.RUNS_AXIS]} spreads the runs over the processes: take a run out "
      "on one process (or from a pack trained with mesh.runs=1)"
    )
  data = pack_iterator(pack)
  with ckpt_lib.Checkpointer(root, save_every=tr.checkpoint_every) as ckpt:
    state = _restore(pack, ckpt, data)
  if state is None:
    raise ConfigError(f"{root} holds no checkpoint of this pack to take run {name!r} out of")
  step, cfg = _step_of(state), pack.configs[r]
  shardings = pack.exp.state_shardings
  if state.ref_params is not None:
    shardings = shardings.replace(ref_params=shardings.params)
  own = unstack(state, r, shardings)
  for f in paths.files_under(paths.join(root, name)):  # its events, config and warm start
    target = paths.as_path(workdir) / f.relative_to(paths.as_path(paths.join(root, name)))
    target.parent.mkdir(parents=True, exist_ok=True)
    f.copy(target, overwrite=True)
  meta = run_meta(cfg, pack.exp.model.cfg)
  with ckpt_lib.Checkpointer(workdir, save_every=tr.checkpoint_every) as out:
    out.save(step, pack.exp.stored(own), data_iter=data.iterators[r], meta=meta, force=True)
  logging.info("took run %s out of the pack in %s at step %d into %s", name, root, step, workdir)
  return step
