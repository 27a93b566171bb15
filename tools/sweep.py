"""Hyperparameter sweeps: one `python -m jaxrl_llm.main` subprocess per grid point, or with
`--packed` every grid point in one program (a pack, `jaxrl_llm/run/pack.py`).

  python tools/sweep.py --config=configs/default.py --root=/tmp/sweep \\
      --grid='objective.clip_high=0.2,0.28' --grid='sampling.temperature=0.7,1.0' \\
      [--set='train.num_steps=200'] [--seeds=0,1] [--parallel=1] [--packed] [--dry_run]

Runs the Cartesian product of the `--grid` values (and `--seeds`), each in its own workdir
`ROOT/<field>=<value>,...[,seed=<s>]` with the command a user would type by hand:
`python -m jaxrl_llm.main --config=... --workdir=... --config.<field>=<value> ...`. `--set`
fixes a field for every run (repeatable; `--set='a.b=1,c.d=2'` sets two fields). Points that
differ only in values a pack may vary (the clip ranges, temperature, learning rate, seed, ...;
not `sampling.top_k` or `top_p`) run one program, which the first compiles and the rest load
from `train.compilation_cache`.

Every field is checked against the config, and every grid point's values against their
ranges, before any run starts. A run whose workdir holds a
checkpoint at its final step is skipped, and an unfinished one resumes (the trainer continues
from its workdir), so an interrupted sweep is resumed by rerunning the same command. Each run's
output goes to `<workdir>/run.log` and its overrides to `<workdir>/run.json` (a workdir is not
resumed with different overrides unless `--allow_changed`; a grid point that is a run already in
ROOT under another spelling of its values, `1` for `1.0`, is refused). `ROOT/sweep.json` records the runs and
their status (runs that an earlier grid named and this one does not stay in it, as
`earlier_runs`); a summary table is printed at the end. A failed run is reported with the tail of
its log and the sweep goes on; the exit status is 1 if any run failed.

With `--packed`, the runs train together in this process (with `--distributed`, in the
multi-process job this command joins on every host, as the trainer's `--distributed`; with
`mesh.runs=1` each run's rows spread over the processes, with `mesh.runs` > 1 the runs do):
each keeps its folder
`ROOT/<name>` (events, config.json, HParams, and run.json: a pack is not resumed with other
overrides either), the pack checkpoints in `ROOT/checkpoints` and
resumes from there when the same command is run again; `--dry_run` checks that the grid packs
and prints the packed step's memory per device (compile only). A grid over a field that changes
the program (objective name, model shape, group size, ...) is refused with one line naming the
packable fields.

The terminal shows the sweep's lines and, with `--packed`, the runs' own (`[<name>] ...`), plain
on a terminal as the trainer's; the libraries' log lines (orbax, grain, tensorboard, ...) go to
`ROOT/log.txt` (with `--packed`, every line of the pack), and to the terminal only with
`--debug`, which also gives each run's trainer `--debug` (full tracebacks in its run.log).

Compare runs with `python tools/compare.py --root=ROOT` or `tensorboard --logdir ROOT`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import compare  # tools/compare.py, next to this file

from jaxrl_llm import launch, paths, terminal
from jaxrl_llm.checkpoint_manifest import COMMIT_FILE
from jaxrl_llm.config import INVOCATION, ConfigError, acting, command_line, parse, tagged
from jaxrl_llm.run.record import folder_name

TRAINER = ("-m", "jaxrl_llm.main")
SUMMARY_TAGS = ("eval/accuracy", "eval/pass@*", "rollout/reward_mean")
JOIN_TIMEOUT_S = 300.0  # with --distributed: give up joining the job after (--join_timeout_s)
STOP_GRACE_S = 30.0  # after Ctrl-C: how long the runs get to stop on their own
PROGRESS_S = 20.0  # a running run's newest progress line is shown this often (--progress_s)
_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")  # absl's, in a run.log
_PROGRESS = re.compile(r"^(\[[^\]]*\] )?step \d+/\d+ ")
_FIELD = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
# The objectives' hyperparameters that bound a ratio (§2): with one optimiser update per rollout
# the old log-probs are the learner's own, sg[ℓ] (§0), every ratio is 1 and none of them binds.
_RATIO_BOUNDS = ("clip_low", "clip_high", "dual_clip", "clip_log", "is_clip_low", "is_clip_high")


class SweepError(ValueError):
  """A bad sweep specification, found before any run starts."""


@dataclasses.dataclass
class Run:
  """One grid point: its workdir, trainer command and outcome."""

  name: str
  workdir: str
  params: dict[str, str]  # the grid values of this run
  overrides: dict[str, str]  # every --config.<field> flag: --set values, then the grid values
  argv: list[str]
  final_step: int
  status: str = "pending"  # pending|running|done|skipped|incomplete|failed|interrupted
  start_step: int | None = None  # latest committed checkpoint when the run was launched
  returncode: int | None = None
  elapsed_s: float | None = None
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  last_step: int | None = None

  @property
  def log(self) -> str:
    """Path of the run's log file."""
    return os.path.join(self.workdir, "run.log")

  def to_json(self) -> dict[str, Any]:
    """JSON record of the run for sweep.json."""
    d = dataclasses.asdict(self)
    d["command"] = shlex.join(self.argv)
    d["log"] = self.log
    return d


# ----------------------------------------------------------------------------- specification


def parse_grid(text: str) -> tuple[str, list[str]]:
  """`'a.b=1,2'` -> `('a.b', ['1', '2'])`."""
  field, sep, values = text.partition("=")
  field = field.strip()
  if not sep or not re.fullmatch(_FIELD, field):
    raise SweepError(
      f"--grid={text!r}: expected FIELD=V1,V2,... (e.g. objective.clip_high=0.2,0.28)"
    )
  vals = [v.strip() for v in values.split(",")]
  if not values.strip() or any(v == "" for v in vals):
    raise SweepError(f"--grid={text!r}: empty value")
  if len(set(vals)) != len(vals):
    raise SweepError(f"--grid={text!r}: repeated value")
  return field, vals


def parse_set(text: str) -> list[tuple[str, str]]:
  """`'a.b=1,c=x'` -> `[('a.b', '1'), ('c', 'x')]`; a comma not followed by `FIELD=` stays in the
  value (so `mesh.rules=(("mlp","model"),)` is one assignment)."""
  out = []
  for part in re.split(rf",(?={_FIELD}=)", text):
    field, sep, value = part.partition("=")
    field = field.strip()
    if not sep or not re.fullmatch(_FIELD, field):
      raise SweepError(f"--set={text!r}: expected FIELD=VALUE[,FIELD=VALUE...]")
    out.append((field, value.strip()))
  return out


