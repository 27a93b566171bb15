"""Figures of runs and sweeps: `python tools/plot.py {curves,passk,heatmap} PATH... [options]`.

  # one subplot per tag, one line per arm (mean over seeds, shaded min–max band)
  python tools/plot.py curves /tmp/sweep --tags=eval/accuracy,policy/entropy --out=curves.png \\
      [--smooth=0.6] [--band=ci|minmax|std|none] [--where=kl.beta=0] [--group_by=FIELD,...]
  # pass@k against k at the last evaluation, one line per arm (t 95% interval band)
  python tools/plot.py passk /tmp/sweep --out=passk.png [--step=200] [--group_by=FIELD,...]
  # final value of a tag over two swept fields (cells: mean±std over seeds)
  python tools/plot.py heatmap /tmp/sweep --tag=eval/accuracy --x=objective.clip_high \\
      --y=sampling.temperature --out=heat.png

A PATH is a run's workdir, a sweep root made by tools/sweep.py, or any directory above runs.
Each directory under it holding TensorBoard event files belongs to the run whose workdir (the
nearest directory above holding config.json or run.json, else a parent holding event files)
encloses it, e.g. `<workdir>/sft`; any other is a run by itself. `checkpoints/` is skipped.

Runs are grouped into arms by their settings. A run's settings are its recorded config
(`config.json`, written by the trainer, or the `config.resume-<step>.json` a resumed launch with
changed settings wrote: the newest); where a run lacks one, the overrides its sweep recorded
(`run.json`, or its entry in the root's `sweep.json`, earlier grids' runs included), and failing
those the `field=value,...` name tools/sweep.py gives its workdir. The fields that differ between
the runs plotted (settings that only end or pace an invocation, such as `train.stop_after_steps`,
aside) define the arms; `seed` never does: the runs of an arm are its seeds, averaged step by
step (over the steps every seed logged). `--group_by` names the fields instead (`path` and `run`
group by PATH argument or by run, so nothing is averaged). Field names may be shortened to an
unambiguous suffix (`clip_high`).

The band is the t 95% interval of the mean over an arm's seeds (`ci`, as the studies' tables:
drawn where an arm has three or more; a warning names the arms without one), or the min–max or the mean ± sample std (ddof=1) over
them, drawn where an arm has two or more; `--smooth=W` applies TensorBoard's debiased EMA (weight W in [0, 1)) to
each run before averaging. A heat map cell is the mean over seeds of each run's last logged
value of `--tag` (after `--smooth`, if given; several runs of one seed each count, with a
warning); cells without runs are grey. Axes of a heat map
are fields with several values, or fields of a sweep's grid; other fields that vary must be
fixed with `--where=FIELD=VALUE`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import compare  # tools/compare.py, next to this file
import numpy as np

from jaxrl_llm import terminal  # no JAX

SEED = "seed"
MAX_SIDE_PX, MAX_PIXELS = 65536, 2**28  # a figure larger than this would exhaust memory
PSEUDO_FIELDS = ("path", "run")  # --group_by only: the PATH argument, the run's directory
BANDS = {
  "ci": "t 95% interval of the mean over seeds",
  "minmax": "min–max over seeds",
  "std": "±1 std over seeds",
  "none": "",
}
_NAME_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*)=([^,]*)")
_PASSK = re.compile(r"eval/pass@(\d+)")


class PlotError(ValueError):
  """A problem with the command line or the runs, reported in one line (exit status 2)."""


@dataclasses.dataclass
class RunData:
  """One run: its directory, settings (field -> value) and scalars (tag -> [(step, value)])."""

  path: str
  name: str  # relative to the PATH argument it was found under ('.' is the argument itself)
  root: str  # that PATH argument
  params: dict[str, Any]
  source: str  # where `params` came from: config.json (or config.resume-<step>.json) | run.json
  # | sweep.json | name | none
  scalars: dict[str, list[tuple[int, float]]]

  def value(self, field: str) -> Any:
    """The run's value of `field` (pseudo fields `path`/`run` included); None if unknown."""
    if field == "path":
      return self.root
    if field == "run":
      return self.path
    return self.params.get(field)


@dataclasses.dataclass
class Arm:
  """Runs that share every grouping field: `key` is ((field, value), ...) in field order."""

  key: tuple[tuple[str, Any], ...]
  label: str
  runs: list[RunData]

  @property
  def seeds(self) -> list[Any]:
    """Seeds of the arm's runs, in run order (None where unknown)."""
    return [r.params.get(SEED) for r in self.runs]


@dataclasses.dataclass
class Curve:
  """One arm's curve of one tag: mean over its `n` runs at `steps`, band `lo`..`hi`."""

  arm: Arm
  steps: np.ndarray
  mean: np.ndarray
  lo: np.ndarray
  hi: np.ndarray
  n: int
  values: np.ndarray  # [n, len(steps)]: each run's (smoothed) values at `steps`


@dataclasses.dataclass
class Grid:
  """A heat map: `mean`, `std` and run counts `n` of shape [len(ys), len(xs)]."""

  tag: str
  x: str
  y: str | None
  xs: list[Any]
  ys: list[Any]
  mean: np.ndarray
  std: np.ndarray
  n: np.ndarray


# ----------------------------------------------------------------------------- reading runs


def parse_value(text: str) -> Any:
  """A setting written as text ('0.28', 'True', 'adam') as the value a config holds."""
  try:
    return canonical(ast.literal_eval(text))
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return text


def canonical(value: Any) -> Any:
  """`value` made hashable and comparable across sources (lists become tuples)."""
  if isinstance(value, (list, tuple)):
    return tuple(canonical(v) for v in value)
  if isinstance(value, dict):
    return tuple(sorted((str(k), canonical(v)) for k, v in value.items()))
  return value


def _read_record(path: str, expect: str) -> Any:
  """`path` as JSON, None if absent; PlotError if it exists but is unreadable or not valid
  JSON (a run whose settings cannot be read would silently join another arm)."""
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    reason = e.strerror if isinstance(e, OSError) else "not valid JSON"
    raise PlotError(f"{path}: {reason}; expected {expect} (fix or remove it)") from None


