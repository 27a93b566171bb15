"""Run the trainer for many steps and sample its host memory (RSS): does it grow?

  python tools/soak.py --steps=300 [--interval_s=1] [-- --config.rl.num_prompts=16 ...]

Launches `python -m jaxrl_llm.main --config=configs/default.py` in a fresh workdir (`--workdir`,
kept; else a temporary one, removed at the end) with `train.num_steps=STEPS` (plus any flags
after `--`), reads the child's resident set size from /proc every `--interval_s` seconds and the step from its progress lines, and prints one JSON
object: RSS (MiB) at the first logged RL step (after compilation), at each quarter of the run
and at the end, the largest RSS seen, and the growth from the first logged step to the end.
Linux only (/proc).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run from a checkout without installing it
  sys.path.insert(0, _REPO)

from jaxrl_llm import paths, terminal  # noqa: E402

_STEP = re.compile(r"step (\d+)/(\d+)")


def rss_mib(pid: int) -> float | None:
  """Resident set size of process `pid` in MiB (None once it is gone)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    return None
  return None


def main(argv: list[str]) -> int:
  """Parse flags, run the trainer, print the RSS summary."""
  extra: list[str] = []
  if "--" in argv:
    argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
  parser = terminal.ArgParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=terminal.count, default=300, help="RL steps to run")
  parser.add_argument(
    "--interval_s", type=terminal.positive, default=1.0, help="RSS sampling period"
  )
  parser.add_argument(
    "--workdir", help="workdir, kept (default: a temporary directory, removed at the end)"
  )
  args = parser.parse_args(argv)
  for flag, instead in (("--workdir", "--workdir"), ("--config.train.num_steps", "--steps")):
    if given := [a for a in extra if a.split("=", 1)[0] == flag]:
      parser.error(f"{given[0]} after `--`: soak sets it; give {instead}=... before `--`")
  if args.workdir is not None:
    if problem := paths.dir_problem(args.workdir):
      parser.error(f"--workdir={args.workdir} {problem}")
    if os.path.isdir(args.workdir) and os.listdir(args.workdir):
      parser.error(f"--workdir={args.workdir} is not empty: a run there would resume, not start")
  # Absolute: the trainer runs in the repository, not in this process's folder.
  workdir = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="soak-")
  try:
    return _soak(args, extra, workdir)
  finally:
    if not args.workdir:  # soak's own temporary workdir: its checkpoints are of no use after
      shutil.rmtree(workdir, ignore_errors=True)


def _soak(args, extra: list[str], workdir: str) -> int:
  """Runs the trainer in `workdir`, samples its RSS, prints the summary; the exit status."""
  cmd = [
    sys.executable,
    "-m",
    "jaxrl_llm.main",
    "--config=configs/default.py",
    f"--workdir={workdir}",
    f"--config.train.num_steps={args.steps}",
    *extra,
  ]
  start = time.time()
  proc = subprocess.Popen(cmd, cwd=_REPO, stderr=subprocess.PIPE, text=True)
  step, tail = [0], collections.deque(maxlen=15)  # the trainer's last lines, for a failure

  def read_progress():
    for line in proc.stderr:
      tail.append(line.rstrip("\n"))
      m = _STEP.search(line)
      if m and "eval" not in line:
        step[0] = int(m.group(1))

  reader = threading.Thread(target=read_progress, daemon=True)
  reader.start()
  samples: list[tuple[float, int, float]] = []  # (seconds, step, rss MiB)
  while proc.poll() is None:
    rss = rss_mib(proc.pid)
    if rss is not None:
      samples.append((time.time() - start, step[0], rss))
    time.sleep(args.interval_s)
  reader.join(timeout=5)
  refusal = [line for line in tail if line.startswith("error:")][-1:]
  if proc.returncode == 2 and refusal:  # the trainer refused a flag given after `--`
    print(refusal[0], file=sys.stderr, flush=True)
    return 2
  if proc.returncode:
    print(
      f"the trainer failed (exit {proc.returncode}):",
      *(refusal or tail),
      sep="\n  ",
      file=sys.stderr,
    )
  rl = [s for s in samples if s[1] >= 1]
  summary: dict[str, object] = {"returncode": proc.returncode, "steps": args.steps}
  if rl:

    def at(fraction: float) -> float:
      target = max(1, int(args.steps * fraction))
      return next((r for _, s, r in rl if s >= target), rl[-1][2])

    first = rl[0][2]
    summary.update(
      rss_mib_first_step=round(first, 1),
      rss_mib_quarters=[round(at(q), 1) for q in (0.25, 0.5, 0.75, 1.0)],
      rss_mib_end=round(rl[-1][2], 1),
      rss_mib_max=round(max(r for _, _, r in samples), 1),
      growth_mib=round(rl[-1][2] - first, 1),
      seconds=round(samples[-1][0], 1),
    )
  print(json.dumps(summary), flush=True)
  return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
