"""Command line: `python -m jaxrl_llm.main --config=configs/default.py --workdir=DIR`.

Any config field can be overridden, e.g. `--config.objective.clip_high=0.28`.
"""

from __future__ import annotations

import errno
import importlib.util
import logging as std_logging
import os
import sys
import threading
import time
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm import backend
from jaxrl_llm.config import ConfigError, parse

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
  "Compile the fused step from shapes alone, print its memory per device against the device's "
  "capacity and exit (0: fits, 3: does not); nothing is allocated. --workdir is not needed.",
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
  "debug", False, "Show the full traceback of a known failure instead of its one-line error."
)
flags.mark_flags_as_required(["config"])


def _user_errors() -> tuple[type[BaseException], ...]:
  """Failure classes whose message says what was wrong and what is allowed (exit code 2)."""
  from jaxrl_llm import checkpoint, distributed, run
  from jaxrl_llm.data import records
  from jaxrl_llm.models import hf_config

  return (
    ConfigError,
    distributed.DistributedError,
    checkpoint.CheckpointMismatchError,
    checkpoint.CorruptCheckpointError,
    checkpoint.NonFiniteStateError,
    run.NonFiniteError,
    run.VerifierError,
    hf_config.CheckpointFormatError,
    *records.USER_ERRORS,
  )


def _disk_full(err: BaseException) -> OSError | None:
  """The 'no space left on device' error anywhere in `err`'s chain of causes, if any."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
      return err
    if "No space left on device" in str(err):
      return OSError(errno.ENOSPC, str(err).splitlines()[0][:300])
    err = err.__cause__ or err.__context__
  return None


def explain(err: BaseException) -> str | None:
  """The one-line `error: ...` for a known failure class, or None for an unexpected error."""
  if isinstance(err, _user_errors()):
    return f"error: {err}"
  full = _disk_full(err)
  if full is not None:
    where = f" ({full.filename})" if getattr(full, "filename", None) else ""
    return (
      f"error: disk full{where}: {full.strerror or full}. The checkpoints committed before it "
      "are intact; free space (or point --workdir at a larger disk) and relaunch to resume"
    )
  return None


def workdir_problem(workdir: str) -> str | None:
  """Why a local `workdir` cannot hold a run (a file on its path, no write permission, a
  read-only file system), creating it if needed; None when it can (object stores: None)."""
  from jaxrl_llm import paths

  if paths.is_remote(workdir):
    return None
  try:
    os.makedirs(workdir, exist_ok=True)
  except FileExistsError:
    return "it is a file, not a directory; give a directory (it is created if missing)"
  except NotADirectoryError:
    return "a file stands on its path; give a directory path whose parents are directories"
  except OSError as e:
    return f"cannot create it: {e.strerror or e}; give a writable directory"
  if not os.path.isdir(workdir):
    return "it is a file, not a directory; give a directory (it is created if missing)"
  probe = os.path.join(workdir, f".write_test.{os.getpid()}")
  try:
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:  # EROFS, EACCES, ENOSPC...
    return f"cannot write in it: {e.strerror or e}; give a writable directory"
  return None


def remove_if_empty(workdir: str) -> None:
  """Removes the local directory `workdir` if it holds nothing (object stores: nothing done)."""
  from jaxrl_llm import paths

  if not paths.is_remote(workdir):
    try:
      os.rmdir(workdir)  # only an empty directory goes
    except OSError:
      pass


def main(argv):
  """Parses flags, turns the config into its typed tree once, and runs the experiment."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  quiet_library_logs(tracebacks=_DEBUG.value)
  plain_on_terminal(debug=_DEBUG.value)

  from jaxrl_llm import distributed

  if _DISTRIBUTED.value:
    try:
      distributed.initialize(_JOIN_TIMEOUT_S.value)
    except distributed.DistributedError as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
    distributed.watch_peers()  # a peer that stops ends this process too, with its reason
  if not _DRY_RUN.value:  # a dry run may compile for a TPU slice through libtpu
    try:
      backend.choose(debug=_DEBUG.value)
    except backend.BackendError as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
  from jaxrl_llm import plan  # heavy imports after flag parsing

  if _DRY_RUN.value:
    try:
      gib = _DEVICE_MEMORY_GIB.value
      capacity = None if gib is None else int(gib * plan.GIB)
      memory = plan.plan(parse(_CONFIG.value), capacity_bytes=capacity)
    except ConfigError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    print(f"dry run: {memory.summary()}", flush=True)
    sys.exit(3 if memory.fits is False else 0)
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required (except with --dry_run)")
  fresh = not os.path.lexists(_WORKDIR.value)  # made by this launch: removed if left empty
  problem = workdir_problem(_WORKDIR.value)
  if problem:
    print(f"error: --workdir={_WORKDIR.value}: {problem}", file=sys.stderr, flush=True)
    sys.exit(2)
  started = time.time()
  result = train_or_leave(_WORKDIR.value, fresh)
  from jaxrl_llm import metrics

  shown = "  ".join(f"{k}={v:.4g}" for k, v in sorted(result.items())) or "(no evaluation)"
  took = metrics.format_duration(time.time() - started)
  logging.info("final eval: %s; wall time %s; workdir %s", shown, took, _WORKDIR.value)


