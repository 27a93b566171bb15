"""What a run says as it trains: `Logger`, one run's clock and logged steps (scalars,
histograms, samples, the progress line), and `Profiler`, the profile trace of a few updates.
`run.loop` drives both."""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from jaxrl_llm import distributed, paths
from jaxrl_llm import metrics as metrics_lib
from jaxrl_llm.run import record
from jaxrl_llm.run.guard import SkipGuard, VerifierGuard


class Logger:
  """One run's clock and logged steps: scalars, histograms, samples, progress line. `member`:
  the run (`run.loop.Member`: its experiment, writer, prefix and label)."""

  def __init__(self, member, guard: SkipGuard, start: int, clock: dict | None = None):
    self.exp, self.writer, self.guard, self.start = member.exp, member.writer, guard, start
    self.clock = {} if clock is None else clock  # a pack's runs share it: one clock line a step
    self.prefix, self.label = member.prefix, member.label
    cfg = member.config
    calls = cfg.rl.num_prompts * cfg.sampling.group_size  # each host term's calls per step
    timeout = cfg.data.verifier_timeout_s
    limit = cfg.train.max_failed_verifier_steps
    self.verifiers = VerifierGuard(limit, calls, timeout, self.prefix)
    self.progress = metrics_lib.Progress(cfg.train.num_steps)
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
    if not self.label:  # a single run: `step 10/100 ... | reward 0.5 ...`
      logging.info(self.progress.line(done, scalars))
      return
    if self.clock.get("step") != done:  # a pack: the clock once, then each run's scalars
      self.clock["step"] = done
      logging.info(self.progress.line(done))
    width = metrics_lib.LINE_WIDTH - len(self.label)
    logging.info(self.label + self.progress.line(done, scalars, width, clock=False))


class Profiler:
  """A jax.profiler trace of `train.profile_steps` updates after the compiling one, into
  `<root>/plugins/profile` (TensorBoard's Profile tab; a pack's root holds its runs' folders);
  in a local folder also as `perfetto_trace.json.gz` beside it, which
  `tools/trace_summary.py <root>` reads."""

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
