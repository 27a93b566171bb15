"""Launching a run from a command line and leaving it: what `python -m jaxrl_llm.main` (and
tools/sweep.py) do around training.

The config from flags (`parse_config`, `hparam_fields`; `config.command_line` checks them), joining a
multi-process job (`join_job`), the backend and workdir checks, the dry run's memory plan, and
how a run ends: a known failure as one `error: ...` line with exit status 2 (`explain`), Ctrl-C
as one line with 130, SIGTERM with 143, the peers of a job told why (`leave_job`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import os
import signal
import sys
import threading
import traceback

from absl import flags
from ml_collections import config_flags

from jaxrl_llm import terminal
from jaxrl_llm.config import ConfigError, command_line, parse

_joined = False  # this process joined a multi-process job (`join_job`)
_held: list[int] = []  # the workdir lock's file descriptor, open for the process's life


# ----------------------------------------------------------------------------- known failures


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


def _causes(err: BaseException | None):
  """`err`, then its cause (or context), its cause's, ... each once."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    yield err
    err = err.__cause__ or err.__context__


def _disk_full(err: BaseException) -> OSError | None:
  """The 'no space left on device' error anywhere in `err`'s chain of causes, if any."""
  for e in _causes(err):
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      return e
    if "No space left on device" in str(e):  # a library's long message: the OS's words alone
      return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  return None


def _out_of_memory(err: BaseException) -> str | None:
  """The first line of an out-of-memory error (the host's MemoryError, or XLA's
  RESOURCE_EXHAUSTED from a device) anywhere in `err`'s chain of causes, if any."""
  for e in _causes(err):
    said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, MemoryError) or ("RESOURCE_EXHAUSTED" in said and "memory" in said.lower()):
      return said[:200].rstrip(".")
  return None


def explain(err: BaseException) -> str | None:
  """The one-line `error: ...` for a known failure class, or None for an unexpected error."""
  if isinstance(err, _user_errors()):
    return f"error: {err}"
  memory = _out_of_memory(err)
  if memory is not None:
    return (
      f"error: out of memory: {memory}. The checkpoints committed before it are intact; make "
      "the step smaller (rl.num_prompts, sampling.group_size, the completion budget, "
      "rl.microbatch_tokens) or the evaluation (task.eval_size x train.pass_k); --dry_run "
      "plans the memory of both before a run"
    )
  full = _disk_full(err)
  if full is not None:
    where = f" ({full.filename})" if getattr(full, "filename", None) else ""
    return (
      f"error: disk full{where}: {full.strerror or full}. The checkpoints committed before it "
      "are intact; free space (or point --workdir at a larger disk) and relaunch to resume"
    )
  return None


def interrupted(err: BaseException) -> bool:
  """Whether a KeyboardInterrupt (Ctrl-C) is in `err`'s chain of causes."""
  return any(isinstance(e, KeyboardInterrupt) for e in _causes(err))


# ----------------------------------------------------------------------------- start-up


def join_job(timeout_s: float) -> None:
  """Joins the multi-process job this command was started in on every host (`--distributed`);
  exits with status 2 and one line when it cannot. A peer that stops later ends this process
  too, with its reason."""
  global _joined
  from jaxrl_llm import distributed

  try:
    distributed.initialize(timeout_s)
  except distributed.DistributedError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  _joined = True
  distributed.watch_peers()


