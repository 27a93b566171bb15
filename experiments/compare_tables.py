"""Whether a study's regenerated tables reproduce its committed ones, within the seeds' own
variation.

  python experiments/compare_tables.py COMMITTED.md NEW.md

Every cell of the form `mean [low, high]` (a mean over seeds with its t 95% interval, as
`seed_table.py` prints it) is matched by table, row and column. A row is named by the columns
its table is grouped by (those before `seeds`, or before the first `mean [low, high]` column),
the same ones in both files, so a table that gained or lost an arm still compares every row
the two files share. A regenerated mean reproduces the committed one when it lies within the
committed interval's half-width of it: the tolerance is the seeds' own variation, as the
interval states it. Per-seed cells (single numbers) are counted as equal or not, for
information. Prints one line per cell out of tolerance or missing, one per row in one file only
(`removed:` a committed row the new file lacks, `added:` a new row), and a summary (with the
committed cells missing, rows removed and rows added); exit status 1 if any mean is out of
tolerance or a committed cell or row is missing (an added row alone is no fault), 2 on a bad
input (a file unreadable, not text, without a Markdown table, or with a cell whose interval is
inverted, `0.5 [0.6, 0.4]`).
"""

from __future__ import annotations

import re
import sys

_NUMBER = r"(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)"  # one number: `0.5.1` is none
_CELL = re.compile(
  rf"^{_NUMBER} \[{_NUMBER}, {_NUMBER}\]"
)  # "mean [low, high]"; "- [-, -]" is not one


def parse(text: str) -> list[tuple[list[str], list[list[str]]]]:
  """(header, rows) of every Markdown table in `text`, each row its cells."""
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
  return [t for t in found if t[0]]


def _unique_width(header: list[str], rows: list[list[str]]) -> int:
  """The fewest leading cells that tell `rows` apart."""
  return next(
    (k for k in range(1, len(header) + 1) if len({tuple(r[:k]) for r in rows}) == len(rows)),
    len(header),
  )


def label_widths(*files: list[tuple[list[str], list[list[str]]]]) -> list[list[int]]:
  """How many leading cells label a row, for each table of each of `files` (as `parse` gives
  them): the columns the table is grouped by, the same ones in every file, so that a table
  that gained or lost an arm still matches its other rows. Those are the columns before
  `seeds`, or before the first column holding a `mean [low, high]` cell in any file, whichever
  comes first; with neither (a per-seed or prose table), the fewest leading cells that tell
  every file's rows apart. Never fewer than that, so no row hides another."""
  widths = []
  for number in range(max(len(f) for f in files)):
    tables = [f[number] for f in files if number < len(f)]
    marks = [h.index("seeds") for h, _ in tables if "seeds" in h[1:]]
    means = [
      j
      for h, rows in tables
      for j in range(1, len(h))
      if any(j < len(r) and _CELL.match(r[j]) for r in rows)
    ]
    marks += [min(means)] if means else []
    unique = max(_unique_width(h, rows) for h, rows in tables)
    widths.append(max(min(marks), unique) if marks else unique)
  return [[widths[n] for n in range(len(f))] for f in files]


def tables(text: str, widths: list[int] | None = None) -> dict[tuple[int, str], dict[str, str]]:
  """{(table number, row label): {column header: cell}} of every Markdown table in `text`. A
  row's label is its first `widths[table]` cells (`0.2 | 0.7` for a table grouped by two
  fields); without `widths`, as `label_widths` picks them for this file alone."""
  found = parse(text)
  widths = widths if widths is not None else label_widths(found)[0]
  rows: dict[tuple[int, str], dict[str, str]] = {}
  for number, ((header, parts_list), width) in enumerate(zip(found, widths, strict=True)):
    for parts in parts_list:
      label = " | ".join(parts[:width])
      rows[(number, label)] = dict(zip(header[width:], parts[width:], strict=False))
  return rows


def inverted_cell(text: str) -> str | None:
  """The first `mean [low, high]` cell of `text` whose interval is inverted (low above high),
  named by table, row and column; None when there is none."""
  for (number, label), row in tables(text).items():
    for name, cell in row.items():
      match = _CELL.match(cell)
      if match and float(match.group(2)) > float(match.group(3)):
        return f"table {number}, row {label!r}, column {name!r}: {cell!r}"
  return None


def compare(committed: str, new: str) -> tuple[list[str], dict[str, int]]:
  """Lines naming each mean out of tolerance, each committed cell missing, and each row in
  one file only (`removed:` or `added:`), and counts of what was compared. Rows are matched by
  the same label columns in both files (`label_widths`)."""
  old_found, new_found = parse(committed), parse(new)
  old_widths, new_widths = label_widths(old_found, new_found)
  old_rows, new_rows = tables(committed, old_widths), tables(new, new_widths)
  problems: list[str] = []
  counts = {"means": 0, "within": 0, "single": 0, "single_equal": 0}
  for key, old_row in old_rows.items():
    new_row = new_rows.get(key)
    if new_row is None:
      problems.append(f"removed: table {key[0]}, row {key[1]!r} (in the committed file only)")
      continue
    for name, cell in old_row.items():
      got = new_row.get(name)
      if got is None:
        problems.append(f"missing: table {key[0]}, row {key[1]!r}, column {name!r}")
        continue
      match = _CELL.match(cell)
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
          f"table {key[0]}, {key[1]!r}, {name!r}: {got!r} vs {cell!r} (±{tolerance:.3g})"
        )
  for key in new_rows.keys() - old_rows.keys():
    problems.append(f"added: table {key[0]}, row {key[1]!r} (in the new file only)")
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
    if cell := inverted_cell(texts[-1]):
      print(
        f"error: {path}: {cell}: its interval's low is above its high; a cell is "
        "`mean [low, high]` with low <= high, as seed_table.py prints it",
        file=sys.stderr,
      )
      return 2
  problems, counts = compare(*texts)
  for line in problems:
    print(line)
  missing, removed, added = (
    sum(line.startswith(f"{what}: ") for line in problems)
    for what in ("missing", "removed", "added")
  )  # run_all.sh prints the summary line alone
  print(
    f"{counts['within']}/{counts['means']} means within the committed interval's half-width; "
    f"{counts['single_equal']}/{counts['single']} other cells identical"
    + (f"; {missing} committed cells missing" if missing else "")
    + (f"; {removed} committed rows removed" if removed else "")
    + (f"; {added} rows added" if added else "")
  )
  return int(any(not line.startswith("added: ") for line in problems))  # a new arm is no fault


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
