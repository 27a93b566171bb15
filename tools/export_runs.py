"""A study's runs as raw files to commit: per run its resolved config, every scalar, every
logged sample and its terminal log, read back from the run's own folder.

  python tools/export_runs.py --root=/tmp/calc_collapse --out=docs/cpu_runs/smollm2_calc_collapse

Every directory under --root holding a `config.json` (written by the trainer, a pack's runs
included) is a run; a --root that is itself a run is exported as OUT/<its folder's name>/. For
each, OUT/<its path under root>/ gets:

  config.json     the run's config.json, as written (and each config.resume-<step>.json a
                  resumed launch with other settings wrote: readers take the newest)
  scalars.json    every scalar of its TensorBoard events: {tag: [[step, value], ...]}
  samples.jsonl   every row of its `samples` text summaries: {"step", "prompt", "completion",
                  "reward"}: per logged update, the first completion of each of its first
                  `train.text_samples` prompts (of every prompt when rl.num_prompts is fewer)
  run.log         the terminal log, where `<root>/<name>.log` exists, else the trainer's own
                  `<run>/log.txt` (or a `<run>/run.log`)

A run is exported whole or not at all: nothing under OUT is written until every run has been
read and every destination checked, and each run is written into a temporary sibling folder
and then renamed into place (a failed write removes what this export made). Refused, each with
one `error:` line and exit 2, before anything is written: an existing OUT/<run> (an export never
overwrites outputs already committed), an OUT (or a folder on the way to OUT/<run>) that is a
file, an OUT inside ROOT (a second export would read the first), a run whose config.json is not
a JSON object with a "config" key (as the trainer writes it), and a run with no TensorBoard
scalars: no event files (such as a folder this tool wrote: export the run it came from) or
none that read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "experiments"))
from seed_table import find_runs  # noqa: E402  (the runs a study's tables read)

from jaxrl_llm import terminal  # noqa: E402

EXIT_BAD_INPUT = 2
# One row of record.text_summary's markdown table; prompts and completions may hold newlines.
ROW = re.compile(r"^\| `(.*?)` \| `(.*?)` \| (-?\d+(?:\.\d+)?) \|$", re.S | re.M)


def samples(markdown: str, step: int) -> list[dict]:
  """The rows of one `samples` text summary (record.text_summary's table) as dicts."""
  return [
    {"step": step, "prompt": p, "completion": c, "reward": float(r)}
    for p, c, r in ROW.findall(markdown)
  ]


class BadRun(Exception):
  """A run that cannot be exported; its message names the run and what is wrong."""


def read_run(run: str) -> dict[str, str]:
  """{file name: text} of one run's export; BadRun where its config.json or events do not read."""
  from jaxrl_llm import event_files, metric_info, metrics

  out = {}
  path = os.path.join(run, "config.json")
  try:
    with open(path) as f:
      out["config.json"] = f.read()
    record = json.loads(out["config.json"])
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise BadRun(
      f"{path} does not read as JSON ({e}); it must be the trainer's run record"
    ) from None
  if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
    raise BadRun(f'{path} is not a run record: it must be a JSON object with a "config" object')
  for name in sorted(os.listdir(run)):  # a resumed launch's records: the newest is the run's
    if re.fullmatch(r"config\.resume-\d+\.json", name):
      try:
        with open(os.path.join(run, name)) as f:
          out[name] = f.read()
      except (OSError, UnicodeDecodeError) as e:
        raise BadRun(f"{os.path.join(run, name)} does not read ({e}); nothing exported") from None
  events = [n for n in os.listdir(run) if metric_info.is_event_file(n)]
  try:
    scalars = metrics.read_scalars(run) if events else {}
  except event_files.EventFileError as e:
    raise BadRun(f"{e}; nothing exported") from None
  if not scalars:
    why = "no event files" if not events else f"none of its {len(events)} event files reads"
    if not events and os.path.isfile(os.path.join(run, "scalars.json")):
      why += ": it is an export already; export the run it came from"
    raise BadRun(f"{run} has no TensorBoard scalars ({why}); nothing exported")
  out["scalars.json"] = json.dumps({k: [[s, v] for s, v in vs] for k, vs in scalars.items()})
  rows = [
    r for step, text in metrics.read_text(run).get("samples", []) for r in samples(text, step)
  ]
  out["samples.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows)
  logs = ("log.txt", "run.log")  # the trainer's own log file; a sweep's copy of the terminal
  for log in (run.rstrip(os.sep) + ".log", *(os.path.join(run, n) for n in logs)):
    if os.path.isfile(log):
      try:
        with open(log) as f:
          out["run.log"] = f.read()
      except (OSError, UnicodeDecodeError) as e:
        raise BadRun(f"{log} does not read as text ({e}); nothing exported") from None
      break
  return out


def blocked(out: str, name: str) -> str | None:
  """Why OUT/<name> cannot be written (there already, or a file on its way), else None."""
  dest = os.path.abspath(os.path.join(out, name))  # a relative OUT's parents end in "/"
  if os.path.lexists(dest):
    return f"{name} is there already; export to a new folder"
  parent = os.path.dirname(dest)
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    return f"{parent} is a file, not a folder; export to a new folder"
  return None


def write(out: str, exported: dict[str, dict[str, str]]) -> None:
  """Writes each run (parents before nested runs) into a temporary sibling of OUT/<run>, then
  renames it into place; on an OSError removes every folder this made and raises it."""
  made, done = [], []
  try:
    for name, files in sorted(exported.items()):
      dest = os.path.join(out, name)
      missing, parent = [], os.path.dirname(os.path.abspath(dest))
      while not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
      for d in reversed(missing):
        os.mkdir(d)
        made.append(d)
      temp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", dir=os.path.dirname(dest))
      done.append(temp)
      for file, text in files.items():
        with open(os.path.join(temp, file), "w") as f:
          f.write(text)
      os.rename(temp, dest)
      done[-1] = dest
  except OSError:
    for d in reversed(done):
      shutil.rmtree(d, ignore_errors=True)
    for d in reversed(made):
      if os.path.isdir(d) and not os.listdir(d):
        os.rmdir(d)
    raise


def main(argv=None) -> int:
  """Writes each run's raw outputs under --out, one folder a run; a bad --root or --out is one line."""
  p = terminal.ArgParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--root", required=True, help="the folder holding the runs")
  p.add_argument("--out", required=True, help="where the raw files go (one folder per run)")
  args = p.parse_args(argv)
  for flag, value in (("--root", args.root), ("--out", args.out)):
    if not value.strip():  # "" would be the current folder
      print(f"error: {flag}= is empty; name a folder", file=sys.stderr)
      return EXIT_BAD_INPUT
  if not os.path.isdir(args.root):
    print(
      f"error: --root={args.root}: not a directory; give the folder holding the runs",
      file=sys.stderr,
    )
    return EXIT_BAD_INPUT
  runs = find_runs(args.root)
  if not runs:
    print(f"error: --root={args.root}: no runs (config.json) under it", file=sys.stderr)
    return EXIT_BAD_INPUT
  real_root, real_out = os.path.realpath(args.root), os.path.realpath(args.out)
  if real_out == real_root or real_out.startswith(real_root.rstrip(os.sep) + os.sep):
    print(
      f"error: --out={args.out}: inside --root={args.root}; a later export would read this "
      "one: export outside the root",
      file=sys.stderr,
    )
    return EXIT_BAD_INPUT
  if os.path.lexists(args.out) and not os.path.isdir(args.out):
    print(
      f"error: --out={args.out}: is a file, not a folder; export to a new folder", file=sys.stderr
    )
    return EXIT_BAD_INPUT
  names = [os.path.relpath(r, args.root) for r in runs]
  if "." in names:  # --root is itself a run: OUT/<its folder's name>/, nested runs below it
    base = os.path.basename(os.path.abspath(args.root))
    names = [base if n == "." else os.path.join(base, n) for n in names]
  for name in names:
    why = blocked(args.out, name)
    if why:
      print(f"error: --out={args.out}: {why}", file=sys.stderr)
      return EXIT_BAD_INPUT
  try:
    exported = {n: read_run(r) for n, r in zip(names, runs)}  # all read, then written
  except BadRun as e:
    print(f"error: --root={args.root}: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  try:
    write(args.out, exported)
  except OSError as e:
    print(f"error: --out={args.out}: cannot write ({e}); nothing exported", file=sys.stderr)
    return EXIT_BAD_INPUT
  for name, files in exported.items():
    print(f"{os.path.join(args.out, name)}: {', '.join(sorted(files))}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
