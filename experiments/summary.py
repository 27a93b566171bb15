"""The cross-study table of experiments/README.md, generated from each study's declared claims
(claims.json) and its confirmation on fresh seeds (confirmation.md, printed by its run.sh with
CONFIRM=1), with each testbed's best trivial answer above it.

  python experiments/summary.py           # rewrites the table in experiments/README.md
  python experiments/summary.py --check   # exits 1 naming the file when the table is stale

A confirmation's claims table must be that of the claims file as it is now (the same claim ids,
each with the statement, `a − b` and expected sign it was confirmed with): a claim edited, added
or removed since is refused in one line naming the study, the claim and what differs, never
printed beside a verdict worded for another claim or Holm family. A claims file without its
`confirmation_seeds`, or with a `testbed` that is not settings over configs/countdown.py, is
refused the same way.

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


TESTBED = (
  'a JSON object {"section.field": value, ...} of settings over configs/countdown.py, each a '
  'field it has at a value it allows (e.g. {"task.name": "addition", "task.digits": 3}); no '
  "testbed: countdown"
)


def load(path: str) -> dict:
  """`seed_table.load_claims(path)` with the fields summary.py reads checked too: its
  `confirmation_seeds` ("A-B") and, where given, the shape of its `testbed` (`TESTBED`); a
  malformed one exits 2 with one line naming the file and the field."""
  spec = seed_table.load_claims(path)
  want = 'the fresh seeds its confirmation trains, a string "A-B" (e.g. "100-123")'
  if "confirmation_seeds" not in spec:
    _fail(f"{path}: missing 'confirmation_seeds'; want {want}")
  seeds = spec["confirmation_seeds"]
  span = re.fullmatch(r"(\d+)-(\d+)", seeds) if isinstance(seeds, str) else None
  if span is None or int(span[1]) > int(span[2]):
    _fail(f"{path}: 'confirmation_seeds' is {json.dumps(seeds)}; want {want}")
  testbed = spec.get("testbed", {})
  if not isinstance(testbed, dict):
    _fail(f"{path}: 'testbed' is {json.dumps(testbed)}; want {TESTBED}")
  for field in testbed:
    if not re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", field):
      _fail(f"{path}: testbed setting {field!r} is no section.field; want {TESTBED}")
  return spec


def studies() -> list[str]:
  """The study folders (those with a run.sh), sorted."""
  return sorted(d for d in os.listdir(HERE) if os.path.isfile(os.path.join(HERE, d, "run.sh")))


def pages(study: str) -> list[str]:
  """The study's pages with claims of their own (`<page>.claims.json` beside `<page>.md`)."""
  suffix = ".claims.json"
  names = os.listdir(os.path.join(HERE, study))
  return sorted(n.removesuffix(suffix) for n in names if n.endswith(suffix))


CLAIMS_TABLE = ["claim", "statement", "a − b", "expected", "difference", "n", "p", "verdict"]


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
      if _cells(line)[-4:] != CLAIMS_TABLE[-4:]:  # the columns the cross-study table reads
        _fail(
          f"{path}: the claims table's header is {line.strip()!r}; seed_table.py --claims "
          f"prints | {' | '.join(CLAIMS_TABLE)} |"
        )
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
      spec = load(os.path.join(HERE, study, claims))
      done = confirmed(study, results)
      check_confirmed(name, f"{study}/{results}.md", f"{study}/{claims}", spec, done)
      lines += _rows(f"[{name}]({study}/{page}.md)", spec, done)
  return "\n".join(lines)


def printed(claim: dict) -> dict[str, str]:
  """{cell: its text} of the cells seed_table.py's claims table (`_claims_table`) prints for a
  declared `claim` as worded, bars unescaped: its statement, `a − b` and expected sign."""
  a, b = (f"{','.join(map(str, x['arm']))} {x['col']}" for x in (claim["a"], claim["b"]))
  if "count" in claim:
    a, b = (f"seeds with {x} <= {claim['count']['at_most']}" for x in (a, b))
  sign = claim["direction"]
  return {"statement": claim["claim"].strip(), "a − b": f"{a} − {b}", "expected sign": sign}