def _sweep_params(root: str) -> tuple[dict[str, dict[str, str]], list[str]]:
  """From `root/sweep.json`: run name -> grid values, and the grid's fields (none without one).
  PlotError if the file is there but is not a sweep's record (as an unreadable run.json)."""
  path = os.path.join(root, "sweep.json")
  shape = 'a sweep\'s {"runs": [{"name": ..., "overrides": {...}}, ...], "grid": {...}}'
  record = _read_record(path, shape)
  if record is None:
    return {}, []
  entries = None
  if isinstance(record, dict) and isinstance(record.get("grid", {}), dict):
    lists = [record.get("runs", []), record.get("earlier_runs", [])]  # earlier grids' runs too
    entries = [r for x in lists for r in x] if all(isinstance(x, list) for x in lists) else None
  if entries is None or not all(
    isinstance(r, dict)
    and isinstance(r.get("name"), str)
    and isinstance(r.get("overrides") or r.get("params") or {}, dict)
    for r in entries
  ):
    raise PlotError(f"{path}: not {shape}; fix or remove it")
  runs = {}
  for r in entries:
    runs.setdefault(r["name"], r.get("overrides") or r.get("params") or {})
  return runs, list(record.get("grid", {}))


def run_params(
  run_dir: str, sweep_runs: dict[str, dict[str, str]] | None = None
) -> tuple[dict[str, Any], str]:
  """A run's settings (field -> value) and their source: its newest config record (that of its
  latest launch: `config.resume-<step>.json`, else config.json; the source is that file's name),
  else its run.json or sweep.json overrides, else the `field=value,...` workdir name; ({},
  'none') if none of these."""
  from jaxrl_llm.run import changes  # imports jax; kept out of --help
  from jaxrl_llm.run import record as record_lib

  trainers = 'the trainer\'s {"config": {...}, ...}'
  path = changes.newest_record_path(run_dir)
  config = _read_record(path, trainers) if path else None
  record = _read_record(os.path.join(run_dir, "run.json"), 'a sweep\'s {"overrides": {...}}')
  if config is not None and not (
    isinstance(config, dict) and isinstance(config.get("config"), dict)
  ):
    raise PlotError(f"{path}: not {trainers}; fix or remove it")
  overrides = None
  if isinstance(record, dict) and isinstance(record.get("overrides"), dict):
    overrides = {k: parse_value(str(v)) for k, v in record["overrides"].items()}
  if path and isinstance(config, dict) and isinstance(config.get("config"), dict):
    name = os.path.basename(path)
    # An objective's unset field: the value it used.
    params = {k: canonical(v) for k, v in record_lib.settings(config).items()}
    for k, v in (overrides or {}).items():  # the sweep's flags and the trainer's record agree?
      if k in params and not _same(params[k], v) and k not in ignored_fields():
        _warn(f"{run_dir}: {name} has {k}={_fmt(params[k])} but run.json {_fmt(v)}")
    return params, name
  if overrides is not None:
    return overrides, "run.json"
  name = os.path.basename(os.path.normpath(run_dir))
  if sweep_runs and name in sweep_runs:
    return {k: parse_value(str(v)) for k, v in sweep_runs[name].items()}, "sweep.json"
  parts = name.split(",")
  matches = [_NAME_PART.fullmatch(p) for p in parts]
  if all(matches):
    return {m.group(1): parse_value(m.group(2)) for m in matches}, "name"
  return {}, "none"


def workdirs(path: str) -> dict[str, list[str]]:
  """The runs under `path`: workdir -> its directories holding event files. An event directory
  belongs to its nearest enclosing directory (itself included, `path` at most) holding a run's
  record (config.json or run.json), e.g. `<workdir>/sft`; else to the run of its parent if that
  holds event files; else it is a run by itself."""
  top = os.path.normpath(path)
  owner: dict[str, str] = {}
  for d in map(os.path.normpath, compare.find_runs(path, skip=("checkpoints",))):  # parents first
    probe, found = d, None
    while found is None:
      if any(os.path.exists(os.path.join(probe, f)) for f in ("config.json", "run.json")):
        found = probe
      elif probe == top or os.path.dirname(probe) == probe:
        break
      probe = os.path.dirname(probe)
    parent = os.path.dirname(d)
    owner[d] = found or (owner[parent] if d != top and parent in owner else d)
  out: dict[str, list[str]] = {}
  for d, o in owner.items():
    out.setdefault(o, []).append(d)
  return out


def load_runs(paths: Sequence[str]) -> tuple[list[RunData], list[str]]:
  """Every run under `paths` with its settings and scalars, and the fields of the sweeps' grids
  (in grid order). Raises PlotError if a path is missing or holds no event files."""
  from jaxrl_llm import event_files, metrics  # imports jax; kept out of --help

  runs: list[RunData] = []
  grid_fields: list[str] = []
  seen: set[str] = set()
  for path in paths:
    if not os.path.isdir(path):
      what = "a file, not a directory" if os.path.exists(path) else "no such directory"
      raise PlotError(f"{path}: {what}; give a run's workdir or a sweep's root")
    found = workdirs(path)
    if not found:
      raise PlotError(f"no TensorBoard event files under {path}")
    sweeps: dict[str, dict[str, dict[str, str]]] = {}
    before = len(runs)
    for workdir, event_dirs in found.items():
      real = os.path.realpath(workdir)
      if real in seen:  # the same run reached through two PATH arguments
        continue
      seen.add(real)
      parent = os.path.dirname(workdir)
      if parent not in sweeps:
        sweeps[parent], fields = _sweep_params(parent)
        grid_fields += [f for f in fields if f not in grid_fields]
      params, source = run_params(workdir, sweeps[parent])
      scalars: dict[str, list[tuple[int, float]]] = {}
      for d in sorted(event_dirs, key=lambda d: (d != workdir, d)):  # the workdir's own first
        for e in event_files.damaged_event_files(d):  # at byte 0: nothing reads (said below)
          if e.offset:
            _warn(f"{e}; its events from there on are not drawn")
        try:
          read = metrics.read_scalars(d, damaged_ok=True)
        except event_files.EventFileError as e:  # a folder named like an event file
          raise PlotError(str(e)) from None
        for tag, values in read.items():
          if tag in scalars:
            _warn(f"{d}: tag {tag!r} is also logged in {workdir}; using the workdir's")
          else:
            scalars[tag] = values
      runs.append(RunData(workdir, compare.run_name(path, workdir), path, params, source, scalars))
    if len(runs) > before and not any(r.scalars for r in runs[before:]):
      raise PlotError(
        f"{', '.join(found)}: its event files hold no scalars (empty or unreadable)"
        if len(found) == 1
        else f"no run under {path} holds scalars: its event files are empty or unreadable"
      )
    for run in (r for r in runs[before:] if not r.scalars):  # beside runs that read: kept
      _warn(f"{run.path}: its event files hold no scalars (empty or unreadable); nothing drawn")
  return runs, grid_fields


