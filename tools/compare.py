"""Compare runs: `python tools/compare.py --root=/tmp/sweep [--tags=eval/accuracy,...] [--csv=F]`.

Every directory under `--root` that holds TensorBoard event files is a run (a sweep's workdirs,
or any set of trainer workdirs). Prints one row per run with the final and best value of each
tag; `--csv` also writes the table as CSV (making its missing folders; never inside a run's
folder under the root, nor over a file that is not a .csv table). Tags may be glob patterns
(`--tags='eval/*'`).
"Best" follows each metric's declared direction (`jaxrl_llm/metric_info.py`): the maximum
for accuracy or reward, the minimum for skipped updates or timeouts, none for entropy, length or
clip fraction; `--maximize`/`--minimize` override it. The table is split into blocks of columns
that fit `--width` (120) characters.

TensorBoard shows the same runs side by side: `tensorboard --logdir /tmp/sweep`.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import math
import os
import sys
from collections.abc import Sequence

from jaxrl_llm import (
  metric_info,  # no JAX: keeps --help fast
  terminal,
)

DEFAULT_TAGS = ("eval/accuracy", "eval/pass@*", "rollout/reward_mean")


SKIPPED = ("checkpoints", "sft", "plugins")  # a run's own subfolders: not runs of their own


def find_runs(root: str, skip: Sequence[str] = SKIPPED) -> list[str]:
  """Directories under `root` (itself included) holding event files, sorted; a run's
  checkpoints, warm-start (`sft`) and profile folders (`skip`) are not searched."""
  runs = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip)
    if any(map(metric_info.is_event_file, filenames)):
      runs.append(dirpath)
  return sorted(runs)


RUN_FILES = ("config.json", "run.json", "checkpoints")  # what a trainer's workdir holds


def holds_run(folder: str) -> bool:
  """Whether `folder` holds a run's files: event files, config.json, run.json or checkpoints."""
  try:
    names = os.listdir(folder)
  except OSError:  # missing (the writer would make it) or unreadable: no run's files
    return False
  return any(n in RUN_FILES or metric_info.is_event_file(n) for n in names)


def csv_problem(csv: str, root: str) -> str | None:
  """Why writing the table at `csv` could clobber a run's files: it is inside a run's folder
  under `root` (its top level, or the root itself, is allowed), or an existing file that is not
  a .csv table; None when it is neither."""
  real_root, real = os.path.realpath(root), os.path.realpath(csv)
  folder = os.path.dirname(real)
  if folder.startswith(real_root.rstrip(os.sep) + os.sep):
    above = folder
    while above != os.path.dirname(real_root):  # up to the root itself, included
      if holds_run(above):
        run = os.path.normpath(os.path.join(root, os.path.relpath(above, real_root)))
        return (
          f"inside the run folder {run} under --root={root}; write the table outside the "
          f"runs' folders (e.g. {os.path.join(root, 'table.csv')})"
        )
      above = os.path.dirname(above)
  if os.path.lexists(csv) and not real.lower().endswith(".csv"):
    return "is an existing file that is not a .csv table; give a new file or a .csv one"
  return None


def run_name(root: str, run_dir: str) -> str:
  """Name of a run: its path relative to `root`; `root` itself (a single run's workdir) by its
  folder's name."""
  name = os.path.relpath(run_dir, root)
  return os.path.basename(os.path.abspath(run_dir)) if name == "." else name


def read_run(run_dir: str) -> dict[str, list[tuple[int, float]]]:
  """All scalars of one run: tag -> [(step, value)] in step order; an event file damaged
  inside is warned of, and its events before the damage read."""
  from jaxrl_llm import event_files, metrics  # imports jax; kept out of --help

  for e in event_files.damaged_event_files(run_dir):  # at byte 0: nothing reads (said below)
    if e.offset:
      print(f"warning: {e}; its events from there on are not shown", file=sys.stderr)
  return metrics.read_scalars(run_dir, damaged_ok=True)


def expand_tags(patterns: Sequence[str], available: Sequence[str]) -> list[str]:
  """Tags matching `patterns` (globs), in pattern order; a plain tag is kept even if absent."""
  out: list[str] = []
  for pattern in patterns:
    if any(c in pattern for c in "*?["):
      matches = sorted(
        (t for t in available if fnmatch.fnmatchcase(t, pattern)), key=metric_info.tag_order
      )
    else:
      matches = [pattern]
    out.extend(t for t in matches if t not in out)
  return out


