"""Same behaviour: train two trees alike and compare every logged scalar at every step.

  python tools/same_behaviour.py --before=REV [--after=PATH_OR_REV] [--steps=10]
      [--config=configs/default.py --config=configs/dr_grpo.py] [--set=section.field=value]
      [--resume_check] [--grid=FIELD=V1,V2 ...]
  python tools/same_behaviour.py --freeze_configs=tests/fixtures/default_config_before.json

A revision is checked out by `git worktree add --detach` into a temporary folder (removed
afterwards); `--after` defaults to this working tree. Each config (a path inside each tree) is
trained `--steps` RL steps by each tree's trainer CLI (subprocesses on the CPU, PYTHONPATH the
tree), every step logged; every scalar of every run folder (RL and `sft`) must be equal, but the
wall-clock tags (`EXCLUDED`, printed). `--resume_check`: BEFORE trains to K = steps // 2, AFTER
resumes that workdir; its scalars after K must equal BEFORE's uninterrupted run (a refusal is
printed). `--grid` (repeatable) trains each config as a pack of the grid's runs with each tree's
`tools/sweep.py --packed` instead, and compares every run's folder. Exit 0 when all is equal,
else 1. `--freeze_configs=PATH` writes the default config
and every configs/*.py of this tree as JSON ({"default": {...}, "configs/dapo.py": {...}}).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing it
  sys.path.insert(0, str(ROOT))

from jaxrl_llm import paths, terminal  # noqa: E402

# Wall-clock tags: seconds, rates per second and anything named after time differ run to run.
EXCLUDED = ("perf/step_time_s", "perf/*_per_s", "*time*", "*_s")
DEFAULT_CONFIGS = ("configs/default.py", "configs/dr_grpo.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line (see the module docstring)."""
  p = terminal.ArgParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--before", help="git revision to compare against")
  p.add_argument("--after", default=str(ROOT), help="tree path or revision (default: this tree)")
  p.add_argument("--steps", type=terminal.count, default=10, help="RL steps per run")
  p.add_argument("--config", action="append", help="config file inside each tree (repeatable)")
  p.add_argument("--set", action="append", default=[], help="section.field=value for both sides")
  p.add_argument("--set_after", action="append", default=[], help=argparse.SUPPRESS)  # self-test
  p.add_argument("--resume_check", action="store_true", help="AFTER resumes BEFORE's checkpoint")
  p.add_argument("--grid", action="append", default=[], help="FIELD=V1,V2: train a pack")
  p.add_argument("--freeze_configs", metavar="PATH", help="write this tree's configs as JSON")
  args = p.parse_args(argv)
  if args.freeze_configs is not None:
    if problem := paths.file_problem(args.freeze_configs):
      p.error(f"--freeze_configs={args.freeze_configs} {problem}")
    compared = [
      f"--{k}" for k, v in vars(args).items() if k != "freeze_configs" and v != p.get_default(k)
    ]
    if compared:
      p.error(f"--freeze_configs only writes configs; drop {', '.join(compared)} (a comparison's)")
  elif not args.before:
    p.error("--before is required (unless --freeze_configs)")
  if args.resume_check and args.steps < 2:
    p.error(f"--resume_check --steps={args.steps}: want --steps >= 2 (it resumes after steps // 2)")
  for flag in ("set", "set_after", "grid"):
    for text in getattr(args, flag):
      field, eq, value = text.partition("=")
      if not (eq and value and field and all(part.isidentifier() for part in field.split("."))):
        p.error(f"--{flag}={text}: want section.field=value")
  args.config = args.config or list(DEFAULT_CONFIGS)
  return args


