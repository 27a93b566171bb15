"""The cross-study table of experiments/README.md, generated from each study's declared claims
(claims.json) and its confirmation on fresh seeds (confirmation.md, printed by its run.sh with
CONFIRM=1), with each testbed's best trivial answer above it.

  python experiments/summary.py           # rewrites the table in experiments/README.md
  python experiments/summary.py --check   # exits 1 naming the file when the table is stale

A claim without a confirmation yet (or whose confirmation has no seed of an arm it names) reads
"not yet confirmed"; its verdict comes only from the confirmation table (Holm-corrected over the
study's own claims), never from the seeds that explored it.

A study page with claims of its own (`<study>/<page>.claims.json`, e.g. a comparison on the real
model) gets rows beside its study's, from the claims table printed into `<page>.md`; its
testbed's trivial answer is the best line of the raw output its `trivial_raw` names.
"""

from __future__ import annotations

import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import seed_table  # noqa: E402

BEGIN = "<!-- cross-study table: python experiments/summary.py writes it -->"
END = "<!-- end of the cross-study table -->"


def _fail(msg: str):
  """Exits 2 with one `error: msg` line on stderr (a bad input: no traceback)."""
  print(f"error: {msg}", file=sys.stderr)
  raise SystemExit(2)


def _read(path: str, what: str) -> str:
  """The text of `path`; a file missing, unreadable or not UTF-8 exits 2 naming it and `what`
  it should be."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror or e
    _fail(f"{path}: {why}; want {what}")


def studies() -> list[str]:
  """The study folders (those with a run.sh), sorted."""
  return sorted(d for d in os.listdir(HERE) if os.path.isfile(os.path.join(HERE, d, "run.sh")))


def pages(study: str) -> list[str]:
  """The study's pages with claims of their own (`<page>.claims.json` beside `<page>.md`)."""
  suffix = ".claims.json"
  names = os.listdir(os.path.join(HERE, study))
  return sorted(n.removesuffix(suffix) for n in names if n.endswith(suffix))


def confirmed(study: str, page: str = "confirmation") -> dict[str, list[str]]:
  """{claim id: its row of the claims table printed into `<study>/<page>.md`} (empty without
  one)."""
  path = os.path.join(HERE, study, f"{page}.md")
  if not os.path.exists(path):
    return {}
  rows, inside, width = {}, False, 0
  for line in _read(path, "the claims table seed_table.py --claims prints").split("\n"):
    if line.startswith("| claim | statement |"):
      inside, width = True, len(_cells(line))
    elif inside and line.startswith("| ") and not line.startswith("|---"):
      cells = _cells(line)
      if len(cells) < width:
        _fail(
          f"{path}: claims-table row {cells[0]!r} has {len(cells)} of the header's {width} cells"
        )
      # A statement's own bars, left unescaped by tables printed before seed_table.py
      # escaped them, join back into it: every other cell is fixed.
      cells[1 : len(cells) - width + 2] = ["|".join(cells[1 : len(cells) - width + 2])]
      rows[cells[0]] = cells
    elif inside and not line.strip():
      inside = bool(not rows)
  return rows


def _cells(line: str) -> list[str]:
  """A markdown table row's cells, split at the bars no backslash escapes."""
  return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def table() -> str:
  """The markdown table: one row per declared claim of every study."""
  lines = [
    "| study | claim | a − b (expected sign) | on fresh seeds: difference [t 95%] or count | n | p | verdict |",
    "|---|---|---|---|---|---|---|",
  ]
  for study in studies():
    parts = [(study, "README", "claims.json", "confirmation")]
    parts += [(f"{study}/{p}", p, f"{p}.claims.json", p) for p in pages(study)]
    for name, page, claims, results in parts:
      spec = seed_table.load_claims(os.path.join(HERE, study, claims))
      lines += _rows(f"[{name}]({study}/{page}.md)", spec, confirmed(study, results))
  return "\n".join(lines)


def _rows(link: str, spec: dict, done: dict[str, list[str]]) -> list[str]:
  """The table's rows of one claims file, given its printed claims table's rows."""
  lines = []
  for c in spec["claims"]:
    a, b = (f"{','.join(map(str, x['arm']))} `{x['col']}`" for x in (c["a"], c["b"]))
    if "count" in c:  # a count of seeds at or below a threshold (seed_table.py's docstring)
      a, b = (f"seeds with {x} ≤ {c['count']['at_most']}" for x in (a, b))
    claim = c["claim"].replace("|", "\\|")  # a bar of its own (KL(p||q)) would split its cell
    head = f"| {link} | {claim} | {a} − {b} ({c['direction']}) |"
    row = done.get(c["id"])
    if row is None or row[5] == "0":  # n = 0: an arm it names is not trained on them yet
      lines.append(f"{head} not yet confirmed (seeds {spec['confirmation_seeds']}) | | | |")
    else:
      lines.append(f"{head} {row[4]} | {row[5]} | {row[6]} | **{row[7]}** |")
  return lines


