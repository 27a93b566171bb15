"""The figures of README.md's results, docs/real_model.md and docs/performance.md against the raw
outputs committed beside them (docs/cpu_runs/, docs/gpu_runs/): each number of a result
statement is a raw value, or derived from raw values as this file shows, at the precision the
text gives it; a figure whose raw output was never committed says so in the text."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import pathlib
import re

from conftest import REPO

CPU = REPO / "docs" / "cpu_runs"
GPU = REPO / "docs" / "gpu_runs"

# A statement whose figures have no committed raw output carries this phrase; one that carries
# SECTION_MARK speaks for every statement of its section (down to the next heading of its level).
MARK = "no raw output was committed"
SECTION_MARK = "for any figure in this section"

# --- reading a page into statements and figures -------------------------------------------------


@dataclasses.dataclass
class Statement:
  key: str  # its first line, markdown emphasis removed
  text: str
  unsourced: bool
  table_rows: list[str]
  section: str  # the heading above it


@dataclasses.dataclass
class Figure:
  text: str  # as written: "12.70", "345 s", "28%", "30 min 23 s"
  value: float
  half_unit: float  # half of the last digit written
  unit: str


def _plain(line: str) -> str:
  return line.replace("**", "").replace("*", "").strip()


def _statements(page: str) -> list[Statement]:
  """The page's statements: each prose block (lines up to a blank line) with the tables right
  after it, or a table alone under its heading. Fenced code (commands) and headings are not
  statements. A statement carrying MARK is `unsourced`; one carrying SECTION_MARK makes itself
  and the rest of its section (to the next heading of its level or above) `unsourced`."""
  lines = (REPO / page).read_text().splitlines()
  blocks, block, fenced = [], [], False
  for line in [*lines, ""]:
    if line.startswith("```"):
      fenced = not fenced
      continue
    if fenced:
      continue
    if line.strip() and not line.startswith("#"):
      block.append(line)
      continue
    if block:
      blocks.append(block)
      block = []
    if line.startswith("#"):
      blocks.append([line])
  out: list[Statement] = []
  level, section_level, section_unsourced, section = 0, 0, False, ""
  for block in blocks:
    if block[0].startswith("#"):
      level = len(block[0]) - len(block[0].lstrip("#"))
      section = block[0].lstrip("#").strip()
      out.append(Statement(section, "", False, [], section))  # a table below is not the prose's
      if section_unsourced and level <= section_level:
        section_unsourced = False
      continue
    is_table = all(x.startswith("|") for x in block)
    if is_table and out and out[-1].text and not out[-1].key.startswith("|"):
      out[-1].text += "\n" + "\n".join(block)
      out[-1].table_rows += block
      continue
    text = "\n".join(block)
    if SECTION_MARK in " ".join(text.split()):
      section_unsourced, section_level = True, level
    out.append(
      Statement(_plain(block[0]), text, section_unsourced, block if is_table else [], section)
    )
  for s in out:
    s.unsourced = s.unsourced or MARK in " ".join(s.text.split())
  return out


NUM = r"\d+(?:,\d{3})*(?:\.\d+)?(?:e[-−]?\d+)?"
UNIT = r"(?:\s?(?:s|ms|us|µs|min|minutes|GB|GiB|MB|MiB|TFLOP/s|TB/s)|%|x)(?![\w/])"
# What is not a result wherever it stands: dates, clock times, versions, model sizes by name
# (0.5B, 135M) and goals (>= 10x). A batch's `16 x 8` is no figure either: `x` is a unit only
# joined to its number (11.6x).
NOT_RESULTS = [
  r"\d{4}-\d{2}-\d{2}",
  r"\d{1,2}:\d{2}(?::\d{2})?",
  r"\d+\.\d+\.\d+\S*",
  r"(?:TRL|torch|transformers|jax|JAX|flax|Python|peft) \d+\.\d+(?!\.?\d| ?(?:s|GB|x)\b)",
  rf"(?<![\w.]){NUM}[BM]\b",
  rf"[<>]= ?{NUM}\S*",
]


def _scrub(text: str, settings: list[str], headers: bool = True) -> str:
  """`text` without code spans, link targets, table header rows (a table's first row, where
  `headers`), the NOT_RESULTS patterns and the page's settings phrases."""
  lines = text.splitlines()
  keep, previous = [], ""
  for line in lines:
    header = headers and not previous.startswith("|")
    if line.startswith("|") and (re.fullmatch(r"[|\s:-]+", line) or header):
      previous = line
      continue  # a table's header or separator row
    previous = line
    keep.append(line)
  text = "\n".join(keep).replace("**", "")
  text = re.sub(r"`[^`]*`", " ", text)
  text = re.sub(r"\]\([^)]*\)", "]", text)
  for pattern in [*NOT_RESULTS, *settings]:
    text = re.sub(pattern, " ", text)
  return text


