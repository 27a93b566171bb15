"""How a process of a multi-process job reads its peers' stop notices (`distributed.peer_stopped`)
and compiles a program's first run ahead, stoppable by a signal (`distributed.Program`, on one
process here), and how a job
whose processes watch their peers ends (a real 4-process job); the training job itself is
exercised in `tests/test_multihost.py` (slow tier)."""

import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, cli_env, default_sigint

from jaxrl_llm import distributed, sigterm
from jaxrl_llm.run import preempt

KEY = "jaxrl_llm/stopped/"


def test_a_peers_unexpected_stop_ends_this_process_at_once_naming_it_and_why():
  seen = {}
  entries = [(f"{KEY}1", "1 ValueError: bad reward"), (f"{KEY}0", "130 stopped by SIGINT")]
  line = distributed.peer_stopped(entries, 0, 4, seen, now=5.0)  # its own notice is skipped
  assert line.startswith("error: process 1 of 4 stopped (ValueError: bad reward); this process")
  assert distributed.peer_stopped([(f"{KEY}0", "130 x")], 0, 4, seen, now=5.0) is None


def test_an_error_every_process_may_meet_itself_waits_so_each_prints_its_own_line_first():
  seen, grace = {}, distributed.OWN_ERROR_GRACE_S
  entries = [(f"{KEY}0", "2 error: mesh.data=3 does not divide the 8 devices")]
  assert distributed.peer_stopped(entries, 1, 2, seen, now=100.0) is None
  assert distributed.peer_stopped(entries, 1, 2, seen, now=100.0 + grace / 2) is None
  line = distributed.peer_stopped(entries, 1, 2, seen, now=100.0 + grace)
  assert "process 0 of 2 stopped (error: mesh.data=3 does not divide" in line


def test_a_program_compiles_ahead_once_per_signature_and_runs_the_same():
  import jax
  import jax.numpy as jnp
  from jax import monitoring

  jitted = jax.jit(lambda x: jnp.sin(x).sum())
  program = distributed.program(jitted, "f", "the sum")
  x, y, z = jnp.arange(4.0), jnp.arange(4.0) + 1, jnp.arange(8.0)
  want_x, want_y = float(jnp.sin(x).sum()), float(jnp.sin(y).sum())
  compiles = []
  count = lambda event, *_, **__: compiles.append(event) if "backend_compile" in event else None  # noqa: E731
  monitoring.register_event_duration_secs_listener(count)
  try:
    assert float(program(x)) == want_x
    assert float(program(y)) == want_y
    assert len(compiles) == 1  # compiled ahead once; the calls reused it
    program(z)
    assert len(compiles) == 2 and len(program.ready) == 2  # a new signature: one more
  finally:
    monitoring.unregister_event_duration_listener(count)


def test_a_program_takes_equivalent_shardings_as_its_signature():
  """A step's output comes back as `P()` where its input was `P(None)` or sharded over axes of
  size 1: the same program, so no second ahead-of-time compile (each was one, under the
  SIGTERM watcher's `compiling`, at the warm start's and the RL step's second step)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((1, 1), ("fsdp", "expert"))
  program = distributed.program(jax.jit(lambda x: x * 2), "f", "the double")
  for spec in (P(None), P(("fsdp", "expert")), P(), P("fsdp")):
    program(jax.device_put(jnp.arange(4.0), NamedSharding(mesh, spec)))
  assert len(program.ready) == 1
  program(jnp.arange(8.0))
  assert len(program.ready) == 2  # another shape: another program


COMPILING = """
import sys, time
import jax, jax.numpy as jnp
from jaxrl_llm import distributed, sigterm, terminal

terminal.setup()  # the trainer's: a Ctrl-C landing in a finalizer or gc callback is not printed
sigterm.listen()
sigterm.unsaved(sys.argv[1] == "unsaved")

def f(x):  # a program XLA takes seconds to compile: thousands of distinct operations
  for i in range(800):
    x = jnp.sin(x @ x + i)
  return x

program = distributed.program(jax.jit(f), "f", "the test program")
x = jnp.ones((8, 8)).block_until_ready()  # its own small compilation done before the marker
print("compiling", flush=True)
program(x)
print("compiled; SIGTERM seen:", sigterm.seen(), flush=True)
"""


@pytest.mark.parametrize(
  "case", ["SIGTERM", "SIGINT", pytest.param("unsaved", marks=pytest.mark.slow)]
)
def test_a_signal_during_a_compilation_stops_at_once_unless_progress_is_unsaved(tmp_path, case):
  # XLA compiles in one C++ call in which Python runs no signal handler: the watcher thread of
  # `sigterm.compiling` ends the process with the stop's line (and 128 + the signal) while the
  # compilation goes on. With progress no checkpoint holds, the compilation is not cut: the
  # signal is taken after it (the run then saves at its next safe point).
  script = tmp_path / "compiling.py"
  script.write_text(COMPILING)
  proc = subprocess.Popen(
    [sys.executable, str(script), case],
    cwd=REPO,
    env={**cli_env(), "JAX_COMPILATION_CACHE_DIR": ""},  # no cache: the program really compiles
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    preexec_fn=default_sigint,
  )
  assert proc.stdout.readline() == "compiling\n"
  time.sleep(0.5)  # inside the program's first call: tracing, then XLA
  proc.send_signal(signal.SIGINT if case == "SIGINT" else signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  if case == "unsaved":
    assert proc.returncode == 0 and out == "compiled; SIGTERM seen: True\n", err[-2000:]
    return
  name = "SIGTERM" if case == "SIGTERM" else "SIGINT (Ctrl-C)"
  assert proc.returncode == (143 if case == "SIGTERM" else 130), err[-2000:]
  assert out == "" and err.splitlines()[-1] == f"stopped by {name} while compiling the test program"


RACING = """
import ctypes, os, signal, sys, time
from jaxrl_llm import launch, sigterm