def direction(tag: str, maximize: Sequence[str] = (), minimize: Sequence[str] = ()) -> str | None:
  """'max', 'min' or None for `tag`: the user's `maximize`/`minimize` glob patterns first, then
  the direction the metric declares (`jaxrl_llm.metric_info`). Tags like entropy, length or
  clip fraction declare none: neither direction is better in general, so they get no best."""
  if any(fnmatch.fnmatchcase(tag, p) for p in minimize):
    return "min"
  if any(fnmatch.fnmatchcase(tag, p) for p in maximize):
    return "max"
  return metric_info.direction(tag)


def summarize(
  series: Sequence[tuple[int, float]], minimize: bool = False, *, best: bool = True
) -> dict[str, float | int] | None:
  """Final and best value of one tag's `[(step, value)]` (non-finite values never best);
  with `best=False` the best value and step are None."""
  if not series:
    return None
  final_step, final = series[-1]
  finite = [(s, v) for s, v in series if math.isfinite(v)]
  if not best:
    return {"final": final, "final_step": final_step, "best": None, "best_step": None}
  if finite:
    pick = min if minimize else max
    best_step, best = pick(finite, key=lambda sv: sv[1])
  else:
    best_step, best = final_step, final
  return {"final": final, "final_step": final_step, "best": best, "best_step": best_step}


def last_step(scalars: dict[str, list[tuple[int, float]]]) -> int | None:
  """Largest step of any scalar, or None for an empty run."""
  steps = [series[-1][0] for series in scalars.values() if series]
  return max(steps) if steps else None


