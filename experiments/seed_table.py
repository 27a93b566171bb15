"""Per-seed values, means and t 95% intervals of scalar tags, per arm, as Markdown tables
(shared by the studies).

  python experiments/seed_table.py --root=/tmp/jaxrl_experiments/clip_higher \\
      --group_by=objective.clip_high \\
      --cols='eval/accuracy@0,eval/accuracy@final,policy/entropy@avg:300-400' \\
      --baseline=0.2 --expect='policy/entropy@final:+'

Every directory under --root (repeatable: a study's extra seeds may lie under a second root)
holding a `config.json` (written by the trainer, a pack's runs included) is a run; its settings
are the resolved config of its newest record (the `config.resume-<step>.json` a resumed launch
with changed settings wrote, else config.json), its scalars those of its event files (or, in a folder
tools/export_runs.py wrote, such as docs/cpu_runs/*, its scalars.json). Runs are grouped into arms by the --group_by fields. A column
is `TAG@WHAT`:

  TAG@final        the run's last logged value
  TAG@STEP         the value logged at STEP (the last one logged at or before it)
  TAG@avg          the mean of all logged values
  TAG@avg:A-B      the mean of the values logged at steps A <= step <= B
  TAG@sum          the sum of all logged values (e.g. counts)

A run that stopped early is refused, not read as finished: @final, @avg and @sum want every run's
tag to end at the same step, @STEP and @avg:A-B a run that reached STEP or B. So is an event
file damaged inside (TensorBoard's reader stops at such a record without a word).

The first table gives each arm's mean over seeds with its 95% interval (`stats.interval`). With
--baseline (the baseline arm's --group_by values, comma-separated), a second table gives each
other arm's paired difference to the baseline over the seeds both ran, with its interval, and
with --expect `COL:+` or `COL:-` (the sign a claim predicts) the verdict it supports, with its
paired t-test's p-value: reproduced or refuted only where Holm's correction over every verdict
of the table (each expected column of each arm: one family) rejects a zero difference, else
inconclusive; "too few seeds" below 3. --per_seed prints every run's values; --csv writes them.

With --claims=FILE (a study's claims.json, declared before its results: `load_claims`), the
group_by fields, the baseline and the claimed columns come from the file, and a third table
words each declared claim (`a` minus `b`, paired by seed: an arm against the baseline, or one
arm's column against another of its columns) with Holm's correction over the file's claims
alone. A claim with `"count": {"at_most": X}` counts, per arm, the seeds whose value is at most
X (e.g. a collapse onto a trivial answer's score) and words the difference of the two counts
with the exact McNemar test's p-value (`study_stats.paired_count_test`). Columns of --cols that
no claim names are exploratory: printed, never worded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import study_stats as stats  # experiments/study_stats.py


def _fail(msg):
  """Exits 2 with one `error: msg` line on stderr (a bad input: no traceback)."""
  print(f"error: {msg}", file=sys.stderr)
  raise SystemExit(2)


def find_runs(root):
  """Every directory under `root` holding a config.json, sorted."""
  runs = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("checkpoints", "sft"))
    if "config.json" in filenames:
      runs.append(dirpath)
  return sorted(runs)


def load(run_dir):
  """(the run's flattened config, its scalars {tag: [(step, value)]}): from its TensorBoard
  events, or, in a folder `tools/export_runs.py` wrote (no events), from its scalars.json, so a
  committed export tabulates as its run did. The config is the newest record (that of the
  latest launch: `config.resume-<step>.json`, else config.json). A record or scalars.json that
  does not read, or no scalars at all exits with one line naming it."""
  from jaxrl_llm.run import changes  # imports jax
  from jaxrl_llm.run import record as record_lib

  path = changes.newest_record_path(run_dir) or os.path.join(run_dir, "config.json")
  try:
    with open(path) as f:
      record = json.load(f)
    cfg = record_lib.settings(record)  # an objective's unset field: the value it used
  except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
    _fail(f'{path}: not the trainer\'s {{"config": {{...}}}} ({type(e).__name__}: {e})')
  scalars = _scalars(run_dir)
  if not scalars:
    _fail(f"run {run_dir}: no scalars (no event files with scalars, no scalars.json)")
  return cfg, scalars


def _scalars(run_dir):
  """The run's scalars {tag: [(step, value)]} (see `load`)."""
  from jaxrl_llm import event_files, metric_info, metrics

  exported = os.path.join(run_dir, "scalars.json")
  if any(map(metric_info.is_event_file, os.listdir(run_dir))) or not os.path.isfile(exported):
    try:
      return metrics.read_scalars(run_dir)
    except event_files.EventFileError as e:
      _fail(f"run {run_dir}: {e}")
  try:
    with open(exported) as f:
      raw = json.load(f)
    return {tag: [(int(s), float(v)) for s, v in series] for tag, series in raw.items()}
  except (OSError, ValueError, TypeError, AttributeError) as e:
    _fail(
      f"{exported}: not the {{tag: [[step, value], ...]}} that tools/export_runs.py "
      f"writes ({type(e).__name__}: {e})"
    )


def value(series, what):
  """One number of a [(step, value)] series; None if it has none there."""
  if not series:
    return None
  steps = np.array([s for s, _ in series])
  vals = np.array([v for _, v in series], dtype=np.float64)
  if what == "final":
    return float(vals[-1])
  if what == "sum":
    return float(vals.sum())
  if what.startswith("avg"):
    if ":" in what:
      lo, hi = (int(x) for x in what.split(":", 1)[1].split("-"))
      sel = (steps >= lo) & (steps <= hi)
      return float(vals[sel].mean()) if sel.any() else None
    return float(vals.mean())
  step = int(what)
  sel = steps <= step
  return float(vals[sel][-1]) if sel.any() else None


_WHAT = re.compile(r"final|sum|avg|avg:\d+-\d+|\d+")  # what a TAG@WHAT column takes


def check_col(col: str) -> str | None:
  """Why `col` is not a TAG@WHAT column (None when it is)."""
  tag, at, what = col.rpartition("@")
  if not at or not tag:
    return f"{col!r} is not TAG@WHAT"
  if not _WHAT.fullmatch(what):
    return f"{col!r}: @{what} is none of @final, @STEP, @avg, @avg:A-B, @sum"
  if what.startswith("avg:") and int(what[4:].split("-")[0]) > int(what.split("-")[1]):
    return f"{col!r}: @{what} has A > B; want @avg:A-B with A <= B"
  return None


def _arms(roots, fields, cols):
  """{arm key: {seed: [value of each column]}} and the per-run rows; exits with one line for a
  --group_by field no run's config has, a column whose tag no run logged, or a NaN or infinity
  in a column's tag (a seed would silently drop out of its arm's mean)."""
  loaded = [(root, d, *load(d)) for root in roots for d in find_runs(root)]
  for _, d, _, scalars in loaded:
    for tag in dict.fromkeys(c.rpartition("@")[0] for c in cols):
      bad = next(((s, v) for s, v in scalars.get(tag, []) if not math.isfinite(v)), None)
      if bad is not None:
        _fail(f"run {d}: tag {tag!r} is {bad[1]} at step {bad[0]}; want a finite number")
  seen_fields = {f for *_, cfg, _ in loaded for f in cfg}
  seen_tags = {t for *_, scalars in loaded for t in scalars}
  if loaded and (missing := [f for f in fields if f not in seen_fields]):
    _fail(f"group_by field {missing[0]!r} is in no run's config.json")
  if loaded and (unlogged := [c for c in cols if c.rpartition("@")[0] not in seen_tags]):
    tag = unlogged[0].rpartition("@")[0]
    _fail(f"column {unlogged[0]!r}: no run logged the tag {tag!r}")
  for _, d, cfg, _ in loaded:
    if absent := [f for f in fields if f not in cfg]:
      _fail(
        f"run {d}: its config record has no {absent[0]!r}, which other runs have; every run of "
        "the table needs each group_by field"
      )
  key_of = {d: tuple(str(cfg.get(f)) for f in fields) for _, d, cfg, _ in loaded}
  _check_lengths([(d, key_of[d], cfg, scalars) for _, d, cfg, scalars in loaded], cols)
  arms: dict[tuple, dict[int, list]] = {}
  per_run = []
  for root, d, cfg, scalars in loaded:
    key = key_of[d]
    row = [value(scalars.get(c.rsplit("@", 1)[0], []), c.rsplit("@", 1)[1]) for c in cols]
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):  # "x", [1], 0.7, true, null
      _fail(f"run {d}: its config.json's seed={seed!r} is not a whole number")
    if seed in arms.setdefault(key, {}):
      _fail(f"arm {','.join(key)} has seed {seed} twice (second in {d})")
    arms[key][seed] = row
    name = (
      os.path.relpath(d, root) if len(roots) == 1 else os.path.relpath(d, os.path.dirname(root))
    )
    per_run.append((name, cfg.get("seed"), key, row))
  return arms, per_run


