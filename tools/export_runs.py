"""A study's runs as raw files to commit: per run its resolved config, every scalar, every
logged sample and its terminal log, read back from the run's own folder.

  python tools/export_runs.py --root=/tmp/calc_collapse --out=docs/cpu_runs/smollm2_calc_collapse

Every directory under --root holding a `config.json` (written by the trainer, a pack's runs
included) is a run. For each, OUT/<its path under root>/ gets:

  config.json     the run's config.json, as written
  scalars.json    every scalar of its TensorBoard events: {tag: [[step, value], ...]}
  samples.jsonl   every row of its `samples` text summaries: {"step", "prompt", "completion",
                  "reward"} (the first `train.text_samples` completions of each logged update)
  run.log         the terminal log, where `<root>/<name>.log` exists, else the trainer's own
                  `<run>/log.txt` (or a `<run>/run.log`)

A run is exported whole or not at all: nothing under OUT is written until every run has been
read. An existing OUT/<run> is refused (one `error:` line), so an export never overwrites
outputs already committed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "experiments"))
from seed_table import find_runs  # noqa: E402  (the runs a study's tables read)

EXIT_BAD_INPUT = 2
# One row of record.text_summary's markdown table; prompts and completions may hold newlines.
ROW = re.compile(r"^\| `(.*?)` \| `(.*?)` \| (-?\d+(?:\.\d+)?) \|$", re.S | re.M)


def samples(markdown: str, step: int) -> list[dict]:
  """The rows of one `samples` text summary (record.text_summary's table) as dicts."""
  return [
    {"step": step, "prompt": p, "completion": c, "reward": float(r)}
    for p, c, r in ROW.findall(markdown)
  ]


def read_run(run: str) -> dict[str, str]:
  """{file name: text} of one run's export."""
  from jaxrl_llm import metrics

  out = {}
  with open(os.path.join(run, "config.json")) as f:
    out["config.json"] = f.read()
  scalars = metrics.read_scalars(run)
  out["scalars.json"] = json.dumps({k: [[s, v] for s, v in vs] for k, vs in scalars.items()})
  rows = [
    r for step, text in metrics.read_text(run).get("samples", []) for r in samples(text, step)
  ]
  out["samples.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows)
  logs = ("log.txt", "run.log")  # the trainer's own log file; a sweep's copy of the terminal
  for log in (run.rstrip(os.sep) + ".log", *(os.path.join(run, n) for n in logs)):
    if os.path.isfile(log):
      with open(log) as f:
        out["run.log"] = f.read()
      break
  return out


def main(argv=None) -> int:
  """Writes each run's raw outputs under --out, one folder a run; a bad --root or --out is one line."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--root", required=True, help="the folder holding the runs")
  p.add_argument("--out", required=True, help="where the raw files go (one folder per run)")
  args = p.parse_args(argv)
  runs = find_runs(args.root)
  if not runs:
    print(f"error: --root={args.root}: no runs (config.json) under it", file=sys.stderr)
    return EXIT_BAD_INPUT
  names = [os.path.relpath(r, args.root) for r in runs]
  taken = [n for n in names if os.path.exists(os.path.join(args.out, n))]
  if taken:
    print(
      f"error: --out={args.out}: {taken[0]} is there already; export to a new folder",
      file=sys.stderr,
    )
    return EXIT_BAD_INPUT
  exported = {n: read_run(r) for n, r in zip(names, runs)}  # all read, then written
  for name, files in exported.items():
    folder = os.path.join(args.out, name)
    os.makedirs(folder)
    for file, text in files.items():
      with open(os.path.join(folder, file), "w") as f:
        f.write(text)
    print(f"{folder}: {', '.join(sorted(files))}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
