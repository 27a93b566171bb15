"""Whether a study's regenerated tables reproduce its committed ones, within the seeds' own
variation.

  python experiments/compare_tables.py COMMITTED.md NEW.md

Every cell of the form `mean [low, high]` (a mean over seeds with its t 95% interval, as
`seed_table.py` prints it) is matched by table, row and column. A regenerated mean reproduces
the committed one when it lies within the committed interval's half-width of it: the tolerance
is the seeds' own variation, as the interval states it. Per-seed cells (single numbers) are
counted as equal or not, for information. Prints one line per cell out of tolerance and a
summary (with the committed cells the new file lacks); exit status 1 if any mean is out of
tolerance or a committed cell is missing, 2 on a bad input (a file unreadable, not text, or
without a Markdown table).
"""

from __future__ import annotations

import re
import sys

_NUMBER = r"(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)"  # one number: `0.5.1` is none
_CELL = re.compile(
  rf"^{_NUMBER} \[{_NUMBER}, {_NUMBER}\]"
)  # "mean [low, high]"; "- [-, -]" is not one


def tables(text: str) -> dict[tuple[int, str, str], str]:
  """{(table number, row label, column header): cell} of every Markdown table in `text`. A
  row's label is its first cells, as many as it takes to tell the table's rows apart (a table
  grouped by two fields repeats the first field's value: `0.2 | 0.7`, `0.2 | 1.0`)."""
  found: list[tuple[list[str], list[list[str]]]] = []  # (header, rows) of each table
  for line in text.splitlines():
    if not line.startswith("|"):
      if found and found[-1][0]:
        found.append(([], []))  # the next table's header is the next table row
      continue
    parts = [p.strip() for p in line.strip().strip("|").split("|")]
    if not found or not found[-1][0]:
      found[-1:] = [(parts, [])]
    elif not set("".join(parts)) <= set("-: "):
      found[-1][1].append(parts)
  cells: dict[tuple[int, str, str], str] = {}
  for number, (header, rows) in enumerate(t for t in found if t[0]):
    width = next(
      (k for k in range(1, len(header) + 1) if len({tuple(r[:k]) for r in rows}) == len(rows)),
      len(header),
    )
    for parts in rows:
      label = " | ".join(parts[:width])
      for name, cell in zip(header[width:], parts[width:], strict=False):
        cells[(number, label, name)] = cell
  return cells


def compare(committed: str, new: str) -> tuple[list[str], dict[str, int]]:
  """Lines naming each mean out of tolerance (or missing), and counts of what was compared."""
  old_cells, new_cells = tables(committed), tables(new)
  problems, counts = [], {"means": 0, "within": 0, "single": 0, "single_equal": 0}
  for key, cell in old_cells.items():
    match = _CELL.match(cell)
    got = new_cells.get(key)
    if got is None:
      problems.append(f"missing: table {key[0]}, row {key[1]!r}, column {key[2]!r}")
      continue
    if match is None:
      counts["single"] += 1
      counts["single_equal"] += got == cell
      continue
    mean, low, high = (float(x) for x in match.groups())
    new_match = _CELL.match(got)
    counts["means"] += 1
    tolerance = (high - low) / 2
    if new_match and abs(float(new_match.group(1)) - mean) <= tolerance + 1e-12:
      counts["within"] += 1
    else:
      problems.append(
        f"table {key[0]}, {key[1]!r}, {key[2]!r}: {got!r} vs {cell!r} (±{tolerance:.3g})"
      )
  return problems, counts


def main(argv: list[str]) -> int:
  """Compare two tables files; print the summary; 1 if a mean is out of tolerance, 2 on a bad
  input."""
  usage = __doc__.strip().splitlines()[3].strip()
  if "-h" in argv or "--help" in argv:
    print(__doc__.strip())
    return 0
  if option := next((a for a in argv if a.startswith("-")), None):
    print(f"error: unknown option {option}; usage: {usage}", file=sys.stderr)
    return 2
  if len(argv) != 2:
    print(f"error: want 2 files, got {len(argv)}; usage: {usage}", file=sys.stderr)
    return 2
  texts = []
  for path in argv:
    try:
      with open(path, encoding="utf-8") as f:
        texts.append(f.read())
    except (OSError, UnicodeDecodeError) as e:
      why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror or e
      print(f"error: {path}: {why}; give two tables.md files", file=sys.stderr)
      return 2
    if not tables(texts[-1]):
      print(
        f"error: {path}: no Markdown table with rows (lines starting with |); give two "
        "tables.md files as seed_table.py prints them",
        file=sys.stderr,
      )
      return 2
  problems, counts = compare(*texts)
  for line in problems:
    print(line)
  missing = sum(line.startswith("missing: ") for line in problems)  # run_all.sh prints the last
  print(
    f"{counts['within']}/{counts['means']} means within the committed interval's half-width; "
    f"{counts['single_equal']}/{counts['single']} other cells identical"
    + (f"; {missing} committed cells missing" if missing else "")
  )
  return int(bool(problems))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
