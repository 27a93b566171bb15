"""Mean ± std over seeds of scalar tags, per arm, as a Markdown table (shared by the studies).

  python experiments/seed_table.py --root=/tmp/jaxrl_experiments/clip_higher \\
      --group_by=objective.clip_high \\
      --cols='eval/accuracy@0,eval/accuracy@200,eval/accuracy@final,policy/entropy@avg:300-400'

Every directory under --root holding a `config.json` (written by the trainer) is a run; its
settings are that file's resolved config. Runs are grouped into arms by the --group_by fields
(the seeds of an arm are averaged). A column is `TAG@WHAT`:

  TAG@final        the run's last logged value
  TAG@STEP         the value logged at STEP (the last one logged at or before it)
  TAG@avg          the mean of all logged values
  TAG@avg:A-B      the mean of the values logged at steps A <= step <= B
  TAG@sum          the sum of all logged values (e.g. counts)

Each cell is mean ± sample std (ddof = 1) over the arm's runs, then `(n)` when an arm has a
number of runs other than the most common one. `--csv` also writes one row per run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

import numpy as np


def flatten(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict) and v:
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def find_runs(root):
  runs = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("checkpoints", "sft"))
    if "config.json" in filenames:
      runs.append(dirpath)
  return sorted(runs)


def load(run_dir):
  from jaxrl_llm import metrics

  with open(os.path.join(run_dir, "config.json")) as f:
    cfg = flatten(json.load(f)["config"])
  return cfg, metrics.read_scalars(run_dir)


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


def fmt(x):
  if x is None or not math.isfinite(x):
    return "-"
  a = abs(x)
  if a == 0:
    return "0"
  if a >= 1000 or a < 1e-3:
    return f"{x:.2e}"
  return f"{x:.3f}" if a < 10 else f"{x:.1f}"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--root", required=True)
  p.add_argument("--group_by", required=True, help="comma-separated config fields")
  p.add_argument("--cols", required=True, help="comma-separated TAG@WHAT columns")
  p.add_argument("--csv", default=None, help="also write one row per run to this file")
  args = p.parse_args(argv)
  fields = [f.strip() for f in args.group_by.split(",") if f.strip()]
  cols = [c.strip() for c in args.cols.split(",") if c.strip()]
  arms: dict[tuple, list] = {}
  per_run = []
  for d in find_runs(args.root):
    cfg, scalars = load(d)
    key = tuple(cfg.get(f) for f in fields)
    row = [value(scalars.get(c.rsplit("@", 1)[0], []), c.rsplit("@", 1)[1]) for c in cols]
    arms.setdefault(key, []).append(row)
    per_run.append((os.path.relpath(d, args.root), cfg.get("seed"), key, row))
  if not arms:
    print(f"error: no runs (config.json) under {args.root}", file=sys.stderr)
    return 1
  counts = [len(v) for v in arms.values()]
  usual = max(set(counts), key=counts.count)
  print(f"mean ± std over seeds (n = {usual} per arm unless marked); {args.root}\n")
  print("| " + " | ".join([*fields, "n", *cols]) + " |")
  print("|" + "---|" * (len(fields) + 1 + len(cols)))
  for key in arms:
    rows = arms[key]
    cells = []
    for j in range(len(cols)):
      xs = [r[j] for r in rows if r[j] is not None]
      if not xs:
        cells.append("-")
      elif len(xs) == 1:
        cells.append(fmt(xs[0]))
      else:
        cells.append(f"{fmt(np.mean(xs))} ± {fmt(np.std(xs, ddof=1))}")
      if xs and len(xs) != usual:
        cells[-1] += f" ({len(xs)})"
    print("| " + " | ".join([str(k) for k in key] + [str(len(rows))] + cells) + " |")
  if args.csv:
    with open(args.csv, "w", newline="") as f:
      w = csv.writer(f)
      w.writerow(["run", "seed", *fields, *cols])
      for name, seed, key, row in per_run:
        w.writerow([name, seed, *key, *["" if x is None else x for x in row]])
  return 0


if __name__ == "__main__":
  sys.exit(main())