# ----------------------------------------------------------------------------- grouping


def known_fields(runs: Sequence[RunData], grid_fields: Sequence[str] = ()) -> list[str]:
  """Every field some run records, grid fields first."""
  fields = dict.fromkeys(grid_fields)
  for r in runs:
    fields.update(dict.fromkeys(sorted(r.params)))
  return list(fields)


def resolve_field(
  name: str, runs: Sequence[RunData], grid_fields: Sequence[str] = (), pseudo: bool = False
) -> str:
  """The field `name` stands for: itself, or the one known field ending in `.name`. Raises
  PlotError naming close matches for an unknown or ambiguous name."""
  if pseudo and name in PSEUDO_FIELDS:
    return name
  known = known_fields(runs, grid_fields)
  if name in known:
    return name
  ends = [f for f in known if f.endswith(f".{name}")]
  if len(ends) == 1:
    return ends[0]
  if len(ends) > 1:
    raise PlotError(f"field {name!r} is ambiguous: {', '.join(ends)}")
  last = name.rsplit(".", 1)[-1]
  near = [f for f in known if f.rsplit(".", 1)[-1] == last and f != name]
  near += [f for f in difflib.get_close_matches(name, known, n=3) if f not in near]
  hint = f"; did you mean {' or '.join(near)}?" if near else ""
  raise PlotError(f"unknown config field {name!r}{hint}")


def ignored_fields() -> tuple[str, ...]:
  """The settings that only end or pace one invocation (declared `invocation=True`, e.g.
  `train.stop_after_steps`): invocations of one run differ in them, so they define no arm."""
  from jaxrl_llm.config import INVOCATION, tagged  # imports jax; kept out of --help

  return tagged(INVOCATION)


def swept_fields(runs: Sequence[RunData], grid_fields: Sequence[str] = ()) -> list[str]:
  """Fields recorded by every run whose values differ between runs, except `seed` and fields
  that do not change results; grid fields first, then in name order."""
  if not runs:
    return []
  common, ignored = (
    set(runs[0].params).intersection(*(r.params for r in runs[1:])),
    ignored_fields(),
  )
  out = []
  for field in known_fields(runs, grid_fields):
    if field == SEED or field in ignored or field not in common:
      continue
    if len({canonical(r.params[field]) for r in runs}) > 1:
      out.append(field)
  partial = sorted(
    f
    for f in set().union(*(r.params for r in runs)) - common - {SEED, *ignored}
    if len({canonical(r.params.get(f)) for r in runs if f in r.params}) > 1
  )
  if partial:
    _warn(f"fields recorded by only some runs are not used for grouping: {', '.join(partial)}")
  return out


def apply_where(
  runs: Sequence[RunData], where: Sequence[str], grid_fields: Sequence[str] = ()
) -> list[RunData]:
  """The runs matching every `FIELD=VALUE` of `where`."""
  out = list(runs)
  for cond in where:
    field, sep, text = cond.partition("=")
    if not sep or not field.strip():
      raise PlotError(f"--where={cond!r}: expected FIELD=VALUE")
    field = resolve_field(field.strip(), runs, grid_fields, pseudo=True)
    want = parse_value(text.strip())
    kept = [r for r in out if _same(r.value(field), want)]
    if not kept:
      values = sorted({_fmt(r.value(field)) for r in out}, key=_sort_key)
      raise PlotError(f"--where={cond!r} matches no run ({field} is one of {', '.join(values)})")
    out = kept
  return out


def group_arms(
  runs: Sequence[RunData],
  fields: Sequence[str],
  labels: dict[str, str] | None = None,
  name: str | None = None,
) -> list[Arm]:
  """Runs grouped by their values of `fields`, arms and runs in value order (runs by seed);
  without fields, one arm labelled `name` (default: the run's name or the number of runs)."""
  labels = labels or short_names(fields)
  arms: dict[tuple, list[RunData]] = {}
  for r in runs:
    key = tuple((f, r.value(f)) for f in fields)
    arms.setdefault(tuple((f, canonical(v)) for f, v in key), []).append(r)
  out = []
  for key, members in arms.items():
    members.sort(key=lambda r: (_sort_key(r.params.get(SEED)), r.path))
    if fields:
      label = ", ".join(f"{labels[f]}={_fmt(members[0].value(f))}" for f in fields)
    elif name:
      label = name
    else:
      label = members[0].name if len(members) == 1 else f"{len(members)} runs"
    out.append(Arm(key, label, members))
    seeds = [_fmt(s) for s in out[-1].seeds if s is not None]
    if len(set(seeds)) < len(seeds):
      _warn(f"arm {label!r}: several runs share a seed ({', '.join(seeds)}); all are averaged")
  out.sort(key=lambda a: tuple(_sort_key(v) for _, v in a.key))
  return out


