"""A run of the trainer, one job per file.

assemble.py    mesh, task, model, initial state and the jitted programs (`build`)
evaluate.py    held-out evaluation (greedy accuracy, pass@k)
warm_start.py  the supervised warm start before RL
loop.py        the one loop (`train`): restore or warm start, RL updates, evaluation, logging,
               profiling, checkpoints; a single run (`SingleRun`, `train_and_evaluate`) is a
               pack of one
guard.py       the guards: non-finite updates (`NonFiniteError`), failing verifiers
preempt.py     SIGTERM: save the finished step and stop (`Preempted`); the stop lines of SIGTERM and Ctrl-C
record.py      config.json, the config table and HParams, the banner and the closing summary
changes.py     what a relaunch changed since the run's record: settings, files, tokenizer, schedule
pack.py        a sweep's runs as one program: packable fields, per-run values, the runs axis
packed.py      a pack as the loop trains it (`PackedRuns`, `train_pack`) and `take_out`
"""

from jaxrl_llm.run.assemble import (
  Experiment,
  abstract_batch,
  build,
  build_task,
  host_reward_step,
  to_global_batch,
)
from jaxrl_llm.run.guard import NonFiniteError, SkipGuard, VerifierError
from jaxrl_llm.run.loop import train_and_evaluate
from jaxrl_llm.run.preempt import Preempted
from jaxrl_llm.run.record import hparam_columns, record_run, run_hparams

__all__ = [
  "Experiment",
  "NonFiniteError",
  "Preempted",
  "SkipGuard",
  "VerifierError",
  "abstract_batch",
  "build",
  "build_task",
  "host_reward_step",
  "hparam_columns",
  "record_run",
  "run_hparams",
  "to_global_batch",
  "train_and_evaluate",
]