def expand(grid: Sequence[tuple[str, Sequence[str]]]) -> list[dict[str, str]]:
  """Cartesian product of the grid, the last field varying fastest."""
  fields = [f for f, _ in grid]
  return [dict(zip(fields, combo)) for combo in itertools.product(*(v for _, v in grid))]


def trainer_argv(
  config: str, workdir: str, overrides: dict[str, str], swept: Sequence[str] = ()
) -> list[str]:
  """The trainer command of one run; `swept` fields become its HParams columns."""
  return [
    sys.executable,
    *TRAINER,
    f"--config={config}",
    f"--workdir={workdir}",
    *(f"--config.{k}={v}" for k, v in overrides.items()),
    *([f"--hparams={','.join(swept)}"] if swept else []),
  ]


def check_fields(config: str, assignments: Sequence[tuple[str, str, str]]) -> None:
  """Raises ConfigError, listing the allowed fields, if the config lacks a field of
  `assignments` ((field, value, the sweep flag that gave it), the flag named in the error)."""
  for field, value, flag in assignments:
    as_trainer = f"--config.{field}={value}"
    try:
      command_line.check_overrides(["sweep", f"--config={config}", as_trainer])
    except ConfigError as e:
      raise ConfigError(str(e).replace(f"'{as_trainer}'", f"'{flag}'")) from None


def resolve_config(config: str, overrides: dict[str, str]):
  """The config a run will see, parsed exactly as the trainer parses its flags."""
  argv = ["sweep", f"--config={config}", *(f"--config.{k}={v}" for k, v in overrides.items())]
  try:
    return launch.parse_config(argv)
  except Exception as e:
    raise SweepError(f"bad value: {e}") from None


def check_bounds_bind(fields: Sequence[str], settings) -> None:
  """A SweepError where the grid varies (`fields`) a ratio's bound (`_RATIO_BOUNDS`) that cannot
  bind in a run of `settings`: one optimiser update per rollout, so its values train alike."""
  inert = [f for f in fields if f.partition(".")[::2] in (("objective", b) for b in _RATIO_BOUNDS)]
  if inert and settings.learner.skips_old_pass(settings.model.arch.moe_num_experts > 0):
    raise SweepError(
      f"--grid over {', '.join(inert)}: each run makes one optimiser update per rollout "
      "(rl.num_epochs * rl.num_minibatches = 1), so every ratio is 1 and no clip binds: the "
      "values would train alike; set rl.num_minibatches (or rl.num_epochs) above 1"
    )


def absolute_config(config: str) -> str:
  """`path[:arg]` with the path made absolute, so a run's command works from any directory."""
  path, sep, arg = config.partition(":")
  return os.path.abspath(path) + sep + arg


def check_root(root: str) -> None:
  """A SweepError unless `root` is a writable local directory, tested as the trainer tests its
  --workdir (`launch.workdir_problem`), or can be made (`_unmakeable`: nothing is left behind).
  ROOT/sweep.json, when there, must be a file (it is rewritten as the sweep goes)."""
  if not root:  # os.path.abspath('') is the current directory
    raise SweepError("--root is empty; give the sweep's directory (one folder per run)")
  if paths.scheme(root) is not None:  # the logs, records and checkpoint checks are local calls
    raise SweepError(
      f"--root={root}: a sweep's root is a local directory (it holds each run's log and "
      "sweep.json); give a local path (a single run's --workdir may be remote)"
    )
  root = os.path.abspath(root)
  if os.path.exists(root) and not os.path.isdir(root):
    raise SweepError(f"--root={root} is a file; give a directory (it holds a folder per run)")
  problem = launch.workdir_problem(root) if os.path.lexists(root) else _unmakeable(root)
  if problem:
    raise SweepError(f"--root={root}: {problem}")
  record = os.path.join(root, "sweep.json")
  if os.path.lexists(record) and not os.path.isfile(record):
    raise SweepError(
      f"{record} is not a file (the sweep's record); move it aside or give another --root"
    )
  earlier_runs(root, ())  # an unreadable record is refused before any run starts


def earlier_runs(root: str, names: Sequence[str]) -> list[dict[str, Any]]:
  """The runs that `root/sweep.json` records (its `runs`, then its `earlier_runs`) and `names`
  does not hold: a sweep run again with another grid keeps them in its record, as their
  workdirs are kept. A SweepError when the file is there but is not a sweep's record."""
  path = os.path.join(root, "sweep.json")
  try:
    with open(path) as f:
      record = json.load(f)
  except FileNotFoundError:
    return []
  except (OSError, ValueError) as e:  # not UTF-8 or not JSON: not the sweep's record
    raise SweepError(
      f"{path}: cannot be read as the sweep's record ({getattr(e, 'strerror', None) or e}); "
      "move it aside or give another --root"
    ) from None
  parts = [record.get(k, []) for k in ("runs", "earlier_runs")] if isinstance(record, dict) else []
  entries = parts[0] + parts[1] if parts and all(isinstance(p, list) for p in parts) else None
  if not isinstance(entries, list) or not all(
    isinstance(r, dict) and isinstance(r.get("name"), str) for r in entries
  ):
    raise SweepError(
      f"{path}: not a sweep's record (a JSON object whose runs are objects with a name); "
      "move it aside or give another --root"
    )
  kept, seen = [], set(names)
  for entry in entries:
    if entry["name"] not in seen:
      seen.add(entry["name"])
      kept.append(entry)
  return kept


def _unmakeable(root: str) -> str | None:
  """Why the missing folder `root` could not be made, tested by making and removing a folder
  of a unique name in its nearest existing parent (a --distributed sweep's processes check one
  new root at once: none makes or removes `root` itself under another's test); None when it
  could."""
  parent = os.path.dirname(root)
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    return "a file stands on its path; give a directory path whose parents are directories"
  try:
    longest = os.pathconf(parent, "PC_NAME_MAX")
  except (OSError, ValueError):  # not said by this system
    longest = 255
  for name in os.path.relpath(root, parent).split(os.sep):  # the folders it would make
    if len(os.fsencode(name)) > longest:
      return (
        f"cannot create it: the folder name {name[:24]}... has {len(os.fsencode(name))} bytes, "
        f"over the {longest} a name may have there; give a shorter name"
      )
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".root_test.", dir=parent))
  except OSError as e:  # EROFS, EACCES, ENOSPC, a /proc parent...
    return f"cannot create it: {e.strerror or e}; give a writable directory"
  return None


