"""How a process of a multi-process job reads its peers' stop notices (`distributed.peer_stopped`)
and starts a program's first run (`distributed.Lockstep`, on one process here), and how a job
whose processes watch their peers ends (a real 4-process job); the training job itself is
exercised in `tests/test_multihost.py` (slow tier)."""

import subprocess
import sys

import pytest
from conftest import REPO, cli_env

from jaxrl_llm import distributed

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


def test_a_lockstep_program_compiles_ahead_once_per_signature_and_runs_the_same():
  import jax
  import jax.numpy as jnp
  from jax import monitoring

  jitted = jax.jit(lambda x: jnp.sin(x).sum())
  assert distributed.lockstep(jitted, "f") is jitted  # one process: nothing to wait for
  program = distributed.Lockstep(jitted, "f")
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


WATCHING = """
import sys, time
from jaxrl_llm import distributed

distributed.initialize(120)
distributed.watch_peers(interval_s=0.0)  # always inside the service's client, as at a run's end
time.sleep(0.5)
print("finished", flush=True)
"""


@pytest.mark.slow
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