def check_confirmed(name: str, page: str, claims: str, spec: dict, done: dict) -> None:
  """Exits 2 naming the study, the claim and what differs when the claims table printed into
  `page` (`done`: `confirmed`'s rows) is not that of the claims file `claims` (`spec`) as it is
  now: a claim added, removed or renamed since (the Holm family its verdicts were corrected
  over is another), or one whose statement, arms, columns, count or expected sign changed (its
  verdict was worded for the claim as confirmed). No table yet: nothing to match."""
  if not done:
    return
  root = os.path.dirname(HERE)
  page, claims = (os.path.relpath(os.path.join(HERE, p), root) for p in (page, claims))
  redo = f"a claim changed since needs a new confirmation on fresh seeds, or restore {claims}"
  ids = [c["id"] for c in spec["claims"]]
  if added := [i for i in ids if i not in done]:
    _fail(
      f"study {name}: claim {added[0]!r} of {claims} is not in the claims table of "
      f"{page} (added or renamed since: the verdicts there were Holm-corrected over another "
      f"family); {redo}"
    )
  if gone := [i for i in done if i not in ids]:
    _fail(
      f"study {name}: the claims table of {page} words claim {gone[0]!r}, which "
      f"{claims} no longer declares (removed or renamed since: the Holm family of its "
      f"verdicts is another); {redo}"
    )
  for c in spec["claims"]:
    row = [cell.replace("\\|", "|") for cell in done[c["id"]]]
    for (what, now), then in zip(printed(c).items(), row[1:4]):
      if now != then:
        _fail(
          f"study {name}: claim {c['id']!r}: its {what} reads {_clip(then, now)!r} in "
          f"{page} but {_clip(now, then)!r} in {claims} now (its verdict was "
          f"worded for the claim as confirmed); {redo}"
        )


def _clip(text: str, other: str) -> str:
  """`text` around its first difference from `other` (all of it when short)."""
  if len(text) <= 60:
    return text
  at = next((i for i, (x, y) in enumerate(zip(text, other)) if x != y), min(len(text), len(other)))
  start, end = max(0, at - 20), at + 40
  return f"{'…' * (start > 0)}{text[start:end]}{'…' * (end < len(text))}"


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
    spec = load(os.path.join(HERE, study, "claims.json"))
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
    settings = json.loads(key)
    try:
      for field, value in settings.items():
        section, name = field.split(".")
        sections = sorted(k for k in cfg if hasattr(cfg[k], "keys"))
        if section not in sections:
          raise KeyError(f"{field!r}: no section {section!r} (sections: {', '.join(sections)})")
        if name not in cfg[section]:
          fields = ", ".join(sorted(cfg[section]))
          raise KeyError(f"{field!r}: section {section!r} has no {name!r} (fields: {fields})")
        setattr(cfg[section], name, value)
      task = parse(cfg).task
      built = get_task(task.name, **task.task_fields)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # ConfigError: a ValueError
      why = " ".join(str(e.args[0] if isinstance(e, KeyError) else e).split())
      path = os.path.join(HERE, names[0], "claims.json")
      _fail(f"{path}: testbed {key}: {why}; want {TESTBED}")
    t = trivial_table(built)
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
      spec = load(os.path.join(HERE, study, f"{page}.claims.json"))
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
  rows = table()  # first: a claims file or confirmation refused before any testbed is built
  return f"{head}{BEGIN}\n{trivial_line()}\n\n{rows}\n{END}{tail}"


def main(argv: list[str]) -> int:
  """Writes (or with --check compares) the table in experiments/README.md."""
  if argv in (["--help"], ["-h"]):
    print(__doc__)
    return 0
  if argv not in ([], ["--check"]):
    print(
      f"error: unexpected arguments {argv}; usage: summary.py [--check | --help]", file=sys.stderr
    )
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