def plan(
  config: str,
  root: str,
  grid_flags: Sequence[str],
  set_flags: Sequence[str],
  seeds: str | None,
) -> list[Run]:
  """Validates the specification and returns the runs; raises SweepError/ConfigError."""
  grid = [parse_grid(g) for g in grid_flags]
  fixed = [kv for s in set_flags for kv in parse_set(s)]
  if seeds is not None:  # --seeds= (empty) is refused, not ignored
    try:
      grid.append(parse_grid(f"seed={seeds}"))
    except SweepError as e:
      raise SweepError(str(e).replace(f"--grid='seed={seeds}'", f"--seeds={seeds!r}")) from None
    if bad := [v for v in grid[-1][1] if not v.strip().lstrip("+-").isdigit()]:
      raise SweepError(f"--seeds={seeds!r}: {bad[0]!r} is not a whole number; give seeds as 0,1,2")
  fields = [f for f, _ in grid] + [f for f, _ in fixed]
  if paced := [f for f, _ in grid if f in tagged(INVOCATION)]:
    raise SweepError(
      f"--grid={paced[0]}=...: {paced[0]} only ends or paces an invocation, and the runs would "
      f"learn alike; give it with --set (one value for every run)"
    )
  dupes = sorted({f for f in fields if fields.count(f) > 1})
  if dupes:
    raise SweepError(f"fields given more than once in --grid/--set/--seeds: {dupes}")
  config = absolute_config(config)
  given = [(f, ",".join(v), f"--grid={f}={','.join(v)}") for f, v in grid]
  check_fields(config, given + [(f, v, f"--set={f}={v}") for f, v in fixed])
  check_root(root)
  root = os.path.abspath(root)
  runs, names, same, idle = [], {}, {}, {}
  varied = [f for f, values in grid if len(values) > 1]
  for params in expand(grid):
    name = folder_name(params)
    if name in names:
      raise SweepError(f"grid points {names[name]} and {params} share the workdir name {name!r}")
    names[name] = params
    overrides, cfg, settings, left_out = _acting(config, {**dict(fixed), **params}, name, idle)
    check_bounds_bind(varied, settings)
    typed = settings.to_json()
    if typed in same:  # e.g. 0.7 and 0.70, or values one of them never reads: the same run
      first, first_left_out = same[typed]
      why = first_left_out or left_out  # the default value reads as no change: the other's
      raise SweepError(
        f"grid points {first} and {name} are the same run ("
        + (why if why else "their values are equal once parsed")
        + "): give each value once, and only values the run reads"
      )
    same[typed] = (name, left_out)
    workdir = os.path.join(root, name)
    runs.append(
      Run(
        name=name,
        workdir=workdir,
        params=params,
        overrides=overrides,
        argv=trainer_argv(config, workdir, overrides, list(params)),
        final_step=int(cfg.train.num_steps),
      )
    )
  _check_idle(idle, len(runs))
  _check_respelled(config, root, same)
  return runs


def _recorded_runs(root: str) -> dict[str, tuple[str | None, dict[str, str]]]:
  """{name: (config, overrides)} of the runs already in `root`: those its sweep.json records
  (`runs` and `earlier_runs`) and every folder's run.json. A record that cannot be read is
  left out (the run of that name, if this grid has one, refuses it when it starts)."""
  found: dict[str, tuple[str | None, dict[str, str]]] = {}
  for entry in earlier_runs(root, ()):
    argv, overrides = entry.get("argv"), entry.get("overrides")
    if isinstance(argv, list) and isinstance(overrides, dict):
      config = next((a[9:] for a in argv if isinstance(a, str) and a.startswith("--config=")), None)
      found[entry["name"]] = (config, overrides)
  with contextlib.suppress(OSError):
    for name in sorted(os.listdir(root)):
      try:
        with open(os.path.join(root, name, "run.json")) as f:
          rec = json.load(f)
      except (OSError, ValueError):
        continue
      if isinstance(rec, dict) and isinstance(rec.get("overrides"), dict):
        found[name] = (rec.get("config"), rec["overrides"])
  return found


def _check_respelled(config: str, root: str, same: dict) -> None:
  """A SweepError where a grid point is a run already in `root` under another folder name,
  its values spelled otherwise (`1` for `1.0`, `0.70` for `0.7`): its settings, once parsed,
  are those of the earlier run. The same spellings in another order are left to the pack's
  own message (its fields in another order). Trained again, it would be a second run of one arm. `same` maps
  each point's typed settings to (its name, ...), as `plan` built it."""
  names = {name for name, _ in same.values()}
  for name, (was_config, overrides) in _recorded_runs(root).items():
    if name in names or was_config != config:
      continue  # the point of that name resumes it; a run of another config is another run
    try:
      _, _, settings, _ = _acting(config, {k: str(v) for k, v in overrides.items()}, name, {})
    except SweepError:
      continue  # settings this config no longer takes: not a run of this grid
    point = same.get(settings.to_json())
    if point is not None and sorted(point[0].split(",")) != sorted(name.split(",")):
      raise SweepError(
        f"grid point {point[0]} is the run {os.path.join(root, name)} already in --root "
        "(their values are equal once parsed): spell its values as that folder's name does, "
        "to resume or skip it, or give another --root"
      )


def _acting(config: str, overrides: dict[str, str], name: str, idle: dict):
  """(overrides, config, typed settings, what it left out) of grid point `name`, its values in
  range, without the fields the point would not read (`acting.ignored`: a KL estimator at
  kl.beta=0, another objective's hyperparameter): left out, so two points that differ only
  there are one run. `idle` collects {field: [why, at each point that leaves it out]}."""
  try:
    settings = parse(cfg := resolve_config(config, overrides))
    left_out = {f: acting.ignored(settings, f) for f in overrides}
    left_out = {f: why for f, why in left_out.items() if why}
    if left_out:
      overrides = {k: v for k, v in overrides.items() if k not in left_out}
      settings = parse(cfg := resolve_config(config, overrides))
  except ConfigError as e:
    raise SweepError(f"grid point {name}: {e}") from None
  for field, why in left_out.items():
    idle.setdefault(field, []).append(why)
  return overrides, cfg, settings, "; ".join(left_out.values())


