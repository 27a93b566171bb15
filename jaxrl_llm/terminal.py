"""What a person reads on the terminal, and where the rest of the log goes: one `setup` for the
trainer's command line (`python -m jaxrl_llm.main`) and for tools/sweep.py (separate runs, or a
pack trained in its own process); and `ArgParser`, the tools' command lines, whose mistakes are
one `error:` line rather than argparse's usage block.

Without `--debug`, on a terminal absl's lines lose their prefix (`I1124 18:35:15.886093
140514125208448 loop.py:790] `; redirected to a file they keep it), the libraries' INFO chatter
(orbax, grain, tensorboard, asyncio, ...) stays off the terminal, and an exception escaping a
library's background thread is one line. The log file (`<workdir>/log.txt` of a run,
`<root>/log.txt` of a sweep; `log.<i>.txt` for process i > 0 of a multi-process job) receives
every record, the libraries' and their tracebacks included, with absl's prefix. With `--debug`
the terminal shows all of it too, with the prefix.
"""

from __future__ import annotations

import argparse
import logging as std_logging
import os
import shlex
import sys
import threading
import time
import warnings
from collections.abc import Callable

from absl import flags, logging

LOG_FILE = "log.txt"
_set_up = False  # `setup` has run
# Source folders whose INFO records are library chatter (warnings and errors still show).
LIBRARIES = ("orbax", "grain", "asyncio", "concurrent", "tensorboard", "fsspec", "gcsfs", "optax")


# Warnings libraries give about nothing wrong: orbax reading a checkpoint item on its own (the
# export reads the parameters alone) looks for the step's metadata file there.
BENIGN = ("Metadata file does not exist",)
# asyncio's report of a background future whose failure nobody awaited ("Task exception was
# never retrieved", "_GatheringFuture ..."): a failed save's sibling writes, collected as the
# process exits after the main thread reported the failure in one line.
UNAWAITED = " exception was never retrieved"


class _LibraryInfoFilter(std_logging.Filter):
  """Drops INFO chatter of the checkpoint and data libraries (warnings still pass) and, unless
  `tracebacks`, the tracebacks their background threads log: the error reaches the main thread,
  which reports it (one line for a known failure, the full traceback otherwise)."""

  def __init__(self, tracebacks: bool = False):
    super().__init__()
    self.tracebacks = tracebacks

  def filter(self, record: std_logging.LogRecord) -> bool:
    """Whether `record` reaches the terminal (shortened first when it carries a traceback)."""
    noisy = any(f"{os.sep}{lib}{os.sep}" in record.pathname for lib in LIBRARIES)
    if (noisy or getattr(record, "one_line", False)) and not self.tracebacks:
      record.exc_info, record.exc_text = None, None
      message = record.getMessage()
      if "Traceback (most recent call last)" in message:
        record.msg, record.args = message.split("Traceback (most recent call last)")[0], None
    if record.pathname.endswith("xla_bridge.py") and record.levelno < std_logging.WARNING:
      return False  # e.g. "Unable to initialize backend 'tpu'" on a machine without one
    if noisy and not self.tracebacks and record.getMessage().startswith(BENIGN):
      return False  # a library's warning about nothing wrong (kept in the log file)
    if noisy and not self.tracebacks and UNAWAITED in record.getMessage().split("\n")[0]:
      return False  # a failure already reported, or else in the log file
    if getattr(record, "log_file_only", False) and not self.tracebacks:
      return False
    return record.levelno >= std_logging.WARNING or not noisy


class _TerminalFormatter(std_logging.Formatter):
  """Log records as a terminal reader wants them: the message alone, warnings and errors with
  their level in front (no date, thread id or source file)."""

  def format(self, record: std_logging.LogRecord) -> str:
    """The record's message, after its level when it is a warning or worse."""
    message = super().format(record)
    if record.levelno >= std_logging.WARNING:
      return f"{record.levelname.lower()}: {message}"
    return message