workdir = sys.argv[1]
sigterm.listen()
try:
  with sigterm.leaving(lambda signum, what: launch.stop_while_compiling(signum, what, workdir)):
    with sigterm.closing(lambda: time.sleep(6.0)):  # a save in flight the watcher waits for
      with sigterm.compiling("the test program"):
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the watcher gets it
        os.kill(os.getpid(), signal.SIGINT)
        ctypes.CDLL(None).usleep(3_000_000)  # XLA's C++ call: no Python handler runs in it
      signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
      time.sleep(10)  # the compilation ended while the watcher's closer runs
except KeyboardInterrupt:  # as `launch.train`'s: the main thread's own stop
  launch.stop_on_sigint(workdir)
"""


def test_a_compilation_that_ends_while_the_watcher_stops_says_the_watchers_line(tmp_path):
  # Ctrl-C during a compilation: the watcher thread runs the closers (saves in flight) before
  # its line; when the compilation ends meanwhile, the main thread's KeyboardInterrupt must
  # not say a second, generic stop first (CI met "stopped by SIGINT (Ctrl-C): the checkpoints
  # committed before it ..." where the line names the compilation).
  script = tmp_path / "racing.py"
  script.write_text(RACING)
  proc = subprocess.run(
    [sys.executable, str(script), str(tmp_path)],
    cwd=REPO,
    env=cli_env(),
    capture_output=True,
    text=True,
    timeout=120,
    preexec_fn=default_sigint,
  )
  assert proc.returncode == 130, proc.stderr[-2000:]
  assert proc.stderr.count("stopped by ") == 1, proc.stderr[-2000:]
  assert proc.stderr.splitlines()[-1] == (  # nothing saved in it: the line does not say intact
    f"stopped by SIGINT (Ctrl-C) while compiling the test program: no checkpoint was saved yet in "
    f"{tmp_path}; relaunch the same command to start"
  ), proc.stderr[-2000:]


def test_ctrl_c_s_line_says_whether_a_checkpoint_was_saved(tmp_path):
  """Ctrl-C's line said "the checkpoints committed before it are intact" in a folder where none
  had been saved; a step folder being written (no digits only), or one without orbax's commit
  marker, is not a committed one."""
  (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").mkdir(parents=True)
  assert preempt.sigint_line(str(tmp_path), "the RL step") == (
    f"stopped by SIGINT (Ctrl-C) while compiling the RL step: no checkpoint was saved yet in "
    f"{tmp_path}; relaunch the same command to start"
  )
  (tmp_path / "checkpoints" / "2").mkdir()  # renamed into place, its commit marker not yet
  assert "no checkpoint was saved yet" in preempt.sigint_line(str(tmp_path))
  (tmp_path / "checkpoints" / "2" / "commit_success.txt").touch()
  assert preempt.sigint_line(str(tmp_path)) == (
    f"stopped by SIGINT (Ctrl-C): the checkpoints committed before it are intact in {tmp_path}; "
    "relaunch the same command to resume"
  )


CLOSED = """
import ctypes, os, signal, sys
from jaxrl_llm import launch, sigterm, terminal

workdir = sys.argv[1]
terminal.keep_log(os.path.join(workdir, "log.txt"))
sigterm.listen()
with sigterm.leaving(lambda signum, what: launch.stop_while_compiling(signum, what, workdir)):
  with sigterm.compiling("the test program"):
    print("compiling", flush=True)
    ctypes.CDLL(None).usleep(60_000_000)  # XLA's C++ call: no Python handler runs in it
"""


def _start(tmp_path, name: str, text: str) -> subprocess.Popen:
  """Runs the script `text` (as tmp_path/name, given tmp_path) with pipes, Ctrl-C as a terminal's."""
  script = tmp_path / name
  script.write_text(text)
  return subprocess.Popen(
    [sys.executable, str(script), str(tmp_path)],
    cwd=REPO,
    env=cli_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    preexec_fn=default_sigint,
  )