def _check_idle(idle: dict[str, list[str]], points: int) -> None:
  """A field no point reads is refused; one some points leave out is said once."""
  for field, whys in idle.items():
    if len(whys) == points:
      raise SweepError(f"{whys[0]}, in every run of the sweep; drop it or set what it acts with")
    print(
      f"note: {field} is left out of {len(whys)} of the {points} runs ({whys[0]})", file=sys.stderr
    )


# ----------------------------------------------------------------------------- workdir state


def committed_steps(workdir: str) -> list[int]:
  """Steps of the committed checkpoints in `workdir`, ascending (read from the file system)."""
  d = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(d):
    return []
  return sorted(
    int(n) for n in os.listdir(d) if n.isdigit() and os.path.exists(os.path.join(d, n, COMMIT_FILE))
  )


def is_complete(run: Run) -> bool:
  """Whether the run's workdir holds a checkpoint at (or past) its final step."""
  steps = committed_steps(run.workdir)
  return bool(steps) and steps[-1] >= run.final_step


def _record_path(run: Run) -> str:
  return os.path.join(run.workdir, "run.json")


def changed_overrides(run: Run) -> dict[str, tuple[str | None, str | None]]:
  """Settings that differ from those recorded when the workdir last ran: name -> (was, now)."""
  if os.path.lexists(run.workdir) and not os.path.isdir(run.workdir):
    raise SweepError(
      f"{run.workdir} is a file, not the run's folder; move it aside or give another --root"
    )
  try:
    with open(_record_path(run)) as f:
      rec = json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:  # a directory there, or no JSON: not the sweep's record
    raise SweepError(
      f"{_record_path(run)}: cannot be read as the run's record ({getattr(e, 'strerror', None) or e}); "
      "move it aside or give another --root"
    ) from None
  if not isinstance(rec, dict) or not isinstance(rec.get("overrides", {}), dict):
    raise SweepError(
      f"{_record_path(run)}: not a run record (a JSON object with an object of overrides); "
      "move it aside"
    )
  diffs = {}
  if rec.get("config") != _config_of(run):
    diffs["--config"] = (rec.get("config"), _config_of(run))
  was, now = rec.get("overrides", {}), run.overrides
  resumable = tagged(INVOCATION)  # they end or pace an invocation; results stay the same
  for k in sorted(set(was) | set(now)):
    if was.get(k) != now.get(k) and k not in resumable:
      diffs[k] = (was.get(k), now.get(k))
  return diffs


def _config_of(run: Run) -> str:
  return next(a.split("=", 1)[1] for a in run.argv if a.startswith("--config="))


def _write_record(run: Run) -> None:
  rec = {"config": _config_of(run), "overrides": run.overrides, "command": shlex.join(run.argv)}
  _write_json(_record_path(run), rec)


def _write_json(path: str, obj: Any) -> None:
  """Writes `obj` to `path` whole or not at all; a SweepError (one line) when it cannot."""
  tmp = f"{path}.tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(obj, f, indent=2)
      f.write("\n")
    os.replace(tmp, path)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    fix = "free space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "move it aside"
    raise SweepError(
      f"{path} could not be written ({e.strerror}); the runs' checkpoints are kept: {fix} "
      "and rerun the same command"
    ) from None


def tail(path: str, lines: int = 20) -> str:
  """Last `lines` lines of a text file ('' if it does not exist)."""
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(f.tell() - 64 * 1024, 0))
      text = f.read().decode(errors="replace")
  except FileNotFoundError:
    return ""
  return "\n".join(text.splitlines()[-lines:])


# ----------------------------------------------------------------------------- execution