def load_config(path: pathlib.Path):
  """`get_config()` of a config file, loaded as tests/conftest.py's load_config does."""
  spec = importlib.util.spec_from_file_location(f"cfg_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def freeze_configs(out: str) -> None:
  """Writes the default config and every configs/*.py of this tree to `out` as sorted JSON."""
  sys.path.insert(0, str(ROOT))
  from jaxrl_llm.config import default_config

  plain = lambda c: json.loads(c.to_json_best_effort())  # noqa: E731
  frozen = {"default": plain(default_config())}
  for path in sorted((ROOT / "configs").glob("*.py")):
    frozen[f"configs/{path.name}"] = plain(load_config(path))
  paths.makedirs(os.path.dirname(os.path.abspath(out)))
  paths.write_text(out, json.dumps(frozen, sort_keys=True, indent=2) + "\n")
  print(f"wrote {len(frozen)} configs to {out}")


class BadTree(Exception):
  """A tree or config that cannot be compared (one `error:` line, exit status 2)."""


@contextlib.contextmanager
def materialise(spec: str, tmp: str, name: str):
  """Yields (tree path, label): `spec` itself if it is a folder, else a temporary worktree of
  the revision `spec`, removed afterwards."""
  if os.path.isdir(spec):
    yield os.path.abspath(spec), f"{spec} (working tree)"
    return
  git = ["git", "-C", str(ROOT)]
  commit = [*git, "rev-parse", "--verify", "--quiet", "--short", f"{spec}^{{commit}}"]
  sha = subprocess.run(commit, capture_output=True, text=True)
  if sha.returncode:
    raise BadTree(f"--{name}={spec}: neither a folder nor a git revision of {ROOT} (a commit)")
  path = os.path.join(tmp, name)
  add = [*git, "worktree", "add", "--detach", "-q", path, sha.stdout.strip()]
  if (made := subprocess.run(add, capture_output=True, text=True)).returncode:
    last = (made.stderr.strip().splitlines() or ["no message"])[-1]
    raise BadTree(f"--{name}={spec}: git worktree add failed: {last}")
  try:
    yield path, f"{spec} ({sha.stdout.strip()})"
  finally:
    subprocess.run([*git, "worktree", "remove", "--force", path], check=False)


def overrides(steps: int, sets: list[str]) -> list[str]:
  """Trainer flags for a short run with every step logged, plus the `--set` fields."""
  k = max(steps // 2, 1)
  base = [f"num_steps={steps}", "log_every=1", f"eval_every={k}", f"checkpoint_every={k}"]
  return [f"--config.train.{f}" for f in base] + [f"--config.{s}" for s in sets]


GRID: list[str] = []  # `--grid`: each config trains as a pack of these runs


def start(tree: str, config: str, workdir: str, flags: list[str]) -> subprocess.Popen:
  """Starts the trainer of `tree` on its `config` file in a subprocess (CPU, cwd a temp dir):
  its command line, or with `GRID` its packed sweep."""
  env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  if GRID:
    cmd = [sys.executable, os.path.join(tree, "tools", "sweep.py"), "--packed"]
    cmd += [f"--config={os.path.join(tree, config)}", f"--root={workdir}"]
    cmd += [f"--grid={g}" for g in GRID]
    cmd += ["--set=" + f.removeprefix("--config.") for f in flags]
  else:
    cmd = [sys.executable, "-m", "jaxrl_llm.main", f"--config={os.path.join(tree, config)}"]
    cmd += [f"--workdir={workdir}", *flags]
  os.makedirs(workdir, exist_ok=True)
  with open(workdir + ".log", "a") as log:  # the child keeps its own copy of the handle
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(workdir), env=env, stdout=log, stderr=log)
  proc.started = time.time()
  return proc


def finish(procs: dict[str, subprocess.Popen]) -> dict[str, tuple[int, float]]:
  """Waits for every run; returns name -> (exit status, seconds)."""
  ended = {}
  while len(ended) < len(procs):
    for name, proc in procs.items():
      if name not in ended and proc.poll() is not None:
        ended[name] = (proc.returncode, time.time() - proc.started)
    time.sleep(0.2)
  return {name: ended[name] for name in procs}


def excluded(tag: str) -> bool:
  """Whether `tag` is a wall-clock tag (`EXCLUDED`)."""
  return any(fnmatch.fnmatchcase(tag, p) for p in EXCLUDED)


def read_runs(workdir: str, min_step: int = -1, folder: str | None = None) -> dict:
  """Scalars of the run folders under `workdir` (all but checkpoints, or only `folder`) as
  'folder:tag' -> {step: [values]}, for the steps above `min_step`."""
  sys.path.insert(0, str(ROOT))
  from jaxrl_llm import metric_info, metrics

  out = {}
  for dirpath, dirnames, files in os.walk(workdir):
    dirnames[:] = sorted(d for d in dirnames if d != "checkpoints")
    name = os.path.relpath(dirpath, workdir)
    if any(map(metric_info.is_event_file, files)) and folder in (None, name):
      for tag, series in metrics.read_scalars(dirpath).items():
        steps = out.setdefault(f"{name}:{tag}", {})
        for step, value in series:
          if step > min_step:
            steps.setdefault(step, []).append(value)
  return out


def same(a: list[float] | None, b: list[float] | None) -> bool:
  """The values logged at one step agree exactly (NaN equal to NaN; a repeated step differs)."""
  eq = lambda x, y: x == y or (math.isnan(x) and math.isnan(y))  # noqa: E731
  return a is not None and b is not None and len(a) == len(b) and all(map(eq, a, b))


def compare(before: dict, after: dict) -> tuple[list, int, set]:
  """(first difference of each tag as (step, tag, before, after) by step, values compared,
  the excluded tags seen)."""
  diffs, count, skipped = [], 0, set()
  for tag in sorted(set(before) | set(after)):
    if excluded(tag.split(":", 1)[1]):
      skipped.add(tag.split(":", 1)[1])
      continue
    b, a = before.get(tag, {}), after.get(tag, {})
    for step in sorted(set(b) | set(a)):
      count += 1
      if not same(b.get(step), a.get(step)):
        diffs.append((step, tag, b.get(step, "absent"), a.get(step, "absent")))
        break
  return sorted(diffs, key=lambda d: d[:2]), count, skipped


def report(name: str, before: dict, after: dict) -> bool:
  """Prints whether the scalars agree (else the first difference); returns whether they do."""
  diffs, count, skipped = compare(before, after)
  print(f"[{name}] excluded tags present: {', '.join(sorted(skipped)) or 'none'}")
  if not diffs and count:
    tags = sum(not excluded(t.split(":", 1)[1]) for t in before)
    folders = sorted({t.split(":", 1)[0] for t in before})
    print(f"[{name}] equal: {count} values of {tags} tags in run folders {folders}")
    return True
  if not count:
    print(f"[{name}] DIFFERENT: no scalars were logged")
    return False
  print(f"[{name}] DIFFERENT: {len(diffs)} tags differ; the first difference of each run folder:")
  shown = lambda v: v if isinstance(v, str) else ", ".join(map(repr, v))  # noqa: E731
  for folder in sorted({d[1].split(":", 1)[0] for d in diffs}):
    step, tag, vb, va = next(d for d in diffs if d[1].startswith(f"{folder}:"))
    print(f"[{name}]   {folder}: step {step}, tag {tag.split(':', 1)[1]}: ", end="")
    print(f"before={shown(vb)} after={shown(va)}")
  return False


def train(jobs: dict, config: str, name: str) -> bool:
  """Runs the trainer jobs {label: (tree, workdir, flags)} on `config` side by side, prints their
  times and, for a failed one, its refusal line (`error: ...`) or else its last lines. Returns
  whether all exited 0."""
  results = finish({k: start(tree, config, wd, flags) for k, (tree, wd, flags) in jobs.items()})
  print(f"[{name}] " + ", ".join(f"{k} {t:.1f}s" for k, (_, t) in results.items()))
  for key, (rc, _) in results.items():
    if rc:
      lines = pathlib.Path(jobs[key][1] + ".log").read_text(errors="replace").splitlines()
      shown = [ln for ln in lines if ln.startswith("error:")][-1:] or lines[-15:]
      print(f"[{name}] {key} run failed (exit {rc}):", *shown, sep="\n  ")
  return not any(rc for rc, _ in results.values())


def run_config(config: str, trees: dict, tmp: str, args: argparse.Namespace) -> bool:
  """Trains `config` in both trees (and the resume check); returns whether all is equal."""
  flags = overrides(args.steps, args.set)
  after = flags + [f"--config.{s}" for s in args.set_after]  # the self-test's hidden change
  base = os.path.join(tmp, "runs", config.replace("/", "_"))
  dirs = {s: os.path.join(base, s) for s in ("before", "after", "resumed")}
  jobs = {"before": (trees["before"], dirs["before"], flags)}
  if not train(jobs | {"after": (trees["after"], dirs["after"], after)}, config, config):
    return False
  ok = report(config, read_runs(dirs["before"]), read_runs(dirs["after"]))
  if not args.resume_check:
    return ok
  k, resumed = max(args.steps // 2, 1), dirs["resumed"]
  stop = [f"--config.train.stop_after_steps={k}"]
  if not train(
    {"before": (trees["before"], resumed, flags + stop)}, config, f"{config} to step {k}"
  ):
    return False
  if not train({"after": (trees["after"], resumed, after)}, config, f"{config} resumed"):
    return False
  name = f"{config} resumed after step {k}"
  twice = [t for t, s in read_runs(resumed).items() if any(len(v) > 1 for v in s.values())]
  if twice:  # a run that started afresh logs the steps up to k again
    print(f"[{name}] DIFFERENT: the after tree did not resume ({twice[0]} has a step twice)")
    return False
  return report(name, read_runs(dirs["before"], k, "."), read_runs(resumed, k, ".")) and ok


def main(argv: list[str] | None = None) -> int:
  """Runs the comparison; returns the exit status (0: equal, 1: a difference or failure)."""
  args = parse_args(argv)
  if args.freeze_configs:
    freeze_configs(args.freeze_configs)
    return 0
  GRID[:] = args.grid
  if GRID:
    print(f"packs of the grid {' '.join(GRID)} (tools/sweep.py --packed)")
  print(f"excluded (wall-clock) tag patterns: {', '.join(EXCLUDED)}")
  print(f"overrides: {' '.join(overrides(args.steps, args.set))}")
  if args.set_after:
    print(f"after only (debug): {args.set_after}")
  ok, t0 = True, time.time()
  try:
    with tempfile.TemporaryDirectory(prefix="same_behaviour_") as tmp:
      with (
        materialise(args.before, tmp, "before") as (b, bl),
        materialise(args.after, tmp, "after") as (a, al),
      ):
        print(f"before: {bl}\nafter:  {al}")
        trees = {"before": b, "after": a}
        labels = {"before": bl, "after": al}
        for side, tree in trees.items():  # every config in both trees, before any run
          for config in args.config:
            if not os.path.isfile(os.path.join(tree, config)):
              raise BadTree(f"--config={config}: no such file in the {side} tree, {labels[side]}")
        for config in args.config:
          ok = run_config(config, trees, tmp, args) and ok
  except BadTree as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{'equal' if ok else 'DIFFERENT'} ({time.time() - t0:.0f}s)")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