def _check_lengths(runs, cols):
  """Exits with one line when a column reads past a run's end (`@STEP` or `@avg:A-B` beyond
  the run's last logged step), or `@final`, `@avg` or `@sum` would read a run that stopped early
  as finished: one that ended before its own `train.num_steps`, or whose tag ends at another
  step than the other seeds' of its arm. Arms may differ in length (e.g. in train.num_steps):
  each run's `@final` is its own end. `runs`: (run dir, arm key, flat config, scalars)."""
  last = {d: max((s for series in scalars.values() for s, _ in series), default=0)
          for d, _, _, scalars in runs}  # fmt: skip
  for col in cols:
    tag, _, what = col.rpartition("@")
    at = int(what) if what.isdigit() else int(what.split("-")[1]) if ":" in what else None
    ends = {}  # arm -> {run: the step its tag's last value was logged at}
    for d, key, cfg, scalars in runs:
      end, planned = last[d], cfg.get("train.num_steps")
      if at is not None and end < at:
        _fail(
          f"run {d} ends at step {end}; column {col!r} reads step {at} (a run that stopped "
          "early? finish it, or leave it out of the table)"
        )
      if at is None and isinstance(planned, int) and end < planned:
        _fail(
          f"run {d} ends at step {end} of its train.num_steps={planned}; column {col!r} would "
          "read it as finished (a run that stopped early? finish it, or read a step every run "
          "reached with @STEP)"
        )
      if at is None and scalars.get(tag):
        ends.setdefault(key, {})[d] = max(s for s, _ in scalars[tag])
    for arm in ends.values():
      if len(set(arm.values())) > 1:
        order = sorted(arm.items(), key=lambda kv: kv[1])
        (d1, s1), (d2, s2) = order[0], order[-1]
        _fail(
          f"column {col!r}: run {d1}'s {tag!r} ends at step {s1}, run {d2}'s at {s2} in one "
          f"arm; @{what} compares the seeds of an arm at one length (a run that stopped early? "
          "finish it, or read a step both reached with @STEP)"
        )