class Sweep:
  """Launches the runs, at most `parallel` at a time, keeping `root/sweep.json` up to date."""

  def __init__(
    self,
    runs: list[Run],
    root: str,
    spec: dict[str, Any],
    parallel: int = 1,
    debug: bool = False,
    progress_s: float = PROGRESS_S,
  ):
    """Takes the planned runs; `spec` is the sweep's description stored in sweep.json; with
    `debug` each run's trainer gets `--debug`; every `progress_s` seconds a running run's
    newest progress line is shown."""
    self.runs, self.root, self.spec, self.parallel = runs, os.path.abspath(root), spec, parallel
    self.debug, self.progress_s = debug, progress_s
    self._shown: dict[str, tuple[float, str]] = {}  # run -> (when, the progress line shown)
    self.env = dict(os.environ)
    if parallel > 1 and "XLA_PYTHON_CLIENT_PREALLOCATE" not in self.env:
      # Concurrent runs on one accelerator must not each reserve most of its memory.
      self.env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
      self.spec = {**spec, "env": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}}
    self._running: list[tuple[Run, subprocess.Popen, Any, float]] = []
    self.earlier = earlier_runs(self.root, [r.name for r in runs])

  @property
  def path(self) -> str:
    """Path of sweep.json."""
    return os.path.join(self.root, "sweep.json")

  def save(self) -> None:
    """Writes sweep.json."""
    statuses = [r.status for r in self.runs]
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    record = {
      **self.spec,
      "updated": time.strftime("%Y-%m-%d %H:%M:%S"),
      "status": counts,
      "runs": [r.to_json() for r in self.runs],
    }
    if self.earlier:  # runs of an earlier grid: their workdirs are kept, and so are their records
      record["earlier_runs"] = self.earlier
    _write_json(self.path, record)

  def _say(self, i: int, run: Run, what: str) -> None:
    print(f"[{i + 1}/{len(self.runs)}] {what} {run.name}", flush=True)

  def _launch(self, i: int, run: Run) -> None:
    os.makedirs(run.workdir, exist_ok=True)
    _write_record(run)
    steps = committed_steps(run.workdir)
    run.start_step = steps[-1] if steps else None
    argv = [*run.argv, "--debug"] if self.debug else run.argv
    log = open(run.log, "a")  # closed in _poll/stop when the run ends
    log.write(f"\n### {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(
      argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
    )
    run.status = "running"
    self._running.append((run, proc, log, time.time()))
    where = f"resuming at step {run.start_step}" if steps else "starting"
    self._say(i, run, f"{where}:")
    self.save()

  def _finish(self, run: Run, returncode: int, elapsed: float) -> None:
    run.returncode, run.elapsed_s = returncode, round(elapsed, 1)
    if returncode != 0:
      run.status = "failed"
    else:
      run.status = "done" if is_complete(run) else "incomplete"
    self._read_metrics(run)
    i = self.runs.index(run)
    if run.status == "failed":
      self._say(i, run, f"FAILED (exit {returncode}, {elapsed:.0f}s):")
      lines = tail(run.log)
      print(f"  last lines of {run.log}:", file=sys.stderr)
      print("\n".join(f"    {line}" for line in lines.splitlines()), file=sys.stderr, flush=True)
    elif run.status == "incomplete":
      steps = committed_steps(run.workdir)
      at = steps[-1] if steps else None
      self._say(i, run, f"stopped at step {at}/{run.final_step} ({elapsed:.0f}s; rerun to go on):")
    else:
      self._say(i, run, f"done ({elapsed:.0f}s):")
    self.save()

  def _read_metrics(self, run: Run) -> None:
    read_metrics(run)

  def _poll(self) -> None:
    for entry in list(self._running):
      run, proc, log, t0 = entry
      if proc.poll() is not None:
        log.close()
        self._running.remove(entry)
        self._finish(run, proc.returncode, time.time() - t0)
      else:
        self._progress(run, t0)

  def _progress(self, run: Run, t0: float) -> None:
    """Every `progress_s` seconds: the run's newest progress (or start-up) line from its log,
    when it changed; a sweep is not silent while a run starts and trains. Only this launch's
    lines count (those after the last `### <date> <command>` header `_launch` wrote): a resumed
    run's log still ends with the earlier launch's last step until the new one logs."""
    when, said = self._shown.get(run.name, (t0, ""))
    if time.time() - when < self.progress_s:
      return
    lines = tail(run.log, 40).splitlines()
    header = max((i for i, x in enumerate(lines) if x.startswith("### ")), default=-1)
    lines = [_PREFIX.sub("", x) for x in lines[header + 1 :] if x.strip()]
    news = [x for x in lines if _PROGRESS.match(x)] or [x for x in lines if not x.startswith("#")]
    line = news[-1] if news else ""
    self._shown[run.name] = (time.time(), line or said)
    if line and line != said:
      self._say(self.runs.index(run), run, f"{line[:100]} -")

  def stop(self, signum: int = signal.SIGTERM) -> None:
    """Stops the running runs after the sweep got `signum` and records it. After SIGINT the
    runs are given `STOP_GRACE_S` to end on their own (a terminal's Ctrl-C reaches them too,
    and a SIGTERM then would cut the save they finish); those still running, or all after
    SIGTERM, get SIGTERM: each saves the step it has just finished. Every committed
    checkpoint stays."""
    if signum == signal.SIGINT:
      self._wait(time.time() + STOP_GRACE_S)
    for _, proc, _, _ in self._running:
      if proc.poll() is None:
        proc.terminate()
    deadline = time.time() + 60
    for run, proc, log, t0 in self._running:
      try:
        proc.wait(timeout=max(deadline - time.time(), 1))
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
      log.close()
      run.status, run.returncode = "interrupted", proc.returncode
      run.elapsed_s = round(time.time() - t0, 1)
    self._running = []
    self.save()

  def _wait(self, deadline: float) -> None:
    """Returns when every running run has ended, or at `deadline`."""
    while time.time() < deadline and any(p.poll() is None for _, p, _, _ in self._running):
      time.sleep(0.1)

  def execute(self) -> None:
    """Runs (or skips) every run; returns when all have ended."""
    os.makedirs(self.root, exist_ok=True)
    todo = []
    for i, run in enumerate(self.runs):
      if is_complete(run):
        run.status = "skipped"
        self._read_metrics(run)
        self._say(i, run, f"skip (checkpoint at final step {run.final_step}):")
      else:
        todo.append(i)
    self.save()
    for i in todo:
      while len(self._running) >= self.parallel:
        time.sleep(0.2)
        self._poll()
      self._launch(i, self.runs[i])
    while self._running:
      time.sleep(0.2)
      self._poll()


def read_metrics(run: Run) -> None:
  """Fills `run.last_step` and `run.metrics` (the last value of each summary tag)."""
  try:
    scalars = compare.read_run(run.workdir)
  except Exception as e:  # a run that failed early may have no readable events
    print(f"  cannot read scalars of {run.name}: {e}", file=sys.stderr)
    return
  run.last_step = compare.last_step(scalars)
  for tag in compare.expand_tags(SUMMARY_TAGS, sorted(scalars)):
    if scalars.get(tag):
      run.metrics[tag] = scalars[tag][-1][1]


# ----------------------------------------------------------------------------- packs


def _pack_configs(config: str, runs: Sequence[Run]):
  return [resolve_config(config, r.overrides) for r in runs]


def dry_run_packed(config: str, runs: Sequence[Run]) -> int:
  """Checks that the grid packs and plans the packed step's and its evaluation's memory
  (compile only)."""
  from jaxrl_llm import plan as plan_lib
  from jaxrl_llm.run.pack import check_packable

  configs = [parse(c) for c in _pack_configs(config, runs)]
  varied = check_packable(configs)
  print(f"a pack of {len(runs)} runs varying {', '.join(varied) or 'nothing'}:")
  for run in runs:
    print(f"  {run.name}")
  traced = [f for f in varied if f != "seed"]
  memory = plan_lib.plan(configs[0], runs=len(runs), varied=traced, evaluation=True)
  return plan_lib.print_dry_run(memory)


def leave_job(code: int, line: str) -> None:
  """In a multi-process job: tells the peers why this process stops, and stops it at once
  (`launch.leave_job`); on one process, nothing."""
  if launch.in_a_job():
    launch.leave_job(code, line)