class _LogFile(std_logging.FileHandler):
  """The log file: every record with absl's prefix, tracebacks included. A file that cannot be
  written (a full disk) stops there, silently: the run goes on, and says why it stops itself."""

  stopped = False

  def emit(self, record: std_logging.LogRecord) -> None:
    """Writes `record` unless the file has stopped."""
    if not self.stopped:
      super().emit(record)

  def handleError(self, record: std_logging.LogRecord) -> None:
    """A write that failed (OSError) stops the file; another failure drops the record alone."""
    if isinstance(sys.exc_info()[1], OSError):  # not a "--- Logging error ---" per record
      self.stopped = True


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
  """Keeps the terminal readable: progress lines, not library internals (the log file, added
  before or after, still gets them). Unless `tracebacks`, an exception escaping a library's
  background thread is one log line too."""
  quiet = _LibraryInfoFilter(tracebacks)
  for handler in std_logging.getLogger().handlers:  # records of every logger pass these
    if not isinstance(handler, _LogFile) and not _has_filter(handler):
      handler.addFilter(quiet)
  if not tracebacks:

    def one_line(args: threading.ExceptHookArgs) -> None:
      """A thread's uncaught exception as one error line (its traceback in the log file)."""
      name = args.thread.name if args.thread else "?"
      why = (args.exc_type, args.exc_value, args.exc_traceback)  # the log file keeps it
      logging.error(
        "thread %s stopped: %s: %s", name, args.exc_type.__name__, args.exc_value,
        exc_info=why, extra={"one_line": True},
      )  # fmt: skip

    threading.excepthook = one_line

    def unraisable(args) -> None:
      """An unraisable exception as one warning line (its traceback in the log file); a Ctrl-C
      that lands in such a callback (XLA's garbage-collection hook), or a failed save's
      callback firing after its event loop closed (at exit, after the run's last line), goes
      to the log file only: the stop or the failure is said once, by the line that ends the
      run."""
      why = (args.exc_type, args.exc_value, args.exc_traceback)
      closed = issubclass(args.exc_type, RuntimeError) and "Event loop is closed" in str(
        args.exc_value
      )
      if issubclass(args.exc_type, KeyboardInterrupt) or closed:
        logging.warning(
          "ignored in %r: %s: %s", args.object, args.exc_type.__name__, args.exc_value,
          exc_info=why, extra={"log_file_only": True},
        )  # fmt: skip
        return
      logging.warning(
        "ignored in %r: %s: %s", args.object, args.exc_type.__name__, args.exc_value,
        exc_info=why, extra={"one_line": True},
      )  # fmt: skip

    sys.unraisablehook = unraisable


def log_unawaited_coroutines() -> None:
  """Python's warnings as before, but a coroutine never awaited (a failed save's pending write,
  collected as the process exits) becomes a log record: in the log file, and on the terminal
  only under --debug."""
  shown = warnings.showwarning
  if getattr(shown, "logs_unawaited", False):
    return

  def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, RuntimeWarning) and "was never awaited" in str(message):
      text = warnings.formatwarning(message, category, filename, lineno, line).strip()
      logging.warning("%s", text, extra={"log_file_only": True})
      return
    shown(message, category, filename, lineno, file, line)

  show_warning.logs_unawaited = True
  warnings.showwarning = show_warning


def _has_filter(handler: std_logging.Handler) -> bool:
  return any(isinstance(f, _LibraryInfoFilter) for f in handler.filters)


def log_path(directory: str, process: int = 0) -> str | None:
  """The log file of process `process` in the local `directory` (`log.txt`, `log.<i>.txt` for
  process i > 0); None for an object store (gs://...: no file is kept)."""
  from jaxrl_llm import paths

  if paths.is_remote(directory):
    return None
  name = LOG_FILE if process == 0 else f"log.{process}.txt"
  return os.path.join(directory, name)


def keep_log(path: str) -> None:
  """Appends every log record from now on to the file `path` (its folder made if missing),
  after a line naming the time and command; a file already kept is not added twice."""
  path = os.path.abspath(path)
  root = std_logging.getLogger()
  if any(isinstance(h, _LogFile) and h.baseFilename == path for h in root.handlers):
    return
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = _LogFile(path, mode="a", encoding="utf-8")
    handler.stream.write(f"\n### {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(sys.argv)}\n")
    handler.flush()  # on disk now: a launch that ends in `os._exit` still leaves its header
  except OSError as e:  # e.g. a full disk: the run goes on without its log file
    logging.warning("no log file %s: %s", path, e.strerror or e)
    return
  handler.setFormatter(logging.PythonFormatter())
  # First among the handlers: it reads each record before the terminal's filter shortens it.
  root.handlers.insert(0, handler)


def log_files() -> list[str]:
  """The paths of the log files this process keeps."""
  return [h.baseFilename for h in std_logging.getLogger().handlers if isinstance(h, _LogFile)]


def in_log_files(line: str) -> None:
  """Writes `line` to the log files kept, not to the terminal: a stopping run's own line (an
  error, SIGTERM, Ctrl-C), which the caller prints on stderr, so that the log says why too."""
  record = std_logging.LogRecord("jaxrl_llm", std_logging.ERROR, __file__, 0, line, None, None)
  for handler in std_logging.getLogger().handlers:
    if isinstance(handler, _LogFile):
      handler.handle(record)


def close_log(path: str) -> None:
  """Stops keeping the log file `path` (closed; nothing more is written to it)."""
  root = std_logging.getLogger()
  for handler in [h for h in root.handlers if isinstance(h, _LogFile)]:
    if handler.baseFilename == os.path.abspath(path):
      root.removeHandler(handler)
      handler.close()