def _table(header, rows):
  """A markdown table; a `|` inside a cell (e.g. KL(p||q) in a claim) is escaped as `\\|`."""
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  for row in rows:
    print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
  print()


def _means(arms, fields, header):
  """The first table: each arm's mean over seeds with its interval; a cell over fewer seeds than
  its arm's (a run that logged no value there) says its n."""
  rows = []
  for key, runs in arms.items():
    cells = []
    for j in range(len(header)):
      cell = stats.interval([r[j] for r in runs.values()])
      cells.append(f"{cell}" if cell.n in (len(runs), 0) else f"{cell} (n={cell.n})")
    rows.append([*key, str(len(runs)), *cells])
  _table([*fields, "seeds", *header], rows)


def _arm_names(arms):
  """The arms as `a, b` (each arm's values comma-joined), for an error line."""
  return ", ".join(",".join(k) for k in sorted(arms))


def _differences(arms, fields, cols, baseline, expect, header=None):
  """The second table: each arm's paired difference to `baseline` (an arm: main checks it)."""
  base = arms[baseline]
  print(f"paired difference to the baseline ({', '.join(fields)} = {', '.join(baseline)})")
  print("[t 95% interval] (n seeds); verdicts Holm-corrected over the table's claims\n")
  rows, claims = [], []  # claims: (row, column, (difference, p, expected sign))
  for key, runs in arms.items():
    if key == baseline:
      continue
    cells = []
    for j, col in enumerate(cols):
      diff, p = stats.paired_test(
        {s: r[j] for s, r in runs.items() if r[j] is not None},
        {s: r[j] for s, r in base.items() if r[j] is not None},
      )
      cells.append(f"{diff}" if diff.n < stats.MIN_SEEDS else f"{diff} (n={diff.n})")
      if col in expect:
        claims.append((len(rows), len(fields) + j, (diff, p, expect[col])))
    rows.append([*key, *cells])
  for (r, c, (_, p, _)), word in zip(claims, stats.verdicts([t for *_, t in claims])):
    rows[r][c] += f" p={stats.fmt(p)} {word}"
  _table([*fields, *(header or cols)], rows)