def run_packed(
  config: str, runs: Sequence[Run], root: str, spec: dict[str, Any], debug: bool = False
) -> int:
  """Trains the grid as one pack in `root` (resuming it), records sweep.json (process 0 of a
  multi-process job); exit status (143 after SIGTERM, 130 after Ctrl-C, as the trainer's).
  The terminal is set up as the trainer's (`terminal.setup`), every log line in `root`'s log
  file (`ROOT/log.txt`). A SIGTERM or Ctrl-C while XLA compiles stops it at once, as the
  trainer's (`sigterm.compiling`)."""
  from jaxrl_llm import sigterm

  launch.choose_backend(debug)  # as the trainer's command line does
  terminal.setup(debug, log_file=terminal.log_path(root, launch.process_index()))
  earlier = earlier_runs(root, [r.name for r in runs])
  new = []  # the runs whose record this command writes first
  if launch.process_index() == 0:  # each run's settings, checked when the pack is run again
    for run in runs:
      if not os.path.exists(_record_path(run)):
        new.append(run)
      os.makedirs(run.workdir, exist_ok=True)
      _write_record(run)
  t0 = time.time()

  def stop_while_compiling(signum: int, what: str) -> None:  # on `sigterm`'s watcher thread
    if signum == signal.SIGINT:
      _stopped_by_ctrl_c(root)
    line = (
      f"stopped by SIGTERM while compiling {what}: the pack's checkpoints in "
      f"{os.path.join(root, 'checkpoints')} are kept; rerun the same command to resume"
    )
    print(line, file=sys.stderr, flush=True)
    _record_pack(runs, root, spec, earlier, t0, "interrupted", 143)
    launch.leave_job(143, line)

  with sigterm.leaving(stop_while_compiling):
    status, code = _train_packed(_pack_configs(config, runs), runs, root, new)
  return _record_pack(runs, root, spec, earlier, t0, status, code)