def fmt(value) -> str:
  """Formats a table cell: 4 significant digits for floats, '-' for missing."""
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """Left-aligned text table with a rule under the header."""
  cells = [list(map(str, header))] + [[fmt(v) for v in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def format_blocks(
  header: Sequence[str], rows: Sequence[Sequence[object]], width: int = 120, keep: int = 2
) -> str:
  """`format_table`, split into blocks of columns that each fit `width` characters (0: no
  limit); every block repeats the first `keep` columns (run and step)."""
  if width <= 0 or len(format_table(header, rows).splitlines()[0]) <= width:
    return format_table(header, rows)
  blocks: list[list[int]] = []
  for i in range(keep, len(header)):
    trial = (blocks[-1] if blocks else []) + [i]
    cols = list(range(keep)) + trial
    fits = (
      len(
        format_table([header[c] for c in cols], [[r[c] for c in cols] for r in rows]).splitlines()[
          1
        ]
      )
      <= width
    )
    if blocks and fits:
      blocks[-1].append(i)
    else:
      blocks.append([i])
  out = []
  for block in blocks:
    cols = list(range(keep)) + block
    out.append(format_table([header[c] for c in cols], [[r[c] for c in cols] for r in rows]))
  return "\n\n".join(out)


def compare(
  root: str,
  tags: Sequence[str] = DEFAULT_TAGS,
  minimize: Sequence[str] = (),
  sort: str | None = None,
  maximize: Sequence[str] = (),
) -> tuple[list[str], list[list[object]]]:
  """Reads every run under `root`; returns (header, rows) of final/best values per tag. A
  tag's best is its maximum or minimum by `direction`; tags of neither kind have no best."""
  runs = {run_name(root, d): read_run(d) for d in find_runs(root)}
  available = sorted({t for scalars in runs.values() for t in scalars})
  if runs and not available:  # every event file empty or unreadable
    if len(runs) == 1:
      where = os.path.normpath(os.path.join(root, next(iter(runs))))
      raise ValueError(f"{where}: its event files hold no scalars (empty or unreadable)")
    raise ValueError(f"no run under {root} holds scalars: its event files are empty or unreadable")
  for name in (n for n, scalars in runs.items() if not scalars):  # shown, as blanks
    print(
      f"warning: {os.path.normpath(os.path.join(root, name))}: its event files hold no scalars "
      "(empty or unreadable); its row is blank",
      file=sys.stderr,
    )
  empty = [g for g in tags if any(c in g for c in "*?[") and not expand_tags([g], available)]
  if runs and empty and tuple(tags) != DEFAULT_TAGS:  # a glob the user gave matches nothing
    raise ValueError(
      f"tag pattern {empty[0]!r} matches no tag under {root}; available: {', '.join(available)}"
    )
  tags = expand_tags(tags, available)
  unknown = [t for t in tags if t not in available]
  if runs and unknown:  # in no run at all: a typo, most likely
    near = difflib.get_close_matches(unknown[0], available, n=3)
    hint = (
      f"; did you mean {' or '.join(near)}?" if near else f"; available: {', '.join(available)}"
    )
    raise ValueError(f"tag {unknown[0]!r} is in no run under {root}{hint}")
  for flag, patterns in (("--minimize", minimize), ("--maximize", maximize)):
    for p in patterns:
      if runs and not any(fnmatch.fnmatchcase(t, p) for t in tags):
        raise ValueError(f"{flag} pattern {p!r} matches none of the shown tags: {', '.join(tags)}")
  header = ["run", "step"]
  for tag in tags:
    header += [f"{tag} final", f"{tag} best", f"{tag} best_step"]
  rows = []
  for name, scalars in runs.items():
    row: list[object] = [name, last_step(scalars)]
    for tag in tags:
      way = direction(tag, maximize, minimize)
      s = summarize(scalars.get(tag, []), minimize=way == "min", best=way is not None) or {}
      row += [s.get("final"), s.get("best"), s.get("best_step")]
    rows.append(row)
  if sort:
    col = header.index(f"{sort} final") if f"{sort} final" in header else None
    if col is None:
      raise ValueError(f"--sort tag {sort!r} is not among the shown tags {tags}")
    missing = [r[col] is None or not math.isfinite(r[col]) for r in rows]  # last, in order
    order = sorted(
      range(len(rows)), key=lambda i: (missing[i], 0.0 if missing[i] else -rows[i][col])
    )
    rows = [rows[i] for i in order]
  return header, rows


def _split(text: str) -> list[str]:
  return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> int:
  """Command line entry point; returns the exit status."""
  p = terminal.ArgParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--root", required=True, help="Directory holding the runs (searched recursively).")
  p.add_argument(
    "--tags",
    default=",".join(DEFAULT_TAGS),
    help="Comma-separated tags or glob patterns (default: %(default)s).",
  )
  p.add_argument(
    "--minimize",
    default=None,
    help="Tag patterns whose best value is the minimum (default: each metric's own direction).",
  )
  p.add_argument(
    "--maximize",
    default=None,
    help="Tag patterns whose best value is the maximum (default: each metric's own direction).",
  )
  p.add_argument(
    "--width",
    type=int,
    default=120,
    help="Terminal table width: wider tables are split into blocks of columns (default: "
    "%(default)s; 0 for one block).",
  )
  p.add_argument("--sort", default=None, help="Sort rows by this tag's final value, largest first.")
  p.add_argument("--csv", default=None, help="Also write the table to this CSV file.")
  args = p.parse_args(argv)
  for flag in ("minimize", "maximize", "sort", "csv"):  # given, but empty: not "not given"
    if (value := getattr(args, flag)) is not None and not _split(value):
      print(f"error: --{flag}={value!r} is empty; give a value or leave it out", file=sys.stderr)
      return 2
  args.minimize, args.maximize = args.minimize or "", args.maximize or ""
  if not os.path.isdir(args.root):
    print(f"error: --root {args.root!r} is not a directory", file=sys.stderr)
    return 2
  if args.width < 0:
    print(f"error: --width={args.width} must be >= 0 (0: one block)", file=sys.stderr)
    return 2
  both = sorted(set(_split(args.minimize)) & set(_split(args.maximize)))
  if both:
    print(
      f"error: {both[0]!r} is in both --minimize and --maximize; name it in one", file=sys.stderr
    )
    return 2
  if not _split(args.tags):
    print(f"error: --tags={args.tags!r} is empty; give tags or glob patterns", file=sys.stderr)
    return 2
  from jaxrl_llm import paths

  problem = args.csv and (paths.file_problem(args.csv) or csv_problem(args.csv, args.root))
  if problem:
    print(f"error: --csv={args.csv}: {problem}", file=sys.stderr)
    return 2
  try:
    header, rows = compare(
      args.root, _split(args.tags), _split(args.minimize), args.sort, _split(args.maximize)
    )
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not rows:
    print(f"error: no TensorBoard event files under {args.root}", file=sys.stderr)
    return 2
  # The terminal table leaves out best_step; the CSV keeps every column.
  shown = [i for i, h in enumerate(header) if not h.endswith(" best_step")]
  print(
    format_blocks([header[i] for i in shown], [[r[i] for i in shown] for r in rows], args.width)
  )
  if args.csv:
    try:
      paths.write_csv(args.csv, header, rows)
    except OSError as e:
      print(f"error: --csv={args.csv}: cannot write it: {e.strerror or e}", file=sys.stderr)
      return 2
    print(f"wrote {args.csv}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