def testbeds() -> dict[str, list[str]]:
  """{a testbed's settings over configs/countdown.py (claims.json's `testbed`, e.g.
  {"task.name": "addition", "task.digits": 3}; none: the countdown testbed), as JSON: the
  studies on it}."""
  found: dict[str, list[str]] = {}
  for study in studies():
    spec = seed_table.load_claims(os.path.join(HERE, study, "claims.json"))
    found.setdefault(json.dumps(spec.get("testbed", {}), sort_keys=True), []).append(study)
  return found


def trivial_line() -> str:
  """Each testbed's best trivial answer on its held-out split (docs/tasks.md), with its
  studies."""
  from jaxrl_llm import backend

  backend.choose()  # as the trainer does: no backend's start-up chatter on the terminal
  import importlib.util

  from jaxrl_llm.config import parse
  from jaxrl_llm.data.tasks import get_task
  from jaxrl_llm.data.tasks.trivial import trivial_table

  path = os.path.join(os.path.dirname(HERE), "configs", "countdown.py")
  spec = importlib.util.spec_from_file_location("countdown_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  lines = ["Read every accuracy below beside its testbed's best trivial answer:", ""]
  for key, names in testbeds().items():
    cfg = module.get_config()
    for field, value in json.loads(key).items():
      section, name = field.split(".")
      setattr(cfg[section], name, value)
    task = parse(cfg).task
    t = trivial_table(get_task(task.name, **task.task_fields))
    sets = "".join(f" --config.{k}={v}" for k, v in json.loads(key).items())
    lines.append(
      f"- {', '.join(names)}: `{t['best_rule']}` scores {t['best']:.3f} on the {t['n']} "
      f"held-out problems (`python tools/trivial_answers.py --config=configs/countdown.py{sets}`)."
    )
  return "\n".join(lines + _page_trivial_lines())


def _page_trivial_lines() -> list[str]:
  """A line per study page whose claims name a raw `tools/trivial_answers.py` output
  (`trivial_raw`, from the repository's root): its best trivial answer, as that output says."""
  import re

  lines = []
  for study in studies():
    for page in pages(study):
      spec = seed_table.load_claims(os.path.join(HERE, study, f"{page}.claims.json"))
      if "trivial_raw" not in spec:
        continue
      want = "the raw output of tools/trivial_answers.py (trivial_raw, from the repository)"
      text = _read(os.path.join(os.path.dirname(HERE), spec["trivial_raw"]), want)
      best = re.search(r"\((\d+) held-out problems\): best ([\d.]+) \((.+)\)", text)
      if best is None:
        _fail(f"{spec['trivial_raw']}: no `best` line of tools/trivial_answers.py; want {want}")
      command = text.splitlines()[0].removeprefix("# ").split(" (", 1)[0]
      n, score, rule = best.groups()
      lines.append(
        f"- {study}/{page}: `{rule}` scores {score} on the {n} held-out problems its evaluation "
        f"scores (`{command}`; raw output: `{spec['trivial_raw']}`)."
      )
  return lines


def render(readme: str) -> str:
  """`readme` with the generated block between the markers."""
  if BEGIN not in readme or END not in readme:
    _fail(
      f"experiments/README.md lacks the markers {BEGIN!r} and {END!r}; put them around the table"
    )
  head, rest = readme.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return f"{head}{BEGIN}\n{trivial_line()}\n\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
  """Writes (or with --check compares) the table in experiments/README.md."""
  if argv not in ([], ["--check"]):
    print(f"error: unexpected arguments {argv}; usage: summary.py [--check]", file=sys.stderr)
    return 2
  path = os.path.join(HERE, "README.md")
  old = _read(path, "experiments/README.md with the cross-study table's markers")
  new = render(old)
  if argv == ["--check"]:
    if new != old:
      print(
        f"{path}: the cross-study table is stale; run python experiments/summary.py",
        file=sys.stderr,
      )
      return 1
    return 0
  with open(path, "w") as f:
    f.write(new)
  print(json.dumps({"written": path, "studies": len(studies())}))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