def choose_backend(debug: bool = False) -> None:
  """JAX's backend (`backend.choose`); exits with status 2 and one line when it cannot start."""
  from jaxrl_llm import backend

  try:
    backend.choose(debug=debug)
  except backend.BackendError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def dry_run(config, device_memory_gib: float | None = None, debug: bool = False) -> int:
  """Compiles the fused step of `config` (host verifiers: its sample and learn programs) and
  its held-out evaluation from shapes alone and prints their memory per device against the
  capacity (`device_memory_gib`, else the device's), a line each; exit status: 0 both fit, 3
  one does not, 2 a known failure, as a run's (a bad config, data file or checkpoint: its line
  printed; `debug`: its traceback)."""
  import math

  from jaxrl_llm import plan

  if device_memory_gib is not None and not (
    math.isfinite(device_memory_gib) and device_memory_gib > 0
  ):
    print(
      f"error: --device_memory_gib={device_memory_gib} must be a finite number > 0 (GiB per "
      "device)",
      file=sys.stderr,
    )
    return 2
  try:
    capacity = None if device_memory_gib is None else int(device_memory_gib * plan.GIB)
    acting = parse_acting(config, overridden_fields(sys.argv))
    memory = plan.plan(acting, capacity_bytes=capacity, evaluation=True)
  except Exception as e:
    line = explain(e)
    if line is None:
      raise
    if debug:  # the traceback, and the exit status of the line it stands for
      traceback.print_exc()
    print(line, file=sys.stderr)
    return 2
  return plan.print_dry_run(memory)


def workdir_problem(workdir: str) -> str | None:
  """Why a local `workdir` cannot hold a run (a file on its path, no write permission, a
  read-only file system), creating it if needed; None when it can (object stores: None)."""
  from jaxrl_llm import paths
  from jaxrl_llm.run import changes

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
  if changes.holds_a_model(workdir):
    return changes.A_MODEL
  checkpoints = os.path.join(workdir, "checkpoints")
  if os.path.lexists(checkpoints) and not os.path.isdir(checkpoints):
    return (
      f"{checkpoints} is a file, not a directory; move it away (the run keeps its "
      "checkpoints there) or give another directory"
    )
  for folder in (workdir, checkpoints):  # where the run writes
    if folder != workdir and not os.path.isdir(folder):
      continue  # made by the run, in a workdir it can write in
    probe = os.path.join(folder, f".write_test.{os.getpid()}")
    try:
      with open(probe, "w"):
        pass
      os.remove(probe)
    except OSError as e:  # EROFS, EACCES, ENOSPC...
      where = "" if folder == workdir else f"{folder} "
      return f"cannot write in {where or 'it'}: {e.strerror or e}; give a writable directory"
  return None


def outermost_missing(path: str) -> str | None:
  """The outermost folder of `path` (itself or a parent) that does not exist yet, absolute;
  None when `path` exists."""
  made, folder = None, os.path.abspath(path)
  while not os.path.lexists(folder):
    made, folder = folder, os.path.dirname(folder)
  return made


def open_workdir(workdir: str) -> str | None:
  """Makes `workdir` ready for a run (`workdir_problem`; exit status 2 and one line when it
  cannot hold one); returns the outermost folder this launch made (`workdir` or a missing
  parent of it), None when `workdir` was there already."""
  made = outermost_missing(workdir)  # made by this launch: removed if left empty
  problem = workdir_problem(workdir)
  if problem:
    print(f"error: --workdir={workdir}: {problem}", file=sys.stderr, flush=True)
    sys.exit(2)
  _lock(workdir)
  return made