def _record_pack(
  runs: Sequence[Run], root: str, spec: dict, earlier: list, t0: float, status: str, code: int
) -> int:
  """Writes sweep.json of a pack that ended with `status` and exit status `code` (process 0
  of a job only); returns the command's exit status."""
  import jax

  if jax.process_index() != 0:  # the runs' events, and so the record, are process 0's
    return code
  from jaxrl_llm.run import record as run_record

  stopped = {r.name for r in runs if run_record.read_stopped(os.path.join(root, r.name))}
  for run in runs:  # a run its guards stopped failed; the pack's other runs went on
    run.status = "failed" if run.name in stopped else status
    run.elapsed_s = round(time.time() - t0, 1)
    read_metrics(run)
  record = {**spec, "packed": True, "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
  pack_log = os.path.join(root, "log.txt")  # a pack's runs have no run.log: every line is here
  record["runs"] = [{**r.to_json(), "log": pack_log} for r in runs]
  if earlier:
    record["earlier_runs"] = earlier
  try:
    _write_json(os.path.join(root, "sweep.json"), record)
  except SweepError:
    if code == 0:
      raise
    return code  # the pack's own error line (a full disk) has said it: not a second one
  if stopped and code == 0:
    print(f"error: {len(stopped)} run(s) stopped: {', '.join(sorted(stopped))}", file=sys.stderr)
    return 1
  return code


def _forget(runs: Sequence[Run]) -> None:
  """Removes the records of `runs` that a refused pack wrote before it trained (and their
  folders if nothing else is in them): a corrected command is not then refused for settings
  no run trained with."""
  for run in runs:
    with contextlib.suppress(OSError):  # a folder already gone, or one it cannot list
      if os.listdir(run.workdir) == ["run.json"]:
        os.remove(_record_path(run))
        os.rmdir(run.workdir)


def _train_packed(
  configs: list, runs: Sequence[Run], root: str, new: Sequence[Run] = ()
) -> tuple[str, int]:
  """`train_pack` of the grid in `root`: (the runs' status, exit status). A SIGTERM (every
  process stopped after the same step, saved), a Ctrl-C or a known failure prints its one line;
  in a multi-process job the last two also tell the peers and stop this process at once. A
  pack refused before it trains (a ConfigError, or a known failure such as a checkpoint it
  cannot restore) first removes the records of `new` (`_forget`: folders that hold only one)."""
  from jaxrl_llm import backend
  from jaxrl_llm.run import Preempted
  from jaxrl_llm.run.packed import train_pack

  names, swept = [r.name for r in runs], list(runs[0].params)
  try:
    parsed = [parse(c) for c in configs]
    backend.use_compilation_cache(parsed[0].train.compilation_cache)  # as the trainer's
    train_pack(parsed, root, names=names, hparam_fields=swept)
    steps = committed_steps(root)
    return ("done" if steps and steps[-1] >= runs[0].final_step else "incomplete"), 0
  except ConfigError as e:  # `main` prints its line; in a job, this process prints it and stops
    _forget(new)
    if launch.in_a_job():
      print(f"error: {e}", file=sys.stderr, flush=True)
      leave_job(2, f"error: {e}")
    raise
  except Preempted as e:  # every process stopped after the same step, which is saved
    print(e, file=sys.stderr, flush=True)
    return "interrupted", 143
  except KeyboardInterrupt:
    return _stopped_by_ctrl_c(root)
  except Exception as e:
    if launch.interrupted(e):  # Ctrl-C cut a save that then failed
      return _stopped_by_ctrl_c(root)
    line = launch.explain(e)
    if line is None:
      leave_job(1, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
      raise
    _forget(new)  # refused at restore, say: the folders that hold only a record go
    print(line, file=sys.stderr, flush=True)
    leave_job(2, line)
    return "failed", 1


def _stopped_by_ctrl_c(root: str) -> tuple[str, int]:
  line = (
    "stopped by SIGINT (Ctrl-C): the pack's checkpoints committed before it are intact in "
    f"{os.path.join(root, 'checkpoints')}; rerun the same command to resume"
  )
  print(line, file=sys.stderr, flush=True)
  leave_job(130, line)  # the other processes do not know: they stop with this line
  return "interrupted", 130


# ----------------------------------------------------------------------------- reporting


def summary_table(runs: Sequence[Run]) -> str:
  """Table of the runs: grid values, status, step, final metrics and time."""
  fields = list(dict.fromkeys(f for r in runs for f in r.params))
  tags = list(dict.fromkeys(t for r in runs for t in r.metrics))
  header = [*fields, "status", "step", *tags, "time_s"]
  rows = [
    [
      *(r.params.get(f) for f in fields),
      r.status if r.returncode in (None, 0) else f"{r.status} ({r.returncode})",
      r.last_step,
      *(r.metrics.get(t) for t in tags),
      r.elapsed_s,
    ]
    for r in runs
  ]
  return compare.format_table(header, rows)


def _process_index() -> int:
  import jax

  return jax.process_index()


class Interrupted(KeyboardInterrupt):
  """The sweep got SIGINT or SIGTERM (`signum`)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def _raise_interrupt(signum, frame):
  raise Interrupted(signum)


def run_unpacked(
  runs: list[Run],
  root: str,
  spec: dict[str, Any],
  parallel: int,
  debug: bool = False,
  progress_s: float = PROGRESS_S,
) -> int:
  """Trains the grid one process per run, `parallel` at a time; exit status (1 if a run failed;
  128 + the signal after SIGINT or SIGTERM, the runs stopped with their checkpoints kept).
  This process's own log lines (e.g. reading the runs' events) go as `terminal.setup` says,
  to `ROOT/log.txt`; each run's output to its run.log."""
  terminal.setup(debug, log_file=terminal.log_path(os.path.abspath(root)))
  sweep = Sweep(runs, root, spec, parallel=parallel, debug=debug, progress_s=progress_s)
  ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a background job: kept so
  names = (signal.SIGTERM,) if ignored else (signal.SIGINT, signal.SIGTERM)
  previous = {n: signal.signal(n, _raise_interrupt) for n in names}
  try:
    sweep.execute()
  except SweepError as e:  # a record that cannot be written: the runs stop, checkpoints kept
    print(f"error: {e}", file=sys.stderr, flush=True)
    with contextlib.suppress(SweepError):
      sweep.stop()
    return 2
  except KeyboardInterrupt as e:
    signum = getattr(e, "signum", signal.SIGINT)
    for n in previous:  # a second signal must not cut the stopping short
      signal.signal(n, signal.SIG_IGN)
    print("interrupted; stopping runs (rerun the same command to resume)", file=sys.stderr)
    sweep.stop(signum)
    return 128 + signum
  finally:
    for n, handler in previous.items():
      signal.signal(n, handler)

  print()
  print(summary_table(runs))
  failed = [r for r in runs if r.status == "failed"]
  print(f"\n{sweep.path}; compare: python tools/compare.py --root={shlex.quote(sweep.root)}")
  if failed:
    print(f"{len(failed)} of {len(runs)} runs failed:", file=sys.stderr)
    for r in failed:
      print(f"  {r.name}: exit {r.returncode}, log {r.log}", file=sys.stderr)
    return 1
  return 0


def _parser() -> argparse.ArgumentParser:
  """The command line's flags."""
  p = terminal.ArgParser(
    raise_as=lambda m: SweepError(f"{m} (see --help)"),
    description=__doc__,
    formatter_class=argparse.RawTextHelpFormatter,
  )
  p.add_argument("--config", required=True, help="Experiment config file (path[:arg]).")
  p.add_argument("--root", required=True, help="Directory of the sweep; one workdir per run.")
  p.add_argument("--grid", action="append", default=[], help="FIELD=V1,V2,... swept (repeatable).")
  p.add_argument(
    "--set", action="append", default=[], help="FIELD=VALUE fixed for all runs (repeatable)."
  )
  p.add_argument("--seeds", default=None, help="Comma-separated seeds, e.g. 0,1 (a grid axis).")
  p.add_argument("--parallel", type=int, default=1, help="Runs at once (default 1).")
  p.add_argument(
    "--progress_s",
    type=float,
    default=None,
    help=f"Show each running run's newest progress line this often (default {PROGRESS_S:g} s).",
  )
  p.add_argument(
    "--packed",
    action="store_true",
    help="Train the grid as one pack: one program, the runs vmapped (every varied field "
    "packable; see jaxrl_llm/run/pack.py).",
  )
  p.add_argument(
    "--distributed",
    action="store_true",
    help="With --packed: join a multi-process job first (start the same command on every "
    "host, as the trainer's --distributed); each run's rows spread over the processes.",
  )
  p.add_argument(
    "--join_timeout_s",
    type=float,
    default=None,
    help=f"With --distributed: give up joining after (default {JOIN_TIMEOUT_S:g} s).",
  )
  p.add_argument("--dry_run", action="store_true", help="Print the runs and commands; run nothing.")
  p.add_argument(
    "--debug",
    action="store_true",
    help="Show the libraries' log lines (always in ROOT/log.txt) with absl's prefix and full "
    "tracebacks; each run's trainer gets --debug too.",
  )
  p.add_argument(
    "--allow_changed",
    action="store_true",
    help="Resume workdirs even if their recorded overrides differ from this sweep's.",
  )
  return p


def _check_kind(root: str, runs: Sequence[Run], packed: bool) -> None:
  """SweepError when `root` holds checkpoints of the other kind of sweep: a pack keeps one set
  in ROOT/checkpoints, separate runs one each in their workdirs; the other kind would not see
  them and would train every run again from step 0. A ROOT whose checkpoints are a single
  run's (their meta names no pack: ROOT is that run's --workdir) is refused for both kinds."""
  if "pack" not in (saved_meta(root) or {"pack": None}):
    raise SweepError(
      f"--root={root} is a single run's workdir (its checkpoints, "
      f"{os.path.join(root, 'checkpoints')}, are not a pack's): a sweep would write its runs "
      "into it; give another --root"
    )
  if packed and (done := next((r for r in runs if committed_steps(r.workdir)), None)):
    raise SweepError(
      f"--root={root} holds runs trained one by one ({done.workdir}/checkpoints): a pack "
      "would train them again from step 0; drop --packed to resume them, or give another --root"
    )
  if not packed and committed_steps(root):
    raise SweepError(
      f"--root={root} holds a pack's checkpoints ({os.path.join(root, 'checkpoints')}): runs "
      "one by one would start again from step 0; pass --packed to resume it, or give another "
      "--root"
    )


def saved_meta(root: str) -> dict[str, Any] | None:
  """The meta of ROOT's newest committed checkpoint (as orbax wrote it), or None when there is
  none or it cannot be read as a JSON object."""
  steps = committed_steps(root)
  meta = os.path.join(root, "checkpoints", str(steps[-1]), "meta", "metadata") if steps else ""
  try:
    with open(meta) as f:
      found = json.load(f)
  except (OSError, ValueError):
    return None  # the trainer's restore then says what is wrong with the checkpoint
  return found if isinstance(found, dict) else None


def saved_pack_names(root: str) -> list[str] | None:
  """The run names of the pack saved in ROOT's newest committed checkpoint (its meta's
  `pack.names`), or None when there is none or it cannot be read."""
  try:
    names = (saved_meta(root) or {})["pack"]["names"]
  except (KeyError, TypeError):
    return None
  return names if isinstance(names, list) else None


def _in_saved_order(root: str, runs: list[Run]) -> list[Run]:
  """A packed grid resumed: `runs` in the order of the pack saved in `root` (the same runs
  given in another order resume it); a SweepError when the saved pack holds other runs."""
  saved = saved_pack_names(root)
  by_name = {r.name: r for r in runs}
  if saved is None or saved == list(by_name):
    return runs
  if sorted(saved) == sorted(by_name):
    return [by_name[name] for name in saved]
  step, ran = committed_steps(root)[-1], set(saved)
  if sorted(map(_points, saved)) == sorted(map(_points, by_name)):
    raise SweepError(
      f"--root={root} holds a pack of these {len(saved)} runs at step {step}, with its fields "
      f"in another order (a run's folder is named by them: {saved[0]!r}): give the --grid "
      "flags in the order it started with to resume it"
    )
  added = [n for n in by_name if n not in ran]
  missing = [n for n in saved if n not in by_name]
  raise SweepError(
    f"--root={root} holds a pack of {len(saved)} runs at step {step}, and this grid "
    + (f"adds {added}" if added else "")
    + (" and " if added and missing else "")
    + (f"leaves out {missing}" if missing else "")
    + ": a pack's runs are fixed when it starts; give its grid again to resume it, or "
    "another --root for these runs"
  )


def _points(name: str) -> list[str]:
  """A run folder's `field=value` parts in sorted order: one grid point whatever the order of
  the --grid flags that named it."""
  return sorted(name.split(","))


def _check_flags(args: argparse.Namespace) -> None:
  """SweepError for a flag out of range, or one the chosen kind of sweep would ignore; fills
  the defaults of `--progress_s` and `--join_timeout_s`."""
  if args.parallel < 1:
    raise SweepError(f"--parallel must be >= 1, got {args.parallel}")
  if args.packed and args.parallel != 1:
    raise SweepError(
      f"--parallel={args.parallel} runs separate processes at once; --packed trains every run "
      "in one program: drop one of them"
    )
  if args.packed and args.progress_s is not None:
    raise SweepError(
      "--progress_s shows each separate run's progress; with --packed the pack prints its "
      "own lines: drop one of them"
    )
  if args.join_timeout_s is not None and not args.distributed:
    raise SweepError(
      "--join_timeout_s is how long --distributed waits to join the job; without it there is "
      "none to join: drop it or add --distributed"
    )
  args.progress_s = PROGRESS_S if args.progress_s is None else args.progress_s
  args.join_timeout_s = JOIN_TIMEOUT_S if args.join_timeout_s is None else args.join_timeout_s
  if not args.progress_s > 0:  # nan and inf too: a running run's line every that many seconds
    raise SweepError(f"--progress_s must be a number of seconds > 0, got {args.progress_s}")
  if not 0 < args.join_timeout_s < float("inf"):  # nan too
    raise SweepError(
      f"--join_timeout_s must be a finite number of seconds > 0, got {args.join_timeout_s}"
    )
  if args.distributed and (not args.packed or args.dry_run):
    raise SweepError(
      "--distributed trains a pack over several processes: it needs --packed and no --dry_run"
    )


def _checked_runs(args: argparse.Namespace) -> list[Run]:
  """The runs of the command line's grid; raises SweepError/ConfigError for a bad one."""
  _check_flags(args)
  runs = plan(args.config, args.root, args.grid, args.set, args.seeds)
  _check_kind(args.root, runs, args.packed)
  if args.packed:
    runs = _in_saved_order(args.root, runs)
  changed = {r.name: d for r in runs if (d := changed_overrides(r))}
  if changed and not args.allow_changed:
    lines = [
      f"  {name}: " + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in d.items())
      for name, d in changed.items()
    ]
    raise SweepError(
      "these workdirs were run with other settings:\n"
      + "\n".join(lines)
      + "\nuse another --root, remove those workdirs, or pass --allow_changed to resume them"
    )
  return runs


