"""The config reference (docs/config.md), regenerated from the settings' declarations.

  python tools/config_reference.py           # rewrite the table in docs/config.md in place
  python tools/config_reference.py --check   # exit 1 (one line) if its table differs

The table between `<!-- config-reference:start -->` and `<!-- config-reference:end -->` is
`jaxrl_llm.config.tree.reference_markdown()` (every setting, its default and its comment);
tests/test_settings_tree.py keeps docs/config.md equal to it. Only that section is written
(`--readme=PATH`: another file with the two markers).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run from a checkout without installing it
  sys.path.insert(0, str(_REPO))

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
COMMAND = "python tools/config_reference.py"


def _bounds(text: str) -> tuple[int, int]:
  """(end of the start marker, start of the end marker); ValueError without both, in order."""
  if text.count(START) != 1 or text.count(END) != 1:
    raise ValueError(f"the page needs exactly one {START} and one {END}")
  begin, end = text.index(START) + len(START), text.index(END)
  if end < begin:
    raise ValueError(f"the page's {END} comes before its {START}")
  return begin, end


def shown(text: str) -> str:
  """The config reference the page shows (between the markers, stripped)."""
  begin, end = _bounds(text)
  return text[begin:end].strip()


def regenerate(text: str, table: str | None = None) -> str:
  """The page's `text` with the section between the markers replaced by `table` (default:
  `reference_markdown()`), a blank line either side; the rest unchanged."""
  if table is None:
    from jaxrl_llm.config.tree import reference_markdown

    table = reference_markdown()
  begin, end = _bounds(text)
  return f"{text[:begin]}\n\n{table.strip()}\n\n{text[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
  """Rewrites the page's table, or with --check exits 1 in one line when it differs."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if the table differs")
  parser.add_argument("--readme", type=Path, default=_REPO / "docs" / "config.md")
  args = parser.parse_args(argv)
  text = args.readme.read_text()
  try:
    new = regenerate(text)
  except ValueError as e:
    print(f"{args.readme}: {e}", file=sys.stderr)
    return 2
  if shown(new) == shown(text):
    print(f"{args.readme.name}: the config reference is up to date")
    return 0
  if args.check:
    print(
      f"{args.readme.name}: the config reference differs from the settings' declarations; "
      f"run `{COMMAND}`",
      file=sys.stderr,
    )
    return 1
  args.readme.write_text(new)
  rows = len(shown(new).splitlines()) - 2  # less the header and its rule
  print(f"{args.readme.name}: config reference rewritten ({rows} settings)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
