"""Rehearse a multi-host run on one machine: N processes, one global mesh of fake CPU devices.

  python tools/launch_local.py --processes=2 --devices_per_process=4 -- \
      python -m jaxrl_llm.main --config=configs/default.py --workdir=/tmp/run --distributed

Starts the command N times. Each copy gets `JAXRL_LLM_COORDINATOR` (a free localhost port),
`JAXRL_LLM_NUM_PROCESSES`, `JAXRL_LLM_PROCESS_ID`, `JAX_PLATFORMS=cpu` and
`--xla_force_host_platform_device_count` in `XLA_FLAGS`, so with `--distributed` the copies
join one job (gloo collectives) whose mesh spans N x devices_per_process devices, as the hosts
of a pod slice do. Output lines are prefixed with `[i]`. When one process fails the others are
stopped; the exit code is the first non-zero one (0 when all succeed; 128 + N for a process
killed by signal N, as a shell reports it). Ctrl-C stops them all. A bad flag, or a command that
cannot be started, is one `error:` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxrl_llm.terminal import ArgParser


def free_port() -> int:
  """A TCP port nobody listens on now."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(index: int, processes: int, port: int, devices: int) -> dict[str, str]:
  """The environment of process `index`."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
  env.update(
    JAXRL_LLM_COORDINATOR=f"localhost:{port}",
    JAXRL_LLM_NUM_PROCESSES=str(processes),
    JAXRL_LLM_PROCESS_ID=str(index),
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
  )
  return env


USAGE = "launch_local.py [--processes=N] [--devices_per_process=D] [--port=P] -- COMMAND ..."


class ArgError(Exception):
  """A bad command line (reported as one `error:` line, exit code 2)."""


def _exit_code(returncode: int) -> int:
  """A process's exit status as a shell reports it: 128 + N when signal N ended it."""
  return 128 - returncode if returncode < 0 else returncode


def _pump(index: int, stream, out) -> None:
  for line in stream:
    out.write(f"[{index}] {line}")
    out.flush()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """(flags, command) of the command line; ArgError names what is wrong."""
  parser = ArgParser(
    raise_as=ArgError, prog="launch_local.py", usage=USAGE, description=__doc__.splitlines()[0]
  )
  parser.add_argument("--processes", type=int, default=2, help="number of processes")
  parser.add_argument("--devices_per_process", type=int, default=4, help="fake CPU devices each")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  if "--" not in argv:
    parser.parse_args(argv)  # a bad flag is named first
    raise ArgError("no command: give it after `--`")
  split = argv.index("--")
  args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
  if args.processes < 1 or args.devices_per_process < 1:
    raise ArgError(
      f"--processes={args.processes} --devices_per_process={args.devices_per_process}: "
      "both must be >= 1"
    )
  if not 0 <= args.port <= 65535:
    raise ArgError(f"--port={args.port}: want 0 (a free one) or a port in [1, 65535]")
  if not command:
    raise ArgError("no command after `--`")
  return args, command


def main(argv: list[str]) -> int:
  """Parse flags, start the processes, wait for them; returns the job's exit code."""
  if {"-h", "--help"} & set(argv[: argv.index("--")] if "--" in argv else argv):
    print(__doc__.strip())
    return 0
  try:
    args, command = parse_args(argv)
  except ArgError as e:
    print(f"error: {e}; usage: {USAGE}", file=sys.stderr)
    return 2
  port = args.port or free_port()
  procs, pumps = [], []
  for i in range(args.processes):
    env = process_env(i, args.processes, port, args.devices_per_process)
    try:
      proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
      )
    except OSError as e:  # not found, not executable: no process is left behind
      for p in procs:
        p.kill()
        p.wait()
      print(f"error: cannot start {command[0]!r}: {e.strerror or e}", file=sys.stderr)
      return 2
    procs.append(proc)
    pump = threading.Thread(target=_pump, args=(i, proc.stdout, sys.stdout), daemon=True)
    pump.start()
    pumps.append(pump)
  code = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      if failed:
        code = failed[0]
        for p in procs:
          if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        break
      time.sleep(0.1)
    for p in procs:
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
  except KeyboardInterrupt:
    for p in procs:
      p.kill()
    return 130
  for pump in pumps:
    pump.join(timeout=5)
  return _exit_code(code or next((p.returncode for p in procs if p.returncode), 0))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