def _print_plan(runs: Sequence[Run]) -> int:
  """The dry run of separate runs: each run's state and command; exit status 0."""
  for i, run in enumerate(runs):
    steps = committed_steps(run.workdir)
    if is_complete(run):  # as `Sweep.execute` decides
      state = "skip (complete)"
    elif steps:
      state = f"resume at step {steps[-1]}"
    else:
      state = "start"
    print(f"[{i + 1}/{len(runs)}] {state}: {run.name}\n    {shlex.join(run.argv)}")
  return 0


def _packed(args: argparse.Namespace, runs: list[Run], spec: dict[str, Any]) -> int:
  """`--packed`: the pack trained in this process (joining the job first with
  `--distributed`), then the summary table; exit status."""
  from jaxrl_llm import sigterm

  terminal.setup(args.debug)
  sigterm.listen()  # a SIGTERM while the pack builds or warms up: one line, progress saved
  if args.distributed:  # JAX's preemption service then takes SIGTERM over (every process)
    launch.join_job(args.join_timeout_s)
  made = launch.outermost_missing(spec["root"])  # a refused pack leaves no folder it made
  try:
    rc = run_packed(spec["config"], runs, spec["root"], spec, args.debug)
  except (ConfigError, SweepError) as e:
    print(f"error: {e}", file=sys.stderr)
    if made:
      launch.remove_if_empty(spec["root"], made)
    return 2
  if not args.distributed or _process_index() == 0:
    print()
    print(summary_table(runs))
  return rc


def main(argv: Sequence[str] | None = None) -> int:
  """Command line entry point; returns the exit status."""
  try:
    args = _parser().parse_args(argv)
    runs = _checked_runs(args)
  except (SweepError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  if args.packed and args.dry_run:
    terminal.setup(args.debug)  # the plan compiles: library lines off the terminal
    launch.choose_backend(args.debug)  # and a failing plugin's chatter, as the trainer's
    try:
      return dry_run_packed(absolute_config(args.config), runs)
    except Exception as e:  # a known failure is one line, as the trainer's dry run says it
      line = launch.explain(e)
      if line is None or args.debug:
        raise
      print(line, file=sys.stderr)
      return 2
  if args.dry_run:
    return _print_plan(runs)

  spec = {
    "config": absolute_config(args.config),
    "root": os.path.abspath(args.root),
    "grid": {f: list(dict.fromkeys(r.params[f] for r in runs)) for f in runs[0].params},
    "set": dict(kv for s in args.set for kv in parse_set(s)),
    "parallel": args.parallel,
    "command": shlex.join([sys.executable, sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
  }
  if args.packed:
    return _packed(args, runs, spec)
  return run_unpacked(runs, args.root, spec, args.parallel, args.debug, args.progress_s)


if __name__ == "__main__":
  sys.exit(main())