CLAIM_KEYS = {"id", "claim", "a", "b", "direction"}
OPTIONAL_KEYS = {"count"}  # {"at_most": X}: a count of seeds at or below X (see the docstring)


def load_claims(path):
  """A study's declared claims: {"group_by": [fields], "baseline": [values], "claims": [{"id",
  "claim", "a": {"arm": [values], "col": TAG@WHAT}, "b": {...}, "direction": "+" | "-",
  optionally "count": {"at_most": X}}], ...}
  (its seeds and declaration date too, and optionally "trivial_raw": a path); a malformed file exits with one line naming it."""
  try:
    with open(path) as f:
      spec = json.load(f)
  except (OSError, ValueError) as e:
    _fail(f"{path}: {getattr(e, 'strerror', None) or e}")
  if not isinstance(spec, dict):
    _fail(f"{path}: want a JSON object with group_by, baseline and claims")
  problems = [f"missing {k!r}" for k in ("group_by", "baseline", "claims") if k not in spec]
  problems += [
    f"{k!r} must be a list of strings"
    for k in ("group_by", "baseline")
    if k in spec and not _strings(spec[k])
  ]
  if "trivial_raw" in spec and not (isinstance(spec["trivial_raw"], str) and spec["trivial_raw"]):
    problems.append("'trivial_raw' must be a file's path from the repository's root (a string)")
  claims = spec.get("claims", [])
  if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
    _fail(f'{path}: "claims" must be a list of claim objects')
  if "claims" in spec and not claims:
    problems.append('"claims" is empty; want at least one claim object')
  ids = [c.get("id") for c in claims]
  if (twice := next((n for n, i in enumerate(ids) if i in ids[:n]), None)) is not None:
    problems.append(
      f"claim id {ids[twice]!r} twice; ids must be unique (one Holm family member each)"
    )
  for c in claims:
    keys_ok = CLAIM_KEYS <= set(c) <= CLAIM_KEYS | OPTIONAL_KEYS
    sides_ok = keys_ok and all(isinstance(c[x], dict) for x in "ab")
    if not sides_ok or c["direction"] not in ("+", "-") or not {"arm", "col"} == set(c["a"]):
      want = f"want keys {sorted(CLAIM_KEYS)}, optionally {sorted(OPTIONAL_KEYS)}; `a` and `b`"
      want += ' objects with an arm and a col; direction "+" or "-"'
      problems.append(f"claim {c.get('id', '?')}: {want}")
    elif not all(isinstance(c[k], str) and c[k].strip() for k in ("id", "claim")):
      problems.append(f"claim {c['id']!r}: `id` and `claim` must be non-empty strings")
    elif "count" in c and not (
      isinstance(c["count"], dict)
      and set(c["count"]) == {"at_most"}
      and isinstance(c["count"]["at_most"], int | float)
      and not isinstance(c["count"]["at_most"], bool)
      and math.isfinite(c["count"]["at_most"])
    ):
      problems.append(f'claim {c["id"]}: `count` wants {{"at_most": a finite number}}')
    elif {"arm", "col"} != set(c["b"]) or any(
      not isinstance(c[x]["col"], str) or check_col(c[x]["col"]) for x in "ab"
    ):
      problems.append(f"claim {c['id']}: `a` and `b` each want an arm and a TAG@WHAT col")
    elif not all(_strings(c[x]["arm"]) for x in "ab"):
      problems.append(f"claim {c['id']}: each side's `arm` must be a list of strings")
    elif _strings(spec.get("group_by")) and any(
      len(c[x]["arm"]) != len(spec["group_by"]) for x in "ab"
    ):
      n = len(spec["group_by"])
      problems.append(f"claim {c['id']}: each side's `arm` wants {n} value(s), one per group_by")
    elif c["a"] == c["b"]:
      problems.append(
        f"claim {c['id']}: `a` and `b` are the same arm and column (a difference of 0)"
      )
  if _strings(spec.get("group_by")) and _strings(spec.get("baseline")):
    if len(spec["baseline"]) != len(spec["group_by"]):
      problems.append(f"'baseline' wants {len(spec['group_by'])} value(s), one per group_by")
  if problems:
    _fail(f"{path}: {problems[0]}")
  return spec


