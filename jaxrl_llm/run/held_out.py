"""The held-out evaluation inside the run loop: every member of a trainee evaluated in one
program (`Evaluator`), each run's scalars to its own events, history and log line."""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from jaxrl_llm import distributed, event_files, host_tool, metric_info, sharding
from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.run import preempt
from jaxrl_llm.run.assemble import to_global_batch


def eval_line(step: int, m: dict[str, float], took: float, width: int) -> str:
  """An evaluation as one log line within `width` characters: `eval step 6: accuracy 0.5
  pass@4 0.75 ... (1.2s)`, accuracy and pass@k first, the other scalars while they fit."""
  passes = sorted((k for k in m if "pass@" in k), key=metric_info.tag_order)
  first = [k for k in ["eval/accuracy", *passes] if k in m]
  shown = [
    f"{k.removeprefix('eval/')} {m[k]:.3g}" for k in [*first, *(k for k in m if k not in first)]
  ]
  while True:
    line = f"eval step {step}: {' '.join(shown)} ({took:.1f}s)"
    if len(line) <= width or len(shown) <= 1:
      return line
    shown.pop()


class Evaluator:
  """The held-out set on the devices, evaluated for every member of a trainee in one program;
  each run's scalars go to its own events, history and log line."""

  def __init__(self, trainee):
    exp = trainee.exp
    eval_np, self.answers = exp.task.eval_set(multiple_of=sharding.batch_size_divisor(exp.mesh))
    if (shortfall := getattr(exp.task, "eval_shortfall", None)) and (said := shortfall()):
      logging.warning(said)  # a built-in task's small problem space
    # Every process holds the whole evaluation set and feeds the rows its devices hold.
    own = distributed.own_block(exp.batch_sharding, (len(eval_np["tokens"]),))[0]
    self.batch = to_global_batch({k: v[own] for k, v in eval_np.items()}, exp.batch_sharding)
    self.trainee, self.calls = trainee, 0
    self.first: tuple[float, float] | None = None  # (began, seconds) of the compiling call

  def compiling_after(self, t: float) -> float:
    """Seconds of the evaluation's compiling call when it began after time `t` (a resumed
    invocation compiles it inside the RL loop), else 0."""
    return self.first[1] if self.first and self.first[0] >= t else 0.0

  def __call__(self, step: int, params) -> None:
    """Evaluates `params`, writes and logs each run's scalars at `step`."""
    if not self.calls:
      logging.info("compiling the held-out evaluation (its first run includes compilation) ...")
    self.calls += 1
    t, cut = time.time(), host_tool.CUT["calls"]
    per_run = self.trainee.evaluate(params, self.batch, self.answers)
    per_run = [metrics_lib.flatten_metrics(m) for m in per_run]
    if self.first is None:
      self.first = (t, time.time() - t)
    if host_tool.CUT["calls"] > cut:  # a SIGTERM answered its tool calls with errors
      logging.warning(
        "eval step %d not recorded: SIGTERM cut %d of its host tool calls", step,
        host_tool.CUT["calls"] - cut,
      )  # fmt: skip
      return
    for member, m in zip(self.trainee.members, per_run, strict=True):
      if member.stopped:
        continue
      member.writer.scalars(step, m)
      member.history.append((step, m))
      width = metrics_lib.LINE_WIDTH - len(member.label)
      logging.info(member.label + eval_line(step, m, time.time() - t, width))


def recorded_eval(workdir: str, upto: int) -> tuple[int, dict[str, float]] | None:
  """The last held-out evaluation at or before step `upto` in `workdir`'s events, as (step,
  {tag: value}); None where there is none, off process 0, or where the events do not read
  (a warning: the checkpoints are what matters)."""
  try:
    saved = metrics_lib.read_scalars(workdir) if jax.process_index() == 0 else {}
  except event_files.EventFileError as e:
    logging.warning("its last evaluation is not shown: %s", e)
    return None
  evals: dict[int, dict[str, float]] = {}
  for tag, points in saved.items():
    if tag.startswith("eval/"):
      for step, value in points:
        if step <= upto:
          evals.setdefault(step, {})[tag] = value
  return max(evals.items()) if evals else None


def finished_run(trainee, start: int) -> dict[str, dict[str, float]]:
  """A finished run's last evaluation, by member name (nothing is written)."""
  tr = trainee.exp.config.train
  logging.info(
    "%s already holds step %d of train.num_steps=%d: nothing to train",
    trainee.root, start, tr.num_steps,
  )  # fmt: skip
  out = {}
  for m in trainee.members:
    recorded = recorded_eval(m.workdir, start)
    out[m.name] = recorded[1] if recorded else {}
  return out


def evaluation_due(tr, step: int) -> bool:
  """Whether the held-out evaluation runs after `step` (every train.eval_every, and the last)."""
  return step % tr.eval_every == 0 or step == tr.num_steps


def unevaluated(trainee, step: int) -> bool:
  """Whether a resumed `step` was due an evaluation that a running member's events lack (the
  run stopped or failed in it, after the save): process 0 reads the events, every process
  agrees."""
  if step == 0 or not evaluation_due(trainee.exp.config.train, step):
    return False
  missing = jax.process_index() == 0 and any(
    not m.stopped and (recorded_eval(m.workdir, step) or (None,))[0] != step
    for m in trainee.members
  )
  return bool(distributed.summed(np.array([missing], np.int32))[0])


def last_evaluations(trainee) -> dict[str, dict[str, float]]:
  """Each member's last evaluation this launch made, by name ({} without one)."""
  return {m.name: m.history[-1][1] if m.history else {} for m in trainee.members}


def history_from(trainee, start: int) -> None:
  """Puts first in each member's history the evaluation at or before a resumed `start` that
  an earlier launch recorded (the summary's first evaluation), unless this launch made it."""
  for member in trainee.members:
    recorded = recorded_eval(member.workdir, start) if start > 0 else None
    if recorded and not (member.history and member.history[0][0] == start):
      member.history.insert(0, recorded)


def evaluate_start(trainee, evaluate: Evaluator, state, start: int, ckpt) -> None:
  """The evaluation before the first update: a fresh run's at step 0, or the one at a resumed
  step that its events lack (the run failed, was killed or stopped after saving the step and
  before recording its evaluation). A SIGTERM during it stops the run after it."""
  if start == 0:
    saved = "checkpoint 0 holds the warm start" if trainee.exp.config.sft.steps else "nothing saved"
    where = f"during the first evaluation ({saved})"
  else:
    logging.info(
      "%s holds step %d without its evaluation (the run ended in it): evaluating it first",
      trainee.root, start,
    )  # fmt: skip
    where = f"during the evaluation of step {start} (checkpoint {start} is kept)"
  evaluate(start, state.params)
  preempt.stop_if_asked(where, trainee.root, start, ckpt.wait)