def _lock(workdir: str) -> None:
  """Holds a lock on the local `workdir` (flock on the directory, so nothing is written and a
  kill -9 frees it) for this process's life, or refuses the launch in one line (exit 2) while
  another trainer holds it: two trainers in one workdir each wrote its checkpoints and moved
  the other's aside. Process 0 of a job alone takes it; object stores and file systems
  without locks are not locked."""
  from jaxrl_llm import paths

  if paths.is_remote(workdir) or process_index() != 0:
    return
  fd = os.open(workdir, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    os.close(fd)
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
      return  # no locks here (some network file systems)
    launch = ""
    with contextlib.suppress(OSError):
      with open(terminal.log_path(workdir), errors="replace") as f:
        launches = [line[4:].strip() for line in f if line.startswith("### ")]
      launch = f" (the last launch in its log.txt: {launches[-1]})" if launches else ""
    print(
      f"error: --workdir={workdir}: another trainer is running in it{launch}; wait for it to "
      "end or stop it, or give another --workdir",
      file=sys.stderr,
      flush=True,
    )
    sys.exit(2)
  _held.append(fd)


def remove_if_empty(workdir: str, made: str | None = None) -> None:
  """Removes the local directory `workdir` if it holds nothing but this process's log file
  (closed and removed with it) and an empty `checkpoints/`, then its parents up to `made` (the
  outermost folder this launch made, `open_workdir`) that are left empty; object stores:
  nothing done."""
  from jaxrl_llm import paths

  if paths.is_remote(workdir):
    return
  logs = [p for p in terminal.log_files() if os.path.dirname(p) == os.path.abspath(workdir)]
  try:
    empty = os.path.join(workdir, "checkpoints")
    if os.path.isdir(empty) and not os.listdir(empty):
      os.rmdir(empty)
    if set(os.listdir(workdir)) <= {os.path.basename(p) for p in logs}:
      for path in logs:
        terminal.close_log(path)
        os.remove(path)
    os.rmdir(workdir)  # only an empty directory goes
    folder = os.path.abspath(workdir)
    outermost = os.path.abspath(made or workdir)
    while folder != outermost and folder.startswith(outermost + os.sep):
      folder = os.path.dirname(folder)
      os.rmdir(folder)  # a parent this launch made; one holding anything else stays
  except OSError:
    pass


def process_index() -> int:
  """This process's index in its job (0 when it joined none)."""
  if not _joined:
    return 0
  import jax

  return jax.process_index()


# ----------------------------------------------------------------------------- config flags


def hparam_fields(config, hparams: list[str] | None, argv: list[str]) -> list[str]:
  """`hparams` (`--hparams`), else the config fields set on the command line `argv`; each must
  name a field of `config`."""
  fields = hparams if hparams is not None else overridden_fields(argv)
  for field in fields:
    if command_line.missing_field(config, field):
      raise ConfigError(f"--hparams names {field!r}, which is not a config field")
  return fields


def parse_acting(config, fields: list[str]):
  """The typed tree of `config` (`parse`) for a single run; ConfigError when a field the
  command line sets (`fields`) has no effect on it (`config.acting.unused`, and
  `unused_alone`: what only a pack reads)."""
  from jaxrl_llm.config import acting
  from jaxrl_llm.config.fields import invalid

  cfg = parse(config)
  errors = acting.unused(cfg, fields, config) + acting.unused_alone(cfg, fields)
  if errors:
    raise invalid(errors)
  return cfg


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
  command_line.check_overrides(argv)
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file(
    "config", None, "", flag_values=fv, lock_config=True, sys_argv=argv
  )
  kept, follows = [argv[0]], False  # the config flags, with a value given after a space
  for a in argv[1:]:
    if a.startswith(("--config", "--noconfig")) or (follows and not a.startswith("--")):
      kept.append(a)
    follows = a.startswith("--config") and "=" not in a
  fv(kept)
  return fv.config


# ----------------------------------------------------------------------------- training, leaving


def train_or_leave(
  config,
  workdir: str,
  made: str | None = None,
  debug: bool = False,
  hparams: list[str] | None = None,
) -> dict:
  """Trains the run of the command line's `config` in `workdir` and returns its final
  evaluation; a run that stops (SIGTERM, a known error, Ctrl-C, or an unexpected error in a
  multi-process job) prints its line and leaves through `leave_job`. `made`: the outermost
  folder this launch made (`open_workdir`); an error that leaves it empty (a refused config)
  removes it. `debug`: an error's traceback instead of its line; `hparams`: `--hparams` (see
  `hparam_fields`)."""
  from jaxrl_llm import backend, distributed, run, sigterm

  try:
    cfg = parse_acting(config, overridden_fields(sys.argv))
    fields = hparam_fields(config, hparams, sys.argv)
    backend.use_compilation_cache(cfg.train.compilation_cache)
    with sigterm.leaving(lambda signum, what: stop_while_compiling(signum, what, workdir)):
      result = run.train_and_evaluate(cfg, workdir, hparam_fields=fields)
  except run.Preempted as e:  # SIGTERM: the step was saved; a scheduler may relaunch
    say(f"{e}")
    leave_job(143)  # 128 + SIGTERM, as if the signal had ended the process
  except Exception as e:
    _defer_to_the_watcher()  # a failure while the watcher's stop closes the run: its stop
    if made:
      remove_if_empty(workdir, made)
    if interrupted(e) and not (debug and not in_a_job()):
      stop_on_sigint(workdir)  # Ctrl-C cut a save (or a library call) that then failed
    line = explain(e)
    if line is None and not in_a_job():
      raise
    if line is None or debug:  # a known failure under --debug: its traceback, its exit status
      traceback.print_exc()
      leave_job(
        1 if line is None else 2, line or f"{type(e).__name__}: {distributed.first_line(e)}"
      )
    say(line)
    leave_job(2, line)  # an aborted async save must not print more
  except KeyboardInterrupt:  # Ctrl-C: the run's `finally` has waited for a save in flight
    _defer_to_the_watcher()
    if debug and not in_a_job():
      raise
    stop_on_sigint(workdir)
  return result


def say(line: str) -> None:
  """A stopping run's one line: on stderr, and in the run's log file (`terminal.in_log_files`);
  none where a signal during a compilation is already ending the process on the watcher thread
  (`sigterm.stopping_elsewhere`), whose line and exit this thread waits for."""
  _defer_to_the_watcher()
  with contextlib.suppress(OSError):  # a closed stderr (`| tee`, ended by the same Ctrl-C)
    print(line, file=sys.stderr, flush=True)
  terminal.in_log_files(line)


def _defer_to_the_watcher() -> None:
  """Waits, never returning, where a signal during a compilation is already ending the process
  on the watcher thread (`sigterm.stopping_elsewhere`): its os._exit ends this thread too."""
  from jaxrl_llm import sigterm

  if sigterm.stopping_elsewhere():
    sigterm.wait_for_the_exit()


_leaving = threading.Lock()  # held by the thread that says the stop's line and ends the process


def _stop(status: int, line: str) -> None:
  """Says `line` and leaves with `status`, once: a second thread that would stop too (Ctrl-C
  reaches the main thread while the signal watcher stops a compilation) waits for the exit."""
  _defer_to_the_watcher()  # before the lock, which the watcher's own line needs
  if not _leaving.acquire(blocking=False):
    from jaxrl_llm import sigterm

    sigterm.wait_for_the_exit()  # the first one's os._exit ends this thread with the process
  say(line)
  leave_job(status, line)


def stop_on_sigint(workdir: str, what: str | None = None) -> None:
  """Ctrl-C's one line (`preempt.sigint_line`), then `leave_job(130)` (128 + SIGINT), telling the
  peers of a job."""
  from jaxrl_llm.run import preempt

  _stop(130, preempt.sigint_line(workdir, what, every_process=in_a_job()))


def stop_while_compiling(signum: int, what: str, workdir: str) -> None:
  """The line and exit status of a SIGTERM or Ctrl-C that came while XLA compiled `what`
  (`sigterm.compiling`; on its watcher thread, after the run's saves in flight finished)."""
  if signum == signal.SIGINT:
    stop_on_sigint(workdir, what)
  from jaxrl_llm.run import preempt

  _stop(143, f"stopped by SIGTERM while compiling {what}: {preempt.kept(workdir)}")


def in_a_job() -> bool:
  """Whether this process is one of several that joined a multi-process job (`join_job`)."""
  if not _joined:
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
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError):  # a closed pipe: what was said is lost, the exit is not
      stream.flush()
  scoring = sys.modules.get("jaxrl_llm.data.verifiers.scoring")
  if scoring is not None:  # its worker processes, stopped at exit by atexit, which this skips
    scoring.shutdown_workers(timeout_s=1.0)
    gc.collect()  # the pools' semaphores unregistered (else a warning follows the last line)
  if why is not None and in_a_job():
    from jaxrl_llm import distributed

    distributed.announce_stop(code, why)
  os._exit(code)