def short_names(fields: Sequence[str]) -> dict[str, str]:
  """Each field's shortest dotted suffix that no other of `fields` ends with."""
  out = {}
  for f in fields:
    parts = f.split(".")
    for i in range(len(parts) - 1, -1, -1):
      short = ".".join(parts[i:])
      if not any(g != f and (g == short or g.endswith(f".{short}")) for g in fields):
        break
    out[f] = short
  return out


def arms_for(
  runs: Sequence[RunData],
  grid_fields: Sequence[str] = (),
  group_by: Sequence[str] | None = None,
  where: Sequence[str] = (),
) -> list[Arm]:
  """The arms of `runs` after `where`: grouped by `group_by` if given, else by the swept fields."""
  selected = apply_where(runs, where, grid_fields)
  if group_by:
    fields = [resolve_field(f, runs, grid_fields, pseudo=True) for f in group_by]
  else:
    fields = swept_fields(selected, grid_fields)
  # An arm left alone by --where is named by the conditions that picked it.
  fixed = [resolve_field(c.partition("=")[0].strip(), runs, grid_fields, True) for c in where]
  short = short_names(fixed)
  name = ", ".join(f"{short[f]}={c.partition('=')[2].strip()}" for f, c in zip(fixed, where))
  return group_arms(selected, list(dict.fromkeys(fields)), name=name or None)


# ----------------------------------------------------------------------------- aggregation


def ema(values: Sequence[float], weight: float) -> np.ndarray:
  """TensorBoard's debiased exponential moving average; non-finite values pass through and do
  not enter the average."""
  out = np.asarray(values, dtype=np.float64).copy()
  if weight <= 0:
    return out
  last, count = 0.0, 0
  for i, v in enumerate(out):
    if math.isfinite(v):
      last = last * weight + (1 - weight) * v
      count += 1
      out[i] = last / (1 - weight**count)
  return out


def series(run: RunData, tag: str, smooth: float = 0.0) -> dict[int, float]:
  """step -> value of `tag` in `run` (the last value where a step was logged twice, as after
  a resume), smoothed by `smooth`."""
  by_step = dict(run.scalars.get(tag, []))
  steps = sorted(by_step)
  return dict(zip(steps, ema([by_step[s] for s in steps], smooth).tolist()))


def aggregate(arm: Arm, tag: str, smooth: float = 0.0, band: str = "minmax") -> Curve | None:
  """Mean and band of `tag` over the arm's runs at the steps all of them logged; None if no run
  of the arm logged the tag."""
  per_run = [series(r, tag, smooth) for r in arm.runs if r.scalars.get(tag)]
  if not per_run:
    return None
  if len(per_run) < len(arm.runs):
    _warn(f"{tag}: {len(arm.runs) - len(per_run)} run(s) of arm {arm.label!r} lack it")
  steps = sorted(set(per_run[0]).intersection(*per_run[1:]))
  dropped = len(set().union(*per_run)) - len(steps)
  if dropped:
    _warn(f"{tag}, arm {arm.label!r}: {dropped} step(s) not logged by every seed are left out")
  values = np.array([[s[t] for t in steps] for s in per_run], dtype=np.float64)
  values = values.reshape(len(per_run), len(steps))
  mean = values.mean(axis=0)
  if band == "ci" and len(per_run) > 2:  # as experiments/study_stats.py: none below 3 seeds
    from scipy import stats

    half = stats.t.ppf(0.975, len(per_run) - 1) * values.std(axis=0, ddof=1)
    lo, hi = mean - half / np.sqrt(len(per_run)), mean + half / np.sqrt(len(per_run))
  elif band == "std" and len(per_run) > 1:
    std = values.std(axis=0, ddof=1)
    lo, hi = mean - std, mean + std
  elif band == "minmax":
    lo, hi = values.min(axis=0), values.max(axis=0)
  else:
    lo, hi = mean.copy(), mean.copy()
  return Curve(arm, np.array(steps, dtype=np.int64), mean, lo, hi, len(per_run), values)


def available_tags(runs: Sequence[RunData]) -> list[str]:
  """Every scalar tag of any run, sorted."""
  return sorted({t for r in runs for t, v in r.scalars.items() if v})


def check_tags(patterns: Sequence[str], runs: Sequence[RunData]) -> list[str]:
  """Tags matching `patterns` (globs allowed); raises PlotError for one matching nothing."""
  available = available_tags(runs)
  if not patterns:
    raise PlotError("no tag given")
  tags = []
  for pattern in patterns:
    matches = [t for t in compare.expand_tags([pattern], available) if t in available]
    if not matches:
      near = difflib.get_close_matches(pattern, available, n=3)
      hint = f"did you mean {' or '.join(near)}? " if near else ""
      raise PlotError(f"unknown tag {pattern!r}; {hint}available: {', '.join(available)}")
    tags += [t for t in matches if t not in tags]
  return tags


def curves_data(
  runs: Sequence[RunData],
  tags: Sequence[str],
  *,
  grid_fields: Sequence[str] = (),
  smooth: float = 0.0,
  band: str = "minmax",
  group_by: Sequence[str] | None = None,
  where: Sequence[str] = (),
) -> tuple[list[Arm], dict[str, list[Curve]]]:
  """The arms and, for each tag (globs expanded), one Curve per arm that logged it."""
  _check_options(smooth, band)
  arms = arms_for(runs, grid_fields, group_by, where)
  tags = check_tags(tags, [r for a in arms for r in a.runs])
  _warn_nonfinite([r for a in arms for r in a.runs], tags)
  out = {}
  for tag in tags:
    out[tag] = [c for a in arms if (c := aggregate(a, tag, smooth, band)) is not None]
  return arms, out