def test_a_ctrl_c_whose_terminal_pipe_closed_still_ends_the_run(tmp_path):
  """`main ... 2>&1 | tee log`, Ctrl-C while compiling: tee ends on the same signal, the stop's
  line met a closed pipe (BrokenPipeError on the watcher thread, which died before its exit)
  and the main thread waited for that exit for good; only kill -9 ended it. Now it leaves
  with 130, and the line is in the run's log file."""
  proc = _start(tmp_path, "closed.py", CLOSED)
  assert proc.stdout.readline() == "compiling\n"
  proc.stderr.close()  # the pipe's reader is gone, as tee is
  proc.send_signal(signal.SIGINT)
  try:
    assert proc.wait(timeout=45) == 130
  finally:
    proc.kill()
  assert (
    (tmp_path / "log.txt")
    .read_text()
    .splitlines()[-1]
    .endswith(
      "stopped by SIGINT (Ctrl-C) while compiling the test program: no checkpoint was saved yet "
      f"in {tmp_path}; relaunch the same command to start"
    )
  )


TWICE = """
import os, sys, time
from jaxrl_llm import launch, sigterm

workdir = sys.argv[1]

def close():  # a save in flight: the stop waits for it
  print("closing", flush=True)
  time.sleep(3.0)
  open(os.path.join(workdir, "closed"), "w").close()

sigterm.listen()
with sigterm.leaving(lambda signum, what: launch.stop_while_compiling(signum, what, workdir)):
  with sigterm.closing(close):
    with sigterm.compiling("the test program"):
      print("tracing", flush=True)
      time.sleep(60)  # Python code: Ctrl-C reaches the main thread here, and the watcher
"""


def test_a_second_ctrl_c_while_the_stop_waits_for_a_save_lets_the_save_finish(tmp_path):
  """A second Ctrl-C while the stop's closers ran (a save in flight) unwound the main thread,
  whether it ran the stop or waited for the watcher's: the process left without the save's
  end (or with a traceback). Now the stop goes on: one line, 130, the closer finished."""
  proc = _start(tmp_path, "twice.py", TWICE)
  assert proc.stdout.readline() == "tracing\n"
  proc.send_signal(signal.SIGINT)
  assert proc.stdout.readline() == "closing\n"
  time.sleep(0.5)
  proc.send_signal(signal.SIGINT)
  err = proc.communicate(timeout=60)[1]
  assert proc.returncode == 130, err[-2000:]
  assert (tmp_path / "closed").exists() and "Traceback" not in err, err[-2000:]
  assert err.count("stopped by ") == 1 and err.strip().splitlines()[-1].startswith(
    "stopped by SIGINT (Ctrl-C) while compiling the test program: "
  ), err[-2000:]


EARLY = """
from jaxrl_llm import sigterm


def interrupted():
  raise KeyboardInterrupt  # a second Ctrl-C in the stop's first lines


sigterm.note = interrupted
sigterm._stop(15, "the test program")
print("returned", flush=True)
"""


def test_a_second_ctrl_c_in_the_stops_first_lines_still_leaves_by_the_signals_status(tmp_path):
  """The stop's first lines (the hook's lookup, the SIGTERM note) ran before its try: a
  KeyboardInterrupt there escaped the stop, which the other threads wait on to leave."""
  proc = _start(tmp_path, "early.py", EARLY)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 143 and "returned" not in out, err[-2000:]
  assert "Traceback" not in err and "error: while stopping: KeyboardInterrupt" in err, err


def test_the_watcher_cannot_claim_a_stop_once_the_compilation_ended(monkeypatch):
  """The watcher read `what` while set, the main thread then left the compilation, failed and
  began its own stop (holding launch's lock) while the watcher claimed the stop too: each
  waited for the other for ever. The claim now holds only while a compilation is under way,
  decided under the lock that ends it."""
  monkeypatch.setitem(sigterm._COMPILE, "stopping", None)
  monkeypatch.setitem(sigterm._COMPILE, "what", None)  # the compilation has ended
  assert not sigterm._claim() and sigterm._COMPILE["stopping"] is None


WATCHING = """
import sys, time
from jaxrl_llm import distributed
from jaxrl_llm.run import preempt

distributed.initialize(120)
distributed.watch_peers(interval_s=0.0)  # always inside the service's client, as at a run's end
time.sleep(0.5)
print("finished", flush=True)
"""


@pytest.mark.extended
def test_a_job_whose_processes_watch_their_peers_ends_with_exit_0_on_every_process(tmp_path):
  # A process that ended while its watcher thread was inside the coordination service's
  # client aborted in the interpreter's teardown ("FATAL: exception not rethrown", exit 250)
  # after a run that succeeded: 9 launches of 10 here before the watcher was stopped at exit.
  script = tmp_path / "watching.py"
  script.write_text(WATCHING)
  cmd = [sys.executable, str(REPO / "tools" / "launch_local.py"), "--processes=4"]
  cmd += ["--devices_per_process=1", "--", sys.executable, str(script)]
  for _ in range(3):
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "not rethrown" not in out, out[-3000:]
    assert out.count("finished") == 4, out[-3000:]