def _strings(x):
  """Whether `x` is a non-empty list of strings (a claims file's group_by, baseline or arm)."""
  return isinstance(x, list) and bool(x) and all(isinstance(v, str) for v in x)


def _claims_table(arms, claims, cols):
  """Each declared claim's paired difference, p-value and Holm-corrected verdict."""
  print("declared claims (a − b paired by seed) [t 95% interval] (n seeds), p (paired t-test),")
  print("verdict Holm-corrected over these claims alone")
  if any("count" in c for c in claims):
    print("(a count claim: a − b is the difference of the shares of seeds at or below its")
    print("threshold, p the exact McNemar test's)")
  print()
  tests, rows = [], []
  for c in claims:
    side = []
    for part in (c["a"], c["b"]):
      runs = arms.get(tuple(str(v) for v in part["arm"]), {})
      j = cols.index(part["col"])
      side.append({s: r[j] for s, r in runs.items() if r[j] is not None})
    if "count" in c:
      diff, p = stats.paired_count_test(*side, at_most=c["count"]["at_most"])
    else:
      diff, p = stats.paired_test(*side)
    tests.append((diff, p, 1 if c["direction"] == "+" else -1))
    a, b = (f"{','.join(map(str, x['arm']))} {x['col']}" for x in (c["a"], c["b"]))
    if "count" in c:
      a, b = (f"seeds with {x} <= {c['count']['at_most']}" for x in (a, b))
    rows.append([c["id"], c["claim"], f"{a} − {b}", c["direction"], str(diff), str(diff.n),
                 stats.fmt(p)])  # fmt: skip
  for row, word in zip(rows, stats.verdicts(tests)):
    row.append(word)
  _table(["claim", "statement", "a − b", "expected", "difference", "n", "p", "verdict"], rows)