def setup(debug: bool = False, log_file: str | None = None) -> None:
  """The logging of a command line: absl's handler on stderr at INFO (never Python's
  `INFO:absl:` default format), plain lines on a terminal, library chatter and background
  threads' tracebacks off it unless `debug`; every record also in `log_file` when given. Called
  again (with the `log_file` once its folder is known), it only adds the file."""
  global _set_up
  if not _set_up:
    if not flags.FLAGS.is_parsed():  # no absl app (tools/sweep.py): absl's flags at defaults
      flags.FLAGS.mark_as_parsed()
    logging.use_absl_handler()  # also drops the stderr handler an earlier absl call made
    logging.set_verbosity(logging.INFO)  # the progress lines
    log_unawaited_coroutines()
    if not debug:
      quiet_library_logs()
      plain_on_terminal()
    _set_up = True
  if log_file is not None:
    keep_log(log_file)


# Actions that may be given more than once: each occurrence adds to the value (or ends the
# parse: help, version). Every other action stores one value, which a second occurrence would
# replace silently. (argparse's `extend` is a subclass of its `append`.)
REPEATABLE = (
  argparse._AppendAction,
  argparse._AppendConstAction,
  argparse._CountAction,
  argparse._HelpAction,
  argparse._VersionAction,
)


class ArgParser(argparse.ArgumentParser):
  """The tools' argument parser: a bad command line is one line, not argparse's usage block.
  `error` raises `raise_as(message)` for the tool to print as its one `error:` line (and its
  exit status 2); without `raise_as` it prints `error: message` and exits 2 itself.

  An option that stores one value (store, store_const, store_true/false, BooleanOptionalAction,
  a custom action) given twice is such an error (`--root is given twice (a, b): give it once`)
  where argparse would keep the last silently; append, append_const, extend and count options
  (and a custom action whose class sets `repeatable = True`) may repeat. The count is of the
  actions argparse takes, not of the strings on the command line: argparse's own
  `_parse_known_args` hands each option it recognised, with the strings of its value, to
  `_get_values` once per occurrence. So `--opt=v` and `--opt v`, the spellings of one option
  (`-n`/`--num`, `--x`/`--no-x`), an abbreviation (`--ro` for `--root`, where `allow_abbrev`),
  and `-ab` for `-a -b` count as the option they name; a value that looks like a flag
  (`--args=--root=x`, `--` and what follows it, a positional) is no occurrence of any option; and
  a sub-command's parser (`add_subparsers` makes it an ArgParser too, with its own count) counts
  its own options. Each parse starts a fresh count (`_parse_known_args`, once per pass of
  `parse_intermixed_args`). Both hooks are argparse's private methods (these signatures from
  Python 3.8 on); should one change, the tests of tests/test_terminal.py fail."""

  def __init__(self, *args, raise_as: Callable[[str], Exception] | None = None, **kwargs):
    """argparse's arguments, and `raise_as`: the tool's own error for a bad command line."""
    super().__init__(*args, **kwargs)
    self.raise_as = raise_as
    self._given: dict[argparse.Action, str] | None = None  # of the parse under way: its value

  def _parse_known_args(self, *args, **kwargs):
    """argparse's parse of the command line, with a fresh count of the options given."""
    outer, self._given = self._given, {}
    try:
      return super()._parse_known_args(*args, **kwargs)
    finally:
      self._given = outer

  def _get_values(self, action: argparse.Action, arg_strings: list[str]):
    """argparse's conversion of one occurrence of `action`'s strings; a second occurrence of an
    option that stores one value is an error (see the class docstring)."""
    repeatable = isinstance(action, REPEATABLE) or getattr(action, "repeatable", False)
    if action.option_strings and not repeatable and self._given is not None:
      shown = shlex.join(arg_strings) if arg_strings else ""
      if action in self._given:
        name = "/".join(action.option_strings)
        values = [self._given[action], shown]
        said = f" ({', '.join(v or 'no value' for v in values)})" if any(values) else ""
        # `error` has the message alone (no `argument --x:` in front), or with
        # exit_on_error=False the caller gets the ArgumentError, as for argparse's own errors.
        raise argparse.ArgumentError(None, f"{name} is given twice{said}: give it once")
      self._given[action] = shown
    return super()._get_values(action, arg_strings)

  def error(self, message: str):
    """One line for `message` (what argparse found wrong), as the class docstring says."""
    if self.raise_as is not None:
      raise self.raise_as(message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def count(text: str, least: int = 1) -> int:
  """An argparse `type`: a whole number >= `least` (1), else argparse's one error line."""
  try:
    n = int(text)
  except ValueError:
    n = least - 1
  if n < least:
    raise argparse.ArgumentTypeError(f"{text!r}: want a whole number >= {least}")
  return n


def counts(text: str, least: int = 1) -> list[int]:
  """An argparse `type`: comma-separated whole numbers, each >= `least` (1)."""
  try:
    return [count(t.strip(), least) for t in text.split(",")]
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(
      f"{text!r}: want comma-separated whole numbers, each >= {least}"
    ) from None


def positive(text: str) -> float:
  """An argparse `type`: a finite number > 0."""
  try:
    x = float(text)
  except ValueError:
    x = float("nan")
  if not 0 < x < float("inf"):
    raise argparse.ArgumentTypeError(f"{text!r}: want a finite number > 0")
  return x