def _figure(number: str, unit: str = "", text: str = "") -> Figure:
  plain = number.replace(",", "").replace("−", "-")
  mantissa, _, exponent = plain.partition("e")
  decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
  half = 0.5 * 10.0 ** (-decimals) * 10.0 ** int(exponent or 0)
  return Figure(text or number, float(plain), half, unit)


def _numbers(text: str, settings: list[str], headers: bool = True) -> list[Figure]:
  """The figures of a statement: each decimal number; each whole number with a unit (s, min,
  %, x, GB, ...), counted (`N of M`), in a list or chain beside decimals (`0 → 0.016 / 0`) or
  alone in a table cell. Durations written `M min S s` are one figure in seconds."""
  text = _scrub(text, settings, headers)
  figures: list[Figure] = []

  def take(pattern: str, make) -> None:
    nonlocal text

    def sub(m: re.Match) -> str:
      figures.extend(make(m))
      return " " * len(m.group(0))

    text = re.sub(pattern, sub, text)

  start = r"(?<![\w.])(?<![A-Za-z]-)"
  take(
    rf"{start}(\d+) min\s+(\d+) s\b",
    lambda m: [Figure(m.group(0), 60 * int(m.group(1)) + int(m.group(2)), 0.5, "s")],
  )
  joined = r"(?:-|\s*(?:/|,|and|→|->)\s*)"
  take(
    rf"{start}{NUM}(?:{joined}{NUM})*{UNIT}",
    lambda m: [
      _figure(n, unit := re.search(rf"{UNIT}$", m.group(0)).group(0).strip(), f"{n} {unit}")
      for n in re.findall(NUM, m.group(0))
    ],
  )
  take(rf"{start}({NUM}) of \d+", lambda m: [_figure(m.group(1), "count", m.group(0))])
  chain = rf"{start}{NUM}(?:\s*(?:→|->|/|,|and)\s*{NUM})+(?![\w.])"
  take(
    chain,
    lambda m: (
      [_figure(n) for n in re.findall(NUM, m.group(0))] if re.search(r"\d[.e]", m.group(0)) else []
    ),
  )
  take(rf"(?<=\| ){NUM}(?= \|)", lambda m: [_figure(m.group(0))])
  take(
    rf"{start}\d+(?:\.\d+)?e[-−]?\d+|{start}\d+\.\d+(?![\w.]*\d)", lambda m: [_figure(m.group(0))]
  )
  return figures


# --- raw outputs -------------------------------------------------------------------------------

# How a figure's unit may scale a raw value: bytes to GB or GiB, seconds to ms or minutes, a
# fraction to %, ms to us, FLOP/s to TFLOP/s (a value already in the unit scales by 1).
SCALES = {
  "GB": (1, 1e-9), "GiB": (1, 2**-30), "MB": (1, 1e-6), "MiB": (1, 2**-20),
  "ms": (1, 1e3), "us": (1, 1e3), "µs": (1, 1e3), "min": (1, 1 / 60), "minutes": (1, 1 / 60),
  "%": (1, 100), "TFLOP/s": (1, 1e-12), "TB/s": (1, 1e-12),
}  # fmt: skip


def _matches(figure: Figure, pool: list[float]) -> bool:
  """Some raw value, in the figure's unit, rounds to the figure as written."""
  scales = SCALES.get(figure.unit, (1,))
  tolerance = figure.half_unit * (1 + 1e-9) + 1e-12
  return any(abs(v * k - figure.value) <= tolerance for v in pool for k in scales)