def main(argv=None):
  """The command line (see the module docstring); 0, or exit 2 with one line for a bad input."""
  from jaxrl_llm import terminal  # its parser: a bad flag is one line, not argparse's usage

  p = terminal.ArgParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--root", required=True, action="append", help="repeatable")
  p.add_argument("--group_by", default=None, help="comma-separated config fields")
  p.add_argument("--cols", default="", help="comma-separated TAG@WHAT columns")
  p.add_argument("--claims", default=None, help="a study's claims.json (see load_claims)")
  p.add_argument("--baseline", default=None, help="the baseline arm's --group_by values")
  p.add_argument("--expect", default="", help="comma-separated COL:+ or COL:- (a claim's sign)")
  p.add_argument("--per_seed", action="store_true", help="also print every run's values")
  p.add_argument("--csv", default=None, help="also write one row per run to this file")
  args = p.parse_args(argv)
  from jaxrl_llm import paths

  for flag in ("csv", "claims"):  # given, but empty: not "not given"
    if (value := getattr(args, flag)) is not None and not value.strip():
      _fail(f"--{flag}= is empty; give a file or leave it out")
  if missing := [r for r in args.root if not os.path.isdir(r)]:
    _fail(f"--root={missing[0]}: not a directory; give the folder holding the runs")
  if len({os.path.realpath(r) for r in args.root}) < len(args.root):
    _fail(f"--root names one folder twice ({', '.join(args.root)}); give each once")
  for flag in ("cols", "group_by"):
    items = [x.strip() for x in (getattr(args, flag) or "").split(",") if x.strip()]
    if twice := sorted({x for x in items if items.count(x) > 1}):
      _fail(f"--{flag} names {twice[0]} twice; give each once")
  if args.csv and (why := paths.file_problem(args.csv)):
    _fail(f"--csv={args.csv}: {why}")
  claims = load_claims(args.claims) if args.claims else None
  if args.baseline is not None:  # spaces around its items, as around --cols' and --group_by's
    args.baseline = ",".join(x.strip() for x in args.baseline.split(","))
  if claims is None and (not args.group_by or not args.cols):
    _fail("--group_by and --cols are needed without --claims")
  cols = [c.strip() for c in args.cols.split(",") if c.strip()]
  if claims is not None:
    claimed = [x["col"] for c in claims["claims"] for x in (c["a"], c["b"])]
    cols = list(dict.fromkeys([*claimed, *cols]))
    for flag in ("expect", "group_by", "baseline"):
      if getattr(args, flag):
        _fail(f"--{flag} and --claims: the claims file declares the {flag}; drop --{flag}")
    args.group_by, args.baseline = ",".join(claims["group_by"]), ",".join(claims["baseline"])
  fields = [f.strip() for f in args.group_by.split(",") if f.strip()]
  if bad := next(filter(None, map(check_col, cols)), None):
    _fail(f"column {bad}")
  expect = {}
  for item in filter(None, (x.strip() for x in args.expect.split(","))):
    col, _, sign = (x.strip() for x in item.rpartition(":"))
    if col not in cols or sign not in ("+", "-"):
      _fail(f"--expect={item}: want COL:+ or COL:- with COL one of --cols")
    if col in expect:
      _fail(f"--expect names {col} twice; want each column at most once")
    expect[col] = 1 if sign == "+" else -1
  if expect and args.baseline is None:  # the sign is of each arm's difference to the baseline
    _fail("--expect needs --baseline: its signs are of each arm minus the baseline arm")
  arms, per_run = _arms(args.root, fields, cols)
  if not arms:
    _fail(f"no runs (config.json) under {' or '.join(args.root)}")
  if claims is not None:
    named = [tuple(map(str, x["arm"])) for c in claims["claims"] for x in (c["a"], c["b"])]
    if absent := [k for k in [tuple(args.baseline.split(",")), *named] if k not in arms]:
      _fail(f"{args.claims}: arm {','.join(absent[0])} is no arm; arms: {_arm_names(arms)}")
  elif args.baseline is not None and tuple(args.baseline.split(",")) not in arms:
    _fail(f"--baseline={args.baseline} is no arm; arms: {_arm_names(arms)}")
  print(f"mean over seeds [t 95% interval]; {' + '.join(args.root)}\n")
  header = cols
  if claims is not None:  # a column no claim names is exploratory: no verdict word
    header = [c if c in claimed else f"{c} (exploratory)" for c in cols]
  _means(arms, fields, header)
  if args.baseline is not None:
    _differences(arms, fields, cols, tuple(args.baseline.split(",")), expect, header)
  if claims is not None:
    _claims_table(arms, claims["claims"], cols)
  if args.per_seed:
    rows = [[name, str(seed), *[stats.fmt(np.nan if x is None else x) for x in row]]
            for name, seed, _, row in per_run]  # fmt: skip
    _table(["run", "seed", *cols], rows)
  if args.csv:
    rows = [[name, seed, *key, *["" if x is None else x for x in row]]
            for name, seed, key, row in per_run]  # fmt: skip
    try:
      paths.write_csv(args.csv, ["run", "seed", *fields, *cols], rows)
    except OSError as e:
      _fail(f"--csv={args.csv}: cannot write it: {e.strerror or e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