def passk_data(
  runs: Sequence[RunData],
  *,
  step: int | None = None,
  grid_fields: Sequence[str] = (),
  group_by: Sequence[str] | None = None,
  where: Sequence[str] = (),
) -> tuple[list[Arm], list[Curve]]:
  """Each arm's pass@k curve at `step` (default: each run's last evaluation, one step for the
  seeds of an arm; arms may end at other steps): k = 1
  (`eval/sample_accuracy`) and every k of an `eval/pass@k` tag, the mean over seeds with its t
  95% interval (none below 3 seeds). A Curve's `steps` hold the k values."""
  arms = arms_for(runs, grid_fields, group_by, where)
  selected = [r for a in arms for r in a.runs]
  logged = {int(m.group(1)) for r in selected for t in r.scalars if (m := _PASSK.fullmatch(t))}
  ks = sorted({1} | logged)
  if ks == [1]:
    if logged:
      raise PlotError("only eval/pass@1 is logged: pass@1 alone makes no curve; log k > 1 too")
    raise PlotError("no run logged eval/pass@k: nothing to draw a pass@k curve from")
  if step is not None:
    steps = {s for r in selected for k in ks[1:] for s, _ in r.scalars.get(f"eval/pass@{k}", [])}
    if step not in steps:
      raise PlotError(
        f"--step={step}: no eval/pass@k logged there; eval steps: "
        + ", ".join(map(str, sorted(steps)))
      )
  if step is None:  # each run's last evaluation: one step per arm, or a run stopped early
    for arm in arms:
      last = {}
      for r in arm.runs:
        steps = [s for s, _ in r.scalars.get(f"eval/pass@{ks[1]}", [])]
        if not steps:
          raise PlotError(f"{r.name}: logged no eval/pass@{ks[1]}; every run of the curve needs it")
        last[r.name] = max(steps)
      if len(set(last.values())) > 1:
        (n1, s1), (n2, s2) = (
          min(last.items(), key=lambda kv: kv[1]),
          max(last.items(), key=lambda kv: kv[1]),
        )
        raise PlotError(
          f"{n1}'s last eval/pass@{ks[1]} is at step {s1}, {n2}'s at {s2}, seeds of one arm "
          "(a run that stopped early?); pick a step every run evaluated with --step"
        )
  out = []
  for arm in arms:
    per_run = []
    for r in arm.runs:
      row = []
      for k in ks:
        tag = "eval/sample_accuracy" if k == 1 else f"eval/pass@{k}"
        pts = dict(r.scalars.get(tag, []))
        at = max(pts, default=None) if step is None else step
        if at not in pts:
          where = "logged" if at is None else f"at step {at}"
          raise PlotError(
            f"{r.name}: no {tag} {where}; every run of a pass@k curve needs each k there"
          )
        if not math.isfinite(pts[at]):
          raise PlotError(
            f"{r.name}: {tag} is {pts[at]} at step {at}; a pass@k curve averages finite values "
            "(leave the run out with --where, or pick another --step)"
          )
        row.append(pts[at])
      per_run.append(row)
    values = np.array(per_run, dtype=np.float64)
    mean = values.mean(axis=0)
    lo = hi = mean
    if len(per_run) > 2:
      from scipy import stats

      half = stats.t.ppf(0.975, len(per_run) - 1) * values.std(axis=0, ddof=1)
      lo, hi = mean - half / np.sqrt(len(per_run)), mean + half / np.sqrt(len(per_run))
    out.append(Curve(arm, np.array(ks, dtype=np.int64), mean, lo, hi, len(per_run), values))
  return arms, out