def train_or_leave(workdir: str, fresh: bool = False) -> dict:
  """Trains the run of the command line's config in `workdir` and returns its final
  evaluation; a run that stops (SIGTERM, a known error, Ctrl-C, or an unexpected error in a
  multi-process job) prints its line and leaves through `leave_job`. `fresh`: this launch
  made `workdir`; an error that leaves it empty (a refused config) removes it."""
  from jaxrl_llm import distributed, run

  try:
    cfg = parse(_CONFIG.value)
    result = run.train_and_evaluate(cfg, workdir, hparam_fields=hparam_fields())
  except run.Preempted as e:  # SIGTERM: the step was saved; a scheduler may relaunch
    print(f"{e}", file=sys.stderr)
    leave_job(143)  # 128 + SIGTERM, as if the signal had ended the process
  except Exception as e:
    if fresh:
      remove_if_empty(workdir)
    if interrupted(e) and not (_DEBUG.value and not in_a_job()):
      stop_on_sigint(workdir)  # Ctrl-C cut a save (or a library call) that then failed
    line = explain(e)
    if line is None or _DEBUG.value:
      if not in_a_job():
        raise
      traceback.print_exc()
      leave_job(1, f"{type(e).__name__}: {distributed.first_line(e)}")
    print(line, file=sys.stderr)
    leave_job(2, line)  # an aborted async save must not print more
  except KeyboardInterrupt:  # Ctrl-C: the run's `finally` has waited for a save in flight
    if _DEBUG.value and not in_a_job():
      raise
    stop_on_sigint(workdir)
  return result


def interrupted(err: BaseException) -> bool:
  """Whether a KeyboardInterrupt (Ctrl-C) is in `err`'s chain of causes."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    if isinstance(err, KeyboardInterrupt):
      return True
    err = err.__cause__ or err.__context__
  return False


def stop_on_sigint(workdir: str) -> None:
  """Ctrl-C's one line, then `leave_job(130)` (128 + SIGINT), telling the peers of a job."""
  every = " on every process" if in_a_job() else ""
  line = (
    f"stopped by SIGINT (Ctrl-C): the checkpoints committed before it are intact in "
    f"{workdir}; relaunch the same command{every} to resume"
  )
  print(line, file=sys.stderr)
  leave_job(130, line)


def in_a_job() -> bool:
  """Whether this process is one of several that joined a multi-process job (`--distributed`)."""
  if not _DISTRIBUTED.value:
    return False
  import jax

  return jax.process_count() > 1


