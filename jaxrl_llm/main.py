"""Command line: `python -m jaxrl_llm.main --config=configs/default.py --workdir=DIR`.

Any config field can be overridden, e.g. `--config.objective.clip_high=0.28`. The flags are
here; launching and leaving a run is `jaxrl_llm.launch`, the terminal and the log file
(`<workdir>/log.txt`: every line, the libraries' included) `jaxrl_llm.terminal`.
"""

from __future__ import annotations

from jaxrl_llm import sigterm

if __name__ == "__main__":  # not where a fork server re-imports this module as __mp_main__:
  sigterm.listen()  # first: a SIGTERM while the rest imports or the run starts is one line

import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm import launch, terminal
from jaxrl_llm.config import ConfigError, command_line

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and TensorBoard logs.")
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed",
  False,
  "Join a multi-process job first (jax.distributed.initialize; the coordinator comes from the "
  "platform, or from JAXRL_LLM_COORDINATOR/_NUM_PROCESSES/_PROCESS_ID as tools/launch_local.py "
  "sets them).",
)
_JOIN_TIMEOUT_S = flags.DEFINE_integer(
  "join_timeout_s", 300, "With --distributed: give up joining the job after this many seconds."
)
_DRY_RUN = flags.DEFINE_bool(
  "dry_run",
  False,
  "Compile the fused step (with host verifiers: the sample and learn programs) from shapes "
  "alone, print its memory per device against the device's capacity and exit (0: fits, 3: "
  "does not); nothing is allocated. --workdir is not needed.",
)
_DEVICE_MEMORY_GIB = flags.DEFINE_float(
  "device_memory_gib",
  None,
  "With --dry_run: plan against this much memory per device instead of the device's own (e.g. "
  "80 to plan an H100 run on a CPU machine).",
)
_HPARAMS = flags.DEFINE_list(
  "hparams",
  None,
  "Config fields to list as HParams columns in TensorBoard beside the built-in ones (default: "
  "the fields set on the command line; tools/sweep.py passes the fields it varies).",
)
_DEBUG = flags.DEFINE_bool(
  "debug",
  False,
  "Show the full traceback of a known failure instead of its one-line error, and on the "
  "terminal the libraries' log lines (always in <workdir>/log.txt) with absl's prefix.",
)


def main(argv):
  """Parses flags, turns the config into its typed tree once, and runs the experiment."""
  if len(argv) > 1:  # e.g. a value with an unquoted space, or a field without --config.
    print(
      f"error: unexpected arguments {argv[1:]}; allowed: flags only "
      "(--config=FILE, --workdir=DIR, --config.SECTION.FIELD=VALUE, ...; --help lists them)",
      file=sys.stderr,
    )
    sys.exit(2)
  if _CONFIG.value is None:  # absl's own line for a required flag names `--config=None`
    print(
      "error: --config is required: an experiment config file, e.g. "
      "--config=configs/default.py (configs/ holds the recipes)",
      file=sys.stderr,
    )
    sys.exit(2)
  debug = _DEBUG.value
  terminal.setup(debug)
  if _DISTRIBUTED.value:
    launch.join_job(_JOIN_TIMEOUT_S.value)
  workdir = _WORKDIR.value
  if _DEVICE_MEMORY_GIB.value is not None and not _DRY_RUN.value:
    print("error: --device_memory_gib plans a --dry_run; add --dry_run or drop it", file=sys.stderr)
    sys.exit(2)
  if not workdir and not _DRY_RUN.value:
    print("error: --workdir is required (a directory; not needed with --dry_run)", file=sys.stderr)
    sys.exit(2)
  launch.choose_backend(debug)  # a dry run too: a failing plugin's chatter stays off the terminal
  if _DRY_RUN.value:
    sys.exit(launch.dry_run(_CONFIG.value, _DEVICE_MEMORY_GIB.value, debug))
  made = launch.open_workdir(workdir)
  terminal.setup(debug, log_file=terminal.log_path(workdir, launch.process_index()))
  started = time.time()
  result = launch.train_or_leave(_CONFIG.value, workdir, made, debug, _HPARAMS.value)
  from jaxrl_llm import metrics
  from jaxrl_llm.metric_info import tag_order

  ordered = sorted(result.items(), key=lambda kv: tag_order(kv[0]))
  shown = "  ".join(f"{k}={v:.4g}" for k, v in ordered) or "(no evaluation)"
  took = metrics.format_duration(time.time() - started)
  logging.info("last eval: %s; wall time %s; workdir %s", shown, took, workdir)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad override (unknown field, wrong type) as one error line."""
  try:
    command_line.check_overrides(argv)
    return flags.FLAGS(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
  except flags.Error as e:  # e.g. --config.train.num_steps=abc: not an int
    hint = " (a --config.FIELD=VALUE takes the type of the field's default)"
    print(f"error: {e}{hint if 'config.' in str(e) else ''}", file=sys.stderr)
  sys.exit(2)


def run():
  """Console entry point."""
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