def plot_passk(curves: list[Curve], out: str, *, title: str, size=None, dpi: int = 100) -> None:
  """Writes pass@k against k (log2 axis), one line per arm with its interval band."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=size or (5.5, 3.8), dpi=dpi, layout="constrained")
  for c in curves:
    n = len(c.arm.runs)
    ax.plot(c.steps, c.mean, marker="o", markersize=4, label=c.arm.label + f" (n={n})")
    if n > 2:
      ax.fill_between(c.steps, c.lo, c.hi, alpha=0.2, linewidth=0)
  ax.set_xscale("log", base=2)
  ax.set_xticks(curves[0].steps, [str(k) for k in curves[0].steps])
  ax.set_xlabel("k (samples per held-out prompt)")
  ax.set_ylabel("pass@k")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  _save(fig, out, dpi)


def heatmap_data(
  runs: Sequence[RunData],
  tag: str,
  x: str,
  y: str | None = None,
  *,
  grid_fields: Sequence[str] = (),
  smooth: float = 0.0,
  where: Sequence[str] = (),
) -> Grid:
  """Mean, sample std and count over seeds of each run's last value of `tag`, for every pair
  of values of fields `x` and `y` (y None: one row); runs of a cell that share a seed are each
  counted, with a warning. Raises PlotError for a field that is not swept, or when another
  field varies too."""
  _check_options(smooth, "none")
  runs = apply_where(runs, where, grid_fields)
  tags = check_tags([tag], runs)
  if len(tags) > 1:
    raise PlotError(f"--tag={tag!r} matches several tags: {', '.join(tags)}; give one")
  tag = tags[0]
  _warn_nonfinite(runs, [tag])
  swept = swept_fields(runs, grid_fields)
  axes = []
  for flag, name in (("--x", x), ("--y", y)):
    if name is None:
      continue
    field = resolve_field(name, runs, grid_fields)
    if field == SEED:
      raise PlotError(f"{flag}={name}: seeds are averaged over, not an axis")
    if field not in swept and field not in grid_fields:
      values = sorted({_fmt(r.params.get(field)) for r in runs}, key=_sort_key)
      raise PlotError(
        f"{flag}={name}: field {field!r} is not swept (every run has {', '.join(values)}); "
        f"swept: {', '.join(swept) or 'none'}"
      )
    if field in axes:
      raise PlotError(f"--x and --y are the same field {field!r}")
    axes.append(field)
  x, y = axes[0], axes[1] if len(axes) > 1 else None
  others = [f for f in swept if f not in axes]
  if others:
    raise PlotError(
      f"fields besides {' and '.join(axes)} vary: {', '.join(others)}; "
      f"fix them with --where=FIELD=VALUE"
    )
  xs = sorted({canonical(r.value(x)) for r in runs}, key=_sort_key)
  ys = sorted({canonical(r.value(y)) for r in runs}, key=_sort_key) if y else [None]
  finals: dict[tuple, list[float]] = {}
  last_steps: dict[tuple, set[int]] = {}
  seeds: dict[tuple, list[Any]] = {}
  for r in runs:
    s = series(r, tag, smooth)
    if s:
      cell = (canonical(r.value(y)) if y else None, canonical(r.value(x)))
      finals.setdefault(cell, []).append(s[max(s)])
      last_steps.setdefault(cell, set()).add(max(s))
      seeds.setdefault(cell, []).append(r.params.get(SEED))
  for (vy, vx), steps in last_steps.items():
    where = f"{x}={_fmt(vx)}" + (f", {y}={_fmt(vy)}" if y else "")
    if len(steps) > 1:
      _warn(f"{where}: the seeds' last {tag} steps differ ({sorted(steps)}); averaged anyway")
    known = [_fmt(s) for s in sorted(seeds[vy, vx], key=_sort_key) if s is not None]
    if len(set(known)) < len(known):
      _warn(
        f"cell {where!r}: several runs share a seed ({', '.join(known)}); all are averaged, "
        "and its n and ±std count those runs as seeds"
      )
  if len(ends := {max(steps) for steps in last_steps.values()}) > 1:
    _warn(f"the cells' last {tag} steps differ ({sorted(ends)}): cells of runs that stopped early")
  shape = (len(ys), len(xs))
  mean, std, n = np.full(shape, np.nan), np.full(shape, np.nan), np.zeros(shape, dtype=int)
  for (vy, vx), vals in finals.items():
    i, j = ys.index(vy), xs.index(vx)
    mean[i, j] = float(np.mean(vals))
    std[i, j] = float(np.std(vals, ddof=1)) if len(vals) > 1 else np.nan
    n[i, j] = len(vals)
  return Grid(tag, x, y, xs, ys, mean, std, n)


# ----------------------------------------------------------------------------- figures


def _pyplot():
  """matplotlib's pyplot on the Agg backend, or a PlotError naming the extra that installs it."""
  try:
    import matplotlib
  except ModuleNotFoundError:
    raise PlotError(
      "tools/plot.py needs matplotlib, which the base install leaves out: "
      "pip install -e '.[experiments]' (or pip install matplotlib)"
    ) from None

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def plot_curves(
  curves: dict[str, list[Curve]],
  out: str,
  *,
  band: str = "minmax",
  smooth: float = 0.0,
  cols: int = 2,
  size: tuple[float, float] | None = None,
  dpi: int = 100,
) -> None:
  """Writes one subplot per tag, one line per arm (band where an arm has several runs, three
  or more for `ci`: one warning names the arms without an interval)."""
  plt = _pyplot()
  from matplotlib.patches import Patch

  tags = list(curves)
  cols = max(1, min(cols, len(tags)))
  rows = math.ceil(len(tags) / cols)
  arms = list({id(c.arm): c.arm for cs in curves.values() for c in cs}.values())
  size = size or (5.5 * cols, 3.6 * rows + 0.4 + 0.25 * math.ceil(len(arms) / 3))
  fig, axes = plt.subplots(rows, cols, figsize=size, dpi=dpi, layout="constrained", squeeze=False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  color = {id(a): colors[i % len(colors)] for i, a in enumerate(arms)}
  banded = False
  handles = {}
  fewest = 3 if band == "ci" else 2  # runs an arm needs for a band (a t interval: 3)
  unbanded: dict[int, int] = {}  # an arm drawn without its band somewhere -> its fewest runs
  for ax, tag in zip(axes.flat, tags):
    for c in curves[tag]:
      marker = "o" if len(c.steps) <= 30 else None
      (line,) = ax.plot(
        c.steps, c.mean, color=color[id(c.arm)], marker=marker, markersize=3.5, linewidth=1.6
      )
      n = len(c.arm.runs)
      handles.setdefault(id(c.arm), (line, c.arm.label + (f" (n={n})" if n > 1 else "")))
      if band != "none" and c.n >= fewest:
        ax.fill_between(c.steps, c.lo, c.hi, color=color[id(c.arm)], alpha=0.2, linewidth=0)
        banded = True
      elif band == "ci":
        unbanded[id(c.arm)] = min(c.n, unbanded.get(id(c.arm), c.n))
    ax.set_title(tag, fontsize=10)
    ax.set_xlabel("SFT step" if tag.startswith("sft/") else "RL step")
    ax.grid(alpha=0.3)
  for ax in axes.flat[len(tags) :]:
    ax.set_visible(False)
  if unbanded:
    named = ", ".join(f"{a.label!r} (n={unbanded[id(a)]})" for a in arms if id(a) in unbanded)
    _warn(f"--band=ci: no interval for arms of fewer than 3 seeds: {named}")
  entries = [handles[id(a)] for a in arms if id(a) in handles]
  if banded:
    entries.append((Patch(color="grey", alpha=0.3), f"band: {BANDS[band]}"))
  seeds = sorted({len(a.runs) for a in arms})
  what = "mean over seeds" if seeds != [1] else "one run per line"
  title = f"{what}; band: {BANDS[band]}" if banded else what
  if smooth > 0:
    title += f"; EMA smoothing {smooth:g}"
  fig.suptitle(title, fontsize=10)
  labels, ncols = legend_layout([label for _, label in entries], fig.get_figwidth())
  fig.legend(
    [h for h, _ in entries],
    labels,
    loc="outside lower center",
    ncols=ncols,
    fontsize=8,
    frameon=False,
  )
  _save(fig, out, dpi)


def legend_layout(
  labels: Sequence[str], width_in: float, fontsize: float = 8, max_cols: int = 3
) -> tuple[list[str], int]:
  """Legend labels wrapped at ', ' to fit a figure `width_in` inches wide, and the number of
  columns that fit side by side."""
  chars = max(20, int(width_in * 72 / (0.6 * fontsize)) - 10)  # ~0.6 em per character
  wrapped = []
  for label in labels:
    lines, line = [], ""
    for part in label.split(", "):
      if line and len(line) + 2 + len(part) > chars:
        lines.append(line + ",")
        line = part
      else:
        line = f"{line}, {part}" if line else part
    wrapped.append("\n".join([*lines, line]))
  longest = max((len(x) for w in wrapped for x in w.splitlines()), default=1)
  return wrapped, max(1, min(max_cols, len(wrapped), chars // (longest + 8)))


def plot_heatmap(
  grid: Grid,
  out: str,
  *,
  smooth: float = 0.0,
  size: tuple[float, float] | None = None,
  dpi: int = 100,
  cmap: str = "viridis",
) -> None:
  """Writes the heat map of `grid`, each cell annotated with mean±std (n where counts differ)."""
  plt = _pyplot()
  import matplotlib

  ny, nx = grid.mean.shape
  size = size or (max(4.5, 1.5 * nx + 2.5), max(3.0, 0.9 * ny + 1.9))
  fig, ax = plt.subplots(figsize=size, dpi=dpi, layout="constrained")
  colors = matplotlib.colormaps[cmap].with_extremes(bad="lightgrey")
  data = np.ma.masked_invalid(grid.mean)
  im = ax.imshow(data, cmap=colors, origin="lower", aspect="auto")
  counts = sorted({int(k) for k in grid.n.flat if k})
  for i in range(ny):
    for j in range(nx):
      if not grid.n[i, j]:
        ax.text(j, i, "no run", ha="center", va="center", fontsize=8, color="dimgrey")
        continue
      m, s = grid.mean[i, j], grid.std[i, j]
      text = f"{m:.3g}" if not math.isfinite(m) or np.isnan(s) else f"{m:.3g}±{s:.2g}"
      if len(counts) > 1:
        text += f"\nn={grid.n[i, j]}"
      rgb = colors(im.norm(m))[:3] if math.isfinite(m) else (1.0, 1.0, 1.0)
      dark = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.5
      ax.text(j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black")
  ax.set_xticks(range(nx), [_fmt(v) for v in grid.xs])
  ax.set_xlabel(grid.x)
  if grid.y:
    ax.set_yticks(range(ny), [_fmt(v) for v in grid.ys])
    ax.set_ylabel(grid.y)
  else:
    ax.set_yticks([])
  fig.colorbar(im, ax=ax, label=f"final {grid.tag}")
  seeds = f"{counts[0]}–{counts[-1]}" if len(counts) > 1 else str(counts[0] if counts else 0)
  title = f"final {grid.tag}: mean±std over {seeds} seed(s)"
  if smooth > 0:
    title += f"; EMA {smooth:g}"
  ax.set_title(title, fontsize=10)
  _save(fig, out, dpi)


def _save(fig, out: str, dpi: int) -> None:
  """Writes `fig` to `out` through a temporary file, so a failed save leaves `out` as it was."""
  import matplotlib.pyplot as plt

  try:
    width, height = fig.get_size_inches()
    _check_pixels(width, height, dpi, f"the figure ({width:g}x{height:g} inches)")
    folder = os.path.dirname(os.path.abspath(out))
    try:
      os.makedirs(folder, exist_ok=True)
    except OSError as e:
      raise PlotError(f"--out={out}: cannot make its folder {folder}: {e.strerror or e}") from None
    root, ext = os.path.splitext(out)
    tmp = f"{root}.tmp{os.getpid()}{ext}"
    try:
      fig.savefig(tmp, dpi=dpi, format=ext[1:].lower() or None)
      os.replace(tmp, out)
    except OSError as e:
      raise PlotError(f"--out={out}: cannot write it: {e.strerror or e}") from None
    except RuntimeError as e:  # a format that needs a program not installed (.pgf: TeX)
      why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise PlotError(
        f"--out={out}: cannot write a {ext or 'figure'} file ({why}); give .png, .pdf or .svg"
      ) from None
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  finally:
    plt.close(fig)


# ----------------------------------------------------------------------------- helpers


def _same(a: Any, b: Any) -> bool:
  return a == b or _fmt(a) == _fmt(b)


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return repr(value)  # 1.0 stays 1.0, as a sweep's grid spells it
  return str(value)


def _sort_key(value: Any) -> tuple:
  if isinstance(value, bool) or value is None:
    return (1, str(value))
  if isinstance(value, (int, float)):
    return (0, float(value), "")
  return (2, str(value))


def _warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr)


def _check_options(smooth: float, band: str) -> None:
  if not 0 <= smooth < 1:
    raise PlotError(f"--smooth must be in [0, 1), got {smooth}")
  if band not in BANDS:
    raise PlotError(f"--band must be one of {', '.join(BANDS)}, got {band!r}")


def _check_pixels(width: float, height: float, dpi: int, what: str) -> None:
  """PlotError if `width`x`height` inches at `dpi` exceeds the pixel limits (MAX_SIDE_PX a
  side, MAX_PIXELS in all): such an image would exhaust memory."""
  w, h = round(width * dpi), round(height * dpi)
  if max(w, h) > MAX_SIDE_PX or w * h > MAX_PIXELS:
    raise PlotError(
      f"{what} at --dpi={dpi} is {w}x{h} pixels; the limit is {MAX_SIDE_PX} a side and "
      f"{MAX_PIXELS} (2^28) in all: lower --size or --dpi"
    )


def _out_problem(out: str) -> str | None:
  """Why the figure cannot be written to `out` (a directory, an unknown format, a file on its
  folder's path, a read-only folder), or None when it can: checked before any run is read."""
  _pyplot()  # the matplotlib error first, where it is missing
  from matplotlib.backend_bases import FigureCanvasBase

  formats = sorted(FigureCanvasBase.get_supported_filetypes())
  ext = os.path.splitext(out)[1].lower().lstrip(".")
  if ext not in formats and not os.path.isdir(out):
    what = f"unknown format .{ext}" if ext else "no file extension"
    return f"{what}; give one of .{', .'.join(formats)}"
  from jaxrl_llm import paths

  return paths.file_problem(out)


def _warn_nonfinite(runs: Sequence[RunData], tags: Sequence[str]) -> None:
  """One warning naming the first NaN or infinite value of `tags` in `runs` (drawn as gaps)."""
  bad = [(r, t, s, v) for r in runs for t in tags for s, v in series(r, t).items()]
  bad = [b for b in bad if not math.isfinite(b[3])]
  if bad:
    r, tag, step, value = bad[0]
    more = f" (and {len(bad) - 1} more value(s))" if len(bad) > 1 else ""
    _warn(f"{r.name}: {tag} is {value} at step {step}{more}; not drawn there")


def _split(text: str | None) -> list[str]:
  return [t.strip() for t in (text or "").split(",") if t.strip()]


def _size(text: str | None) -> tuple[float, float] | None:
  if not text:
    return None
  number = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
  m = re.fullmatch(rf"\s*{number}\s*[xX,]\s*{number}\s*", text)
  if not m or min(float(m.group(1)), float(m.group(2))) <= 0:
    raise PlotError(f"--size={text!r}: expected WIDTHxHEIGHT in inches, e.g. 10x4")
  return float(m.group(1)), float(m.group(2))


def _describe(arms: Iterable[Arm]) -> str:
  lines = []
  for a in arms:
    seeds = ",".join(_fmt(s) for s in a.seeds)
    lines.append(f"  {a.label}: {len(a.runs)} run(s), seeds {seeds}")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
  """Command line entry point; returns the exit status."""
  p = terminal.ArgParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("paths", nargs="+", metavar="PATH", help="Run workdirs or sweep roots.")
  common.add_argument("--out", default=None, help="Output file (default: <command>.png).")
  common.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) (0: off).")
  common.add_argument(
    "--where", action="append", default=[], help="FIELD=VALUE: only these runs (repeatable)."
  )
  common.add_argument("--size", default=None, help="Figure size in inches, WIDTHxHEIGHT.")
  common.add_argument("--dpi", type=int, default=100, help="Pixels per inch (default 100).")
  c = sub.add_parser("curves", parents=[common], help="Tags over steps, one line per arm.")
  c.add_argument(
    "--tags", default="eval/accuracy", help="Comma-separated tags or globs (default eval/accuracy)."
  )
  c.add_argument("--band", default="minmax", help="ci | minmax | std | none (default minmax).")
  c.add_argument("--group_by", default=None, help="Comma-separated fields defining the arms.")
  c.add_argument("--cols", type=int, default=2, help="Subplots per row (default 2).")
  k = sub.add_parser("passk", parents=[common], help="pass@k against k, one line per arm.")
  k.add_argument("--step", type=int, default=None, help="The evaluation step (default: last).")
  k.add_argument("--group_by", default=None, help="Comma-separated fields defining the arms.")
  h = sub.add_parser("heatmap", parents=[common], help="Final value over two swept fields.")
  h.add_argument("--tag", default="eval/accuracy", help="The tag (default eval/accuracy).")
  h.add_argument("--x", required=True, help="Swept field along x.")
  h.add_argument("--y", default=None, help="Swept field along y (default: one row).")
  args = p.parse_args(argv)
  out = f"{args.command}.png" if args.out is None else args.out
  try:
    if not out.strip():  # "" would write the default file in the current folder
      raise PlotError(f"--out= is empty; name an image file (default: {args.command}.png)")
    size = _size(args.size)
    if args.dpi <= 0:
      raise PlotError(f"--dpi={args.dpi}: must be a positive number of pixels per inch")
    if getattr(args, "cols", 1) <= 0:
      raise PlotError(f"--cols={args.cols}: must be a positive number of subplots per row")
    problem = _out_problem(out)
    if problem:
      raise PlotError(f"--out={out}: {problem}")
    if size:
      _check_pixels(*size, args.dpi, f"--size={args.size}")
    _check_options(args.smooth, getattr(args, "band", "none"))
    if (given := getattr(args, "group_by", None)) is not None:  # empty, or a field twice
      fields = _split(given)
      if not fields or len(set(fields)) < len(fields):
        raise PlotError(f"--group_by={given}: give each field once (comma-separated)")
    runs, grid_fields = load_runs(args.paths)
    if args.command == "curves":
      group_by = _split(args.group_by) if args.group_by is not None else None
      arms, curves = curves_data(
        runs,
        _split(args.tags),
        grid_fields=grid_fields,
        smooth=args.smooth,
        band=args.band,
        group_by=group_by,
        where=args.where,
      )
      plot_curves(
        curves, out, band=args.band, smooth=args.smooth, cols=args.cols, size=size, dpi=args.dpi
      )
      print(f"{len(arms)} arm(s):\n{_describe(arms)}")
    elif args.command == "passk":
      group_by = _split(args.group_by) if args.group_by is not None else None
      arms, passk = passk_data(
        runs, step=args.step, grid_fields=grid_fields, group_by=group_by, where=args.where
      )
      at = "the last evaluation" if args.step is None else f"step {args.step}"
      title = f"pass@k at {at}: mean over seeds, band: t 95% interval"
      plot_passk(passk, out, title=title, size=size, dpi=args.dpi)
      print(f"{len(arms)} arm(s):\n{_describe(arms)}")
    else:
      grid = heatmap_data(
        runs,
        args.tag,
        args.x,
        args.y,
        grid_fields=grid_fields,
        smooth=args.smooth,
        where=args.where,
      )
      plot_heatmap(grid, out, smooth=args.smooth, size=size, dpi=args.dpi)
      print(f"{grid.tag} over {grid.x}" + (f" x {grid.y}" if grid.y else ""))
  except PlotError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