def leave_job(code: int, why: str | None = None) -> None:
  """Ends this process at once with exit status `code`, skipping the interpreter's teardown
  (the run's `finally` has already closed its checkpointer and writer).

  Teardown would only add a library thread's late complaint to one process; in a multi-process
  job it would also hold this process in JAX's shutdown barrier, which waits 5 minutes for
  peers that are themselves waiting in a collective for it, until all abort with stack dumps.
  With `why`, the peers are told (`distributed.announce_stop`) and stop at once with it.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  if why is not None and in_a_job():
    from jaxrl_llm import distributed

    distributed.announce_stop(code, why)
  os._exit(code)


class _LibraryInfoFilter(std_logging.Filter):
  """Drops INFO chatter of the checkpoint and data libraries (warnings still pass) and, unless
  `tracebacks`, the tracebacks their background threads log: the error reaches the main thread,
  which reports it (one line for a known failure, the full traceback otherwise)."""

  def __init__(self, tracebacks: bool = False):
    super().__init__()
    self.tracebacks = tracebacks

  def filter(self, record: std_logging.LogRecord) -> bool:
    libs = ("orbax", "grain", "asyncio", "concurrent", "tensorboard", "fsspec", "gcsfs", "optax")
    noisy = any(f"{os.sep}{lib}{os.sep}" in record.pathname for lib in libs)
    if noisy and not self.tracebacks:
      record.exc_info, record.exc_text = None, None
      message = record.getMessage()
      if "Traceback (most recent call last)" in message:
        record.msg, record.args = message.split("Traceback (most recent call last)")[0], None
    if record.pathname.endswith("xla_bridge.py") and record.levelno < std_logging.WARNING:
      return False  # e.g. "Unable to initialize backend 'tpu'" on a machine without one
    return record.levelno >= std_logging.WARNING or not noisy


class _TerminalFormatter(std_logging.Formatter):
  """Log records as a terminal reader wants them: the message alone, warnings and errors with
  their level in front (no date, thread id or source file)."""

  def format(self, record: std_logging.LogRecord) -> str:
    message = super().format(record)
    if record.levelno >= std_logging.WARNING:
      return f"{record.levelname.lower()}: {message}"
    return message


def plain_on_terminal(debug: bool = False, stream=None) -> bool:
  """On a terminal (and without `debug`), absl's log lines lose their prefix
  (`I1124 18:35:15.886093 140514125208448 train.py:790]`); redirected to a file they keep it.
  Returns whether it changed the format."""
  stream = sys.stderr if stream is None else stream
  if debug or not getattr(stream, "isatty", lambda: False)():
    return False
  logging.get_absl_handler().setFormatter(_TerminalFormatter("%(message)s"))
  return True


def quiet_library_logs(tracebacks: bool = False) -> None:
  """Keeps the training log readable: progress lines, not library internals. Unless
  `tracebacks`, an exception escaping a library's background thread is one log line too."""
  quiet = _LibraryInfoFilter(tracebacks)
  std_logging.getLogger("absl").addFilter(quiet)
  for handler in std_logging.getLogger().handlers:  # records of every logger pass these
    handler.addFilter(quiet)
  if not tracebacks:

    def one_line(args: threading.ExceptHookArgs) -> None:
      name = args.thread.name if args.thread else "?"
      logging.error("thread %s stopped: %s: %s", name, args.exc_type.__name__, args.exc_value)

    threading.excepthook = one_line

    def unraisable(args) -> None:  # e.g. a save's callback firing after its event loop closed
      logging.warning("ignored in %r: %s: %s", args.object, args.exc_type.__name__, args.exc_value)

    sys.unraisablehook = unraisable


def check_overrides(argv: list[str]) -> None:
  """Fails with a clear message when a `--config.a.b=v` flag names a field the config lacks."""
  path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if path is None:
    return
  file, _, arg = path.partition(":")
  try:
    spec = importlib.util.spec_from_file_location("_jaxrl_llm_config", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as e:
    raise ConfigError(f"cannot load config file {file!r}: {e}") from None
  for arg in argv:
    if not arg.startswith("--config.") and not arg.startswith("--noconfig."):
      continue
    field = arg.split("=", 1)[0].split(".", 1)[1]
    node, seen = config, []
    for part in field.split("."):
      if not hasattr(node, "keys") or part not in node:
        where = ".".join(seen) or "the top level"
        allowed = sorted(node.keys()) if hasattr(node, "keys") else []
        raise ConfigError(
          f"unknown config field {field!r} in {arg!r}: {where} has no field {part!r}; "
          f"allowed: {allowed}"
        )
      node, seen = node[part], [*seen, part]


def hparam_fields() -> list[str]:
  """`--hparams`, else the config fields set on the command line; each must name a field."""
  fields = _HPARAMS.value if _HPARAMS.value is not None else overridden_fields(sys.argv)
  for field in fields:
    node = _CONFIG.value
    for part in field.split("."):
      if not hasattr(node, "keys") or part not in node:
        raise ConfigError(f"--hparams names {field!r}, which is not a config field")
      node = node[part]
  return fields


def overridden_fields(argv: list[str]) -> list[str]:
  """The config fields that `--config.a.b=v` / `--noconfig.a.b` flags of `argv` set, in order."""
  fields = []
  for arg in argv:
    if arg.startswith(("--config.", "--noconfig.")):
      fields.append(arg.split("=", 1)[0].split(".", 1)[1])
  return list(dict.fromkeys(fields))


def parse_config(argv: list[str]):
  """The config that `argv` (`prog --config=FILE[:arg] --config.a.b=v ...`) gives the trainer.

  Parsed with the same config flag as the command line (locked, typed overrides) on a fresh
  flag registry, after `check_overrides`; for tools and tests that need the trainer's config.
  """
  check_overrides(argv)
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file(
    "config", None, "", flag_values=fv, lock_config=True, sys_argv=argv
  )
  fv([a for a in argv if a == argv[0] or a.startswith(("--config", "--noconfig"))])
  return fv.config


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad override (unknown field, wrong type) as one error line."""
  try:
    check_overrides(argv)
    return flags.FLAGS(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
  except flags.Error as e:  # e.g. --config.train.num_steps=abc: not an int
    print(
      f"error: {e} (a --config.FIELD=VALUE takes the type of the field's default)", file=sys.stderr
    )
  sys.exit(2)


def run():
  """Console entry point."""
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