@functools.cache
def _values(path: pathlib.Path) -> tuple[float, ...]:
  """Every number of a raw file: a JSON or JSON-lines file's numeric leaves, else each number
  of its text (an `h:mm:ss` duration in seconds)."""
  text = path.read_text()
  if path.suffix in (".json", ".jsonl"):
    out: list[float] = []

    def walk(x) -> None:
      if isinstance(x, dict):
        x = list(x.values())
      if isinstance(x, list):
        for y in x:
          walk(y)
      elif isinstance(x, (int, float)) and not isinstance(x, bool):
        out.append(float(x))

    for line in [text] if path.suffix == ".json" else text.splitlines():
      walk(json.loads(line))
    return tuple(out)
  hms = [
    3600 * int(h) + 60 * int(m) + int(s) for h, m, s in re.findall(r"(\d+):(\d\d):(\d\d)", text)
  ]
  numbers = re.findall(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?", text)
  return (*(float(n.replace(",", "")) for n in numbers), *hms)


@functools.cache
def _scalars(run: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  return {
    tag: [(int(s), float(v)) for s, v in rows]
    for tag, rows in json.loads((run / "scalars.json").read_text()).items()
  }


def _tags(run: pathlib.Path, *tags: str) -> list[float]:
  """A run's logged values of `tags` (scalars.json), at every step."""
  return [v for tag in tags for _, v in _scalars(run)[tag]]


def _final(run: pathlib.Path, tag: str = "eval/accuracy") -> float:
  return _scalars(run)[tag][-1][1]


def _block_means(run: pathlib.Path, tag: str, size: int = 50) -> list[float]:
  """Means of a tag over blocks of `size` updates (1-50, 51-100, ...)."""
  rows = _scalars(run)[tag]
  blocks: dict[int, list[float]] = {}
  for step, v in rows:
    blocks.setdefault((step - 1) // size, []).append(v)
  return [sum(b) / len(b) for _, b in sorted(blocks.items())]


def _wall_times(*logs: pathlib.Path) -> list[float]:
  """The trainer's `wall time h:mm:ss` of each run log, in seconds."""
  out = []
  for log in logs:
    (h, m, s), *_ = re.findall(r"wall time (\d+):(\d\d):(\d\d); workdir", log.read_text())
    out.append(3600 * int(h) + 60 * int(m) + int(s))
  return out


SMOL_H200 = GPU / "2026-12-04_h200_smollm2"


def _smollm2_h200() -> list[float]:
  """The real model's GPU run beside TRL: the summary (curves side by side, step times, each
  command's seconds), the trivial answers, TRL's settings and curve, each trainer log's RL-loop
  and compile times in seconds, its learner's slices, and the packed pair's printed tables (not
  its log lines)."""
  times = []
  for log in (SMOL_H200 / "ours.log", SMOL_H200 / "pack" / "pack.log"):
    for hms in re.findall(
      r"trained RL steps \S+ in (\d+:\d\d:\d\d) \(the RL loop, of which "
      r"(\d+:\d\d:\d\d)",
      log.read_text(),
    ):
      for t in hms:
        h, m, sec = map(int, t.split(":"))
        times.append(3600 * h + 60 * m + sec)
  tables = [
    float(x)
    for line in (SMOL_H200 / "pack" / "pack.log").read_text().splitlines()
    if not re.match(r"[IWE]\d{4} ", line)
    for x in re.findall(rf"(?<![\w.=]){NUM}(?![\w.])", line)
  ]
  slices = re.findall(r"learner: (\d+) microbatch", (SMOL_H200 / "ours.log").read_text())
  return [
    *map(float, slices),
    *_values(SMOL_H200 / "summary.txt"),
    *_values(SMOL_H200 / "setup.log"),
    *_values(SMOL_H200 / "trl_arith.json"),
    *times,
    *tables,
  ]


# The best trivial answer on the 64 evaluated problems, a constant (trivial_evaluated.txt).
BEST_TRIVIAL_64 = 3 / 64


def _learned(*runs: pathlib.Path) -> int:
  """How many runs end above the best trivial answer on their 64 held-out problems."""
  return sum(_final(r) > BEST_TRIVIAL_64 for r in runs)


CALC = [CPU / "smollm2_calc" / f"calc_s{s}" for s in range(4)]
NONE = [CPU / "smollm2_calc" / f"none_s{s}" for s in range(4)]
FORMAT = [CPU / "smollm2_calc_format" / f"fmt0.2_s{s}" for s in range(4, 8)]
NO_FORMAT = [CPU / "smollm2_calc_format" / f"fmt0.0_s{s}" for s in range(4, 8)]
COMMAND3 = CPU / "smollm2_command3" / "smollm2"
LORA400 = CPU / "smollm2_lora_400"
DEFAULT = CPU / "default_run" / "default"


def _answer_12_shares() -> list[float]:
  """Per block of 50 updates of the 400-update run, the share of its logged samples that are
  the bare line `Answer: 12.`, and their count."""
  blocks: dict[int, list[bool]] = {}
  for line in (LORA400 / "samples.jsonl").read_text().splitlines():
    sample = json.loads(line)
    blocks.setdefault((sample["step"] - 1) // 50, []).append(
      sample["completion"].strip() == "Answer: 12."
    )
  return [f(b) for _, b in sorted(blocks.items()) for f in (sum, lambda b: sum(b) / len(b))]


def _scan_times() -> list[float]:
  """Scanned and unrolled (smollm2_scan_vs_unrolled.txt): the first evaluation with its
  compilation, the RL step's compilation with its first update (the log's `first update done
  in`, which then counted the evaluation too, less the evaluation), and each later update
  (the time between its log line and the one before)."""
  out = []
  for run in (CPU / "smollm2_scan_vs_unrolled.txt").read_text().split("## ")[1:]:
    evaluation = float(re.search(r"eval step 0: .*\(([\d.]+)s\)", run).group(1))
    first = float(re.search(r"first update done in ([\d.]+)s", run).group(1))
    clock = [
      3600 * int(h) + 60 * int(m) + float(s)
      for h, m, s in re.findall(r" (\d\d):(\d\d):([\d.]+) .* step \d/3 ", run)
    ]
    out += [evaluation, first - evaluation, *(b - a for a, b in itertools.pairwise(clock))]
  return out


def _run_log_summary(run: pathlib.Path) -> list[float]:
  """The numbers of a run log's closing summary line (`trained RL steps ... steps/s`)."""
  line = next(x for x in (run / "run.log").read_text().splitlines() if "trained RL steps" in x)
  return [float(n) for n in re.findall(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", line.split("] ", 1)[1])]


# Qwen2.5-0.5B's parameters from its shape (tools/bench.py's `qwen2.5-0.5b`): V 151936, D 896,
# 24 layers of 14 / 2 heads of 64 with qkv bias, MLP 4864, RMSNorm weights, tied output layer.
V, D, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 151936, 896, 24, 14, 2, 64, 4864
QWEN05_PARAMS = V * D + D + LAYERS * (
  D * HEADS * HEAD_DIM + HEADS * HEAD_DIM  # q with bias
  + 2 * (D * KV_HEADS * HEAD_DIM + KV_HEADS * HEAD_DIM)  # k, v with bias
  + HEADS * HEAD_DIM * D  # o
  + 3 * D * MLP  # gate, up, down
  + 2 * D  # two norms
)  # fmt: skip
# Qwen2.5-7B's (tools/memory_table.py's `qwen2.5-7b`): V 152064, D 3584, 28 layers of 28 / 4
# heads of 128 with qkv bias, MLP 18944, untied output layer.
V7, D7, Q7, KV7 = 152064, 3584, 28 * 128, 4 * 128
QWEN7_PARAMS = (
  2 * V7 * D7 + D7 + 28 * (2 * D7 * Q7 + Q7 + 2 * (D7 * KV7 + KV7) + 3 * D7 * 18944 + 2 * D7)
)
GROUPED_FLOP = 2 * 16384 * 1024 * 384  # the grouped matmul's forward at M=16,384, K=1,024, N=384


def _qwen05_memory() -> list[float]:
  """The peak-memory paragraph's arithmetic, in bytes and ratios: float32 weights with Adam's
  two moments (12 bytes a parameter), the gradient the global-norm clip holds (4 more), the
  bf16 sampler copy (2), against TRL's peak and ours (TRL's / the peak ratio) of the 2026-11-26
  run (its README quotes the JSON)."""
  notes = (GPU / "2026-11-26_h200" / "README.md").read_text()
  trl = float(re.search(r'"peak_memory_bytes": (\d+)', notes).group(1))
  ratio = float(re.search(r'"peak_memory": ([\d.]+)', notes).group(1))
  ours, state, held = trl / ratio, 12 * QWEN05_PARAMS, 16 * QWEN05_PARAMS
  return [
    state,
    state / trl,
    4 * QWEN05_PARAMS,
    held,
    held / trl,
    ours - held,
    trl - held,
    2 * QWEN05_PARAMS,
  ]


def _grouped() -> list[float]:
  """The grouped matmul runs of both days (their JSON lines), and from the 2026-11-27 sweep each
  kernel's fastest and in-use time with its TFLOP/s by CUPTI (the forward's FLOP: each
  gradient kernel does as many)."""
  sweep = [
    json.loads(x)
    for x in (GPU / "2026-11-27_h200" / "grouped_sweep.jsonl").read_text().splitlines()
  ]
  times = [r[k] for r in sweep if "fastest" in r for k in ("fastest_ms", "in_use_ms")]
  runs = [GPU / "2026-11-26_h200" / f"grouped_call{i}.jsonl" for i in (1, 2)]
  runs.append(GPU / "2026-11-27_h200" / "grouped.jsonl")
  return [
    *(v for r in runs for v in _values(r)),
    *times,
    *(GROUPED_FLOP / (t * 1e-3) for t in times),
  ]


def _spec_sheets() -> list[float]:
  """tools/bench.py's table of device limits (HBM bytes/s, dense bf16 FLOP/s)."""
  table = re.findall(r'\("h\d+", ([\d.e]+), ([\d.e]+)\)', (REPO / "tools" / "bench.py").read_text())
  return [float(x) for row in table for x in row]


MEMORY = CPU / "memory_tables"


@functools.cache
def _plan_rows(name: str) -> dict[tuple[str, str], dict]:
  """tools/memory_table.py's JSON rows of a committed run (memory_tables/NAME.stdout.txt), by
  (shape, target)."""
  lines = (MEMORY / f"{name}.stdout.txt").read_text().splitlines()
  rows = [json.loads(x) for x in lines if x.startswith("{")]  # then the markdown table
  return {(r["shape"], r["target"]): r for r in rows}


def _guard_plans() -> list[dict]:
  """The plan rows of cpu_runs/guard_memory/ (its *.jsonl and its saved tool outputs)."""
  folder = CPU / "guard_memory"
  lines = [x for f in sorted(folder.glob("*.jsonl")) for x in f.read_text().splitlines()]
  lines += [x for f in sorted(folder.glob("*.stdout.txt")) for x in f.read_text().splitlines()]
  return [json.loads(x) for x in lines if x.startswith("{")]


def _plan_values(*rows: dict) -> list[float]:
  """The printed numbers of plan rows, each figure in GiB also in bytes (a figure in GB), and by
  how much a row's peak exceeds its capacity."""
  out = []
  for r in rows:
    for k, v in r.items():
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        out += [float(v), *([v * 2**30] if k.endswith("_gib") else [])]
    if r.get("capacity_gib"):
      out.append(r["peak_estimate_gib"] - r["capacity_gib"])
  return out


# --- the pages ---------------------------------------------------------------------------------


def _check(
  page: str,
  sources: dict,
  settings: list[str],
  unsourced: int,
  without_results: dict[str, str] | None = None,
  sections: tuple[str, ...] = (),
) -> None:
  """Every figure of every statement of `page` (of `sections` only, when given) is in the pool
  of the raw outputs its SOURCES key names; statements marked MARK are counted, not checked;
  `without_results` names statements whose figures are configuration. A statement key starting
  with `| ` is one table row."""
  text = (REPO / page).read_text()
  stale = [p for p in settings if not re.search(p, text)]
  assert not stale, f"{page}: settings rules that match nothing: {stale}"
  without_results = without_results or {}
  units = []
  for st in _statements(page):
    if sections and st.section not in sections:
      continue
    for row in [r for r in st.table_rows if any(r.startswith(k) for k in sources if k[0] == "|")]:
      units.append(Statement(_plain(row), row, st.unsourced, [row], st.section))
      st.text = st.text.replace(row + "\n", "").replace("\n" + row, "")
    units.append(st)
  problems, used = [], set()
  for st in units:
    figures = _numbers(st.text, settings, headers=st.key[0] != "|")
    if st.unsourced or not figures:
      continue
    keys = [k for k in [*sources, *without_results] if st.key.startswith(k)]
    if len(keys) != 1:
      problems.append(
        f"figures {[f.text for f in figures]} in a statement no SOURCES key names: {st.key[:70]!r}"
      )
      continue
    used.add(keys[0])
    if keys[0] in without_results:
      continue
    pool = list(sources[keys[0]]())
    missing = [f.text for f in figures if not _matches(f, pool)]
    if missing:
      problems.append(f"{st.key[:60]!r}: {missing} are in no raw output it names")
  assert not problems, f"{page}:\n" + "\n".join(problems)
  marks = " ".join(text.split()).count(MARK)
  assert marks == unsourced, f"{page}: {marks} places say '{MARK}', the test expects {unsourced}"
  assert used == set(sources) | set(without_results), (
    f"{page}: keys naming no statement: {set(sources) | set(without_results) - used}"
  )


def test_every_figure_of_the_readmes_results_is_a_committed_raw_output():
  """The README's default-run table and each row of its results table: every accuracy, time,
  ratio and count is a value of the raw output the row's page names (scalars, logs, printed
  tables, JSON), or that value's simple derivation below; a row cannot go on stating a figure
  from a run that was superseded or never committed."""
  trivial = [
    *_values(CPU / "smollm2_calc" / "trivial_evaluated.txt"),
    *_values(CPU / "trivial_answers.txt"),
  ]
  calc_tables = [CPU / "smollm2_calc_format" / f for f in ("tables.md", "tables_after_verdict.md")]
  sources = {
    "`configs/default.py` trains": lambda: [
      *_tags(DEFAULT, "eval/accuracy"),
      *_values(CPU / "readme_commands_2026-12-02.txt"),
      *_run_log_summary(DEFAULT),
    ],
    "On another 2-core machine": lambda: _values(CPU / "readme_commands_2026-12-04.txt"),
    "| default run (command 1)": lambda: _tags(DEFAULT, "eval/accuracy"),
    "| SmolLM2-135M-Instruct (command 3)": lambda: [
      *_tags(COMMAND3, "eval/accuracy", "eval/reward/answer_line_format"),
      *trivial,
    ],
    "| the same for 400 updates": lambda: [*_tags(LORA400, "eval/accuracy"), *_answer_12_shares()],
    "| SmolLM2-135M-Instruct on one H200": _smollm2_h200,
    "| SmolLM2-135M-Instruct with an inline calculator": lambda: [
      *(v for r in CALC + NONE for v in _tags(r, "eval/accuracy")),
      *trivial,
      _learned(*CALC),
    ],
    "| the same without the format reward": lambda: [
      *(v for f in calc_tables for v in _values(f)),
      *_values(CPU / "smollm2_calc_collapse" / "table_seeds_8-31.md"),
      _learned(*CALC, *FORMAT),
      _learned(*NO_FORMAT),
    ],
    "| SmolLM2-135M import against transformers": lambda: _values(CPU / "smollm2_parity.txt"),
    "| RL step against TRL's": lambda: [
      *_values(CPU / "smollm2_full_vs_trl.json"),
      *_values(CPU / "smollm2_lora16_vs_trl.json"),
    ],
    # the packed sweep's equality is the tolerance tests/test_pack.py checks it with; where
    # the two part, the 300-step comparison's events
    "| a packed sweep against each run": lambda: [
      *_values(REPO / "tests" / "test_pack.py"),
      *_values(CPU / "pack_vs_alone_300_steps.json"),
    ],
  }
  _check("README.md", sources, [], 0, sections=("What the default run shows", "Results"))


def test_every_figure_of_the_real_model_page_is_a_committed_raw_output():
  """docs/real_model.md: the parity figures, the trivial answers, command 3's table and times,
  the scanned-layers timings, the 400-update run (its table, wall times, entropy, zero-spread
  groups, `Answer: 12.` counts and rollout accuracy per block of 50 updates), the calculator's
  seeds, the format-reward study and the TRL comparison are each a value of the raw output the
  statement links, or its derivation here; figures with none say so in the text."""
  trivial = [
    *_values(CPU / "trivial_answers.txt"),
    *_values(CPU / "smollm2_calc" / "trivial_evaluated.txt"),
  ]
  trl = [*_values(CPU / "smollm2_full_vs_trl.json"), *_values(CPU / "smollm2_lora16_vs_trl.json")]
  evals = ("eval/accuracy", "eval/reward/answer_line_format", "eval/length_mean")
  sources = {
    "The same model as transformers'.": lambda: _values(CPU / "smollm2_parity.txt"),
    "The task": lambda: _values(CPU / "trivial_answers.txt"),
    "What command 3 showed": lambda: [
      *_tags(COMMAND3, *evals),
      *(64 * v for v in _tags(COMMAND3, "eval/accuracy")),  # correct answers of 64
      *trivial,
    ],
    "On 2026-12-02, alone": lambda: [
      *_values(CPU / "readme_commands_2026-12-02.txt"),
      *_tags(COMMAND3, "rollout/reward_mean"),
    ],
    "Scanning the layers": _scan_times,
    "Longer, on this CPU": lambda: [
      *_tags(LORA400, *evals),
      *_wall_times(LORA400 / "run_0_200.log", LORA400 / "run_200_400.log"),
    ],
    "The entropy fell from": lambda: [
      *_block_means(LORA400, "policy/entropy"),
      *_block_means(LORA400, "rollout/zero_std_group_frac"),
      *_block_means(LORA400, "rollout/accuracy"),
      *_answer_12_shares(),
      _final(LORA400),
      500 * _final(LORA400),  # correct answers of 500
      *_values(CPU / "trivial_answers.txt"),
    ],
    "With a calculator in its own working": lambda: [
      *(v for r in CALC + NONE for v in _tags(r, "eval/accuracy")),
      *_values(CPU / "smollm2_calc" / "probe_untrained.txt"),
      *trivial,
      *_wall_times(*(r / "run.log" for r in CALC + NONE)),
    ],
    "Without the format reward": lambda: [
      *_values(CPU / "smollm2_calc_format" / "tables.md"),
      *_values(CPU / "smollm2_calc_format" / "tables_after_verdict.md"),
      *_values(CPU / "smollm2_calc_collapse" / "table_seeds_8-31.md"),
      _learned(*CALC, *FORMAT),
      _learned(*NO_FORMAT),
    ],
    "On one H200, every parameter, beside TRL": _smollm2_h200,
    "Both learn the answer line within 20 updates": _smollm2_h200,
    "Against TRL on this CPU": lambda: trl,
    "Peak host memory is higher on our side": lambda: trl,
  }
  settings = [
    r"logit gap under\s+1e-4",  # the parity test's threshold for a near tie
    r"weight 0\.2\)",  # answer_line_format's reward weight (configs/smollm2_arith.py)
    r"learning rate 2e-4",  # configs/smollm2_arith.py
    r"temperature 0\.7",  # configs/smollm2_arith.py
    r"format reward 0\.2\)",  # the same weight
    r"the format's 0\.2",  # the same weight
    r"4 minibatch updates a\s+rollout",  # tools/gpu_smollm2.sh's pack
  ]
  _check("docs/real_model.md", sources, settings, unsourced=4)


def test_every_figure_of_the_performance_page_is_a_committed_raw_output():
  """docs/performance.md: the CPU benchmark against TRL, the fused projections' A/B, the H200's
  device checks, step figures, grouped-matmul runs and sweep, the 0.5B peak-memory arithmetic
  and the GPU steps' time limits are each a value of the raw output the statement names (or
  its derivation here); each row of the memory plans' tables is its own row of the committed
  tools/memory_table.py run; the spec-sheet limits are tools/bench.py's table; figures with no
  raw output (the H100 decode figures, earlier CPU tables and memory plans) say so in the text."""
  h200 = GPU / "2026-11-26_h200"
  notes = [*_values(h200 / "README.md"), *_values(GPU / "2026-11-27_h200" / "README.md")]
  sources = {
    "Device limits come from a table of spec sheets": _spec_sheets,
    "On the 2-core CPU of the development machine": lambda: [
      *_values(CPU / "bench_tiny_vs_trl.json"),
      *_values(CPU / "bench_medium_vs_trl.json"),
    ],
    "The sampler's fused projections are neutral": lambda: _values(
      CPU / "fused_projections_sampler_ab.txt"
    ),
    "On one NVIDIA H200": lambda: [
      *_values(h200 / "checks_call1.json"),
      *_values(h200 / "checks_call2.json"),
      *_values(h200 / "README.md"),
    ],
    "The first call found the input-gradient kernel's output": lambda: [
      *_values(h200 / "README.md"),
      1 / float(re.search(r'"peak_memory": ([\d.]+)', (h200 / "README.md").read_text()).group(1)),
      *_grouped(),
      *_spec_sheets(),
    ],
    "The peak-memory goal cannot be met": _qwen05_memory,
    "Not measured yet on a GPU": lambda: notes,
    "Where the goals are not met": lambda: [*_values(h200 / "README.md"), *_grouped()],
  }
  # The memory plans: each table row is its own row of the committed run (memory_tables/), the
  # prose around a table the values of its rows (the TPU compiler's temp against the CPU
  # backend's for the same fsdp 8 program; the decode loop's bf16 copy of 7B's weights).
  dense = {**_plan_rows("dense_cpu"), **_plan_rows("dense_tpu")}
  models = {"qwen2.5-0.5b": "0.5B", "qwen2.5-1.5b": "1.5B", "qwen2.5-7b": "7B"}
  layouts = {
    "cpu:1": "1 GPU of 80 GB (CPU proxy)",
    "cpu:8:fsdp=8": "8 GPUs (CPU proxy), fsdp 8",
    "cpu:8:fsdp=4:model=2": "8 GPUs (CPU proxy), fsdp 4 x model 2",
    "tpu:v5e-8": "TPU v5e-8 (8 chips), fsdp 8",
    "tpu:v5p-8": "TPU v5p-8 (4 chips), fsdp 4",
    "tpu:v6e-8": "TPU v6e-8 (8 chips), fsdp 8",
  }
  for (shape, target), r in dense.items():
    sources[f"| {models[shape]} | {layouts[target]} |"] = functools.partial(_plan_values, r)
  tpu_saving = [
    1 - dense[shape, tpu]["temp_gib"] / dense[shape, "cpu:8:fsdp=8"]["temp_gib"]
    for shape in models
    for tpu in ("tpu:v5e-8", "tpu:v6e-8")
  ]
  sources["Qwen2.5 shapes (7B"] = lambda: [
    *_plan_values(*dense.values(), *_guard_plans()),
    *tpu_saving,
  ]
  sources["So 1.5B trains on one"] = lambda: [*_plan_values(*dense.values()), 2 * QWEN7_PARAMS]
  moe = {"float32": _plan_rows("moe_float32"), "bfloat16": _plan_rows("moe_bfloat16")}
  moe_layouts = {
    "cpu:8:expert=8": "expert 8",
    "cpu:8:fsdp=8": "fsdp 8",
    "cpu:8:expert=4:fsdp=2": "expert 4 x fsdp 2",
    "cpu:8:expert=2:fsdp=4": "expert 2 x fsdp 4",
  }
  for dtype, rows in moe.items():
    for target, layout in moe_layouts.items():
      row = rows["qwen3-30b-a3b", target]
      sources[f"| 30B-A3B | {dtype} | {layout} |"] = functools.partial(_plan_values, row)
    # Mixtral's layouts in one row: their values, each figure of a range an end of it
    mixtral = [rows["mixtral-8x7b", t] for t in moe_layouts]
    sources[f"| Mixtral-8x7B | {dtype} | {' / '.join(moe_layouts.values())} |"] = functools.partial(
      _plan_values, *mixtral
    )
  for (_, target), r in _plan_rows("moe_mixtral_16").items():
    layout = " x ".join(a.replace("=", " ") for a in target.split(":")[2:])
    sources[f"| Mixtral-8x7B | bfloat16 | 16 devices: {layout} |"] = functools.partial(
      _plan_values, r
    )
  all_moe = [*moe["float32"].values(), *moe["bfloat16"].values()]
  sources["Both run with R3 replay"] = lambda: _plan_values(*all_moe)
  sources["What the table says"] = lambda: _plan_values(
    *all_moe, *_plan_rows("moe_mixtral_16").values(), *_guard_plans()
  )
  sources["The tool builds the whole fused step"] = lambda: _plan_values(
    *_plan_rows("small_defaults").values()
  )
  sources["Five things make the difference"] = lambda: _plan_values(
    *_plan_rows("remat_none_0.5b").values(), *_plan_rows("remat_full_0.5b").values()
  )
  sources["The fused MoE step also compiles"] = lambda: _plan_values(
    *_plan_rows("moe_e64_tpu").values()
  )
  without_results = {"`--shape` runs a fixed workload": "the benchmark shapes' configuration"}
  settings = [
    r"the 64 MiB that may be sent",  # the device machine's transfer limit
    r"fits one 80 GB card",  # the card's capacity, against the planned peak
    r"A ratio of 0\.5x",  # the goal
    r"(?:above|from)\s+1e8\s+parameters",  # rl.remat=auto's threshold
    r"within\s+90%\s+of\s+the\s+device's",  # rl.microbatch_tokens=auto's headroom
  ]
  text = (REPO / "docs" / "performance.md").read_text()
  assert f"Qwen2.5-0.5B has {QWEN05_PARAMS:,} parameters" in text
  _check("docs/performance.md", sources, settings, unsourced=7, without_results=without_results)
