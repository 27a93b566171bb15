"""The adapter memory tables of docs/training.md and docs/sweeps.md are the plans committed under
docs/cpu_runs/memory_adapters/ (`tools/memory_table.py`'s JSON lines): every row that is not
marked as an earlier head's names a plan there, and its arguments, temp, peak and verdict are
that plan's, at the 0.1 GiB the tables print."""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO

DOCS = REPO / "docs"
RAW = DOCS / "cpu_runs" / "memory_adapters"
SHAPES = {"Qwen2.5-7B": "qwen2.5-7b", "Qwen2.5-14B": "qwen2.5-14b", "Qwen2.5-32B": "qwen2.5-32b"}
SHAPES["Qwen3-30B-A3B"] = "qwen3-30b-a3b"
TARGETS = {  # the devices column -> memory_table's target
  "1 x 80 GB": "cpu:1",
  "8 x 80 GB, fsdp 8": "cpu:8:fsdp=8",
  "8 x 80 GB, fsdp 2 x model 4": "cpu:8:fsdp=2:model=4",
  "TPU v5p-8 (4 chips), fsdp 4": "tpu:v5p-8",
  "TPU v5p-8 (4 chips), model 4": "tpu:v5p-8:model=4",
}


def _plans() -> list[dict]:
  return [json.loads(line) for p in sorted(RAW.glob("*.jsonl")) for line in p.open()]


def _plan(shape: str, target: str, int8: bool, runs=None, sequences: int = 64) -> dict:
  """The one committed plan of these settings."""
  found = [
    p
    for p in _plans()
    if (p["shape"], p["target"], p["runs"], p["sequences"]) == (shape, target, runs, sequences)
    and ("model.lora_base_dtype=int8" in p["overrides"]) == int8
    and "model.lora_rank=16" in p["overrides"]
  ]
  assert len(found) == 1, (shape, target, int8, runs, sequences, len(found))
  return found[0]


def _gib(cell: str) -> float:
  return float(re.fullmatch(r"([\d.]+) GiB", cell.strip("* ")).group(1))


def _same(row: list[str], plan: dict) -> None:
  """Arguments, temp, peak (GiB, 0.1) and the verdict of a table row are `plan`'s."""
  args, temp, peak, fits = row
  for cell, key in ((args, "argument_gib"), (temp, "temp_gib"), (peak, "peak_estimate_gib")):
    assert _gib(cell) == round(plan[key], 1), (row, key, plan[key])
  assert fits.startswith("yes" if plan["fits"] else "no"), (row, plan["fits"])


def _rows(page: str, header: str) -> list[list[str]]:
  lines = (DOCS / page).read_text().splitlines()
  start = lines.index(header) + 2
  out = []
  for line in lines[start:]:
    if not line.startswith("|"):
      break
    out.append([c.strip() for c in line.strip("|").split("|")])
  return out


def test_the_adapter_table_is_the_committed_plans():
  """docs/training.md's table of adapter runs at 64 x (512 + 4,096) tokens: each row is the
  committed plan of its shape, devices and base (32 sequences: `rl.num_prompts=4`)."""
  header = "| shape | devices | base | arguments | temp | peak | capacity | fits |"
  rows = _rows("training.md", header)
  assert len(rows) == 14
  for shape_cell, devices, base, args, temp, peak, capacity, fits in rows:
    name = shape_cell.split(" (")[0]
    sequences = 32 if "32 sequences" in shape_cell else 64
    plan = _plan(SHAPES[name], TARGETS[devices], base == "int8", sequences=sequences)
    _same([args, temp, peak, fits], plan)
    assert _gib(capacity) == round(plan["capacity_gib"], 1)


def test_the_adapter_pack_table_is_the_committed_plans():
  """docs/sweeps.md's packs of 7B adapter runs on one 80 GB GPU: the rows of this head (not
  those marked "before") are the committed plans of a single run and packs of 2, 3 and 4."""
  rows = _rows("sweeps.md", "| runs | arguments | temp | peak | fits 74.5 GiB |")
  current = [r for r in rows if "before" not in r[0]]
  assert [r[0].split(" (")[0] for r in current] == ["1", "pack of 2", "pack of 3", "pack of 4"]
  for row in current:
    runs = None if row[0].startswith("1") else int(row[0].split()[-1])
    _same(row[1:], _plan("qwen2.5-7b", "cpu:1", True, runs=runs))
  text = (DOCS / "sweeps.md").read_text()
  assert "no raw output was" in text.split("| runs | arguments")[1].split("\n\n", 2)[1]


@pytest.mark.parametrize("page", ["training.md", "sweeps.md"])
def test_the_pages_link_the_raw_plans(page):
  assert "cpu_runs/memory_adapters/" in (DOCS / page).read_text()
