"""Reading a compiled program's HLO text: which instructions run inside which loop.

Used by tests and `tools/memory_table.py` to show where collectives sit, e.g. that no weight
all-gather runs inside the sampler's decode `while_loop`s (one per `sampling.kv_block` stage,
under `sampling.DECODE_SCOPE`).
"""

from __future__ import annotations

import dataclasses
import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLS = re.compile(
  r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
  r"|\bbranch_computations=\{([^}]*)\}"
)
_OP = re.compile(r"\s([a-z][\w\-]*)\(")  # the opcode: the first ` name(` after the type


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: its name, opcode, result type text and `op_name` metadata."""

  name: str
  opcode: str
  shape: str
  op_name: str
  line: str


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
  """Instructions of every computation in `hlo_text` (a compiled program's `as_text()`)."""
  out: dict[str, list[Instruction]] = {}
  current = None
  for raw in hlo_text.splitlines():
    line = raw.strip()
    m = _COMPUTATION.match(line)
    if m and "=" not in line.split("(")[0]:
      current = m.group(1)
      out[current] = []
      continue
    if line == "}":
      current = None
      continue
    if current is None or "=" not in line:
      continue
    name = line.split("=", 1)[0].strip().lstrip("%").replace("ROOT ", "").strip()
    op = _OP.search(line.split("=", 1)[1])
    meta = re.search(r'op_name="([^"]*)"', line)
    shape = line.split("=", 1)[1].strip().split(" ")[0]
    out[current].append(
      Instruction(name, op.group(1) if op else "", shape, meta.group(1) if meta else "", line)
    )
  return out


def _called(inst: Instruction) -> list[str]:
  names: list[str] = []
  for m in _CALLS.finditer(inst.line):
    if m.group(1):
      names.append(m.group(1))
    else:
      names += [n.strip().lstrip("%") for n in m.group(2).split(",")]
  return names


def loop_instructions(hlo_text: str, scope: str) -> list[Instruction]:
  """Every instruction that runs inside the `while` loops whose `op_name` contains `scope`
  (their bodies and conditions, and what those call, transitively)."""
  comps = computations(hlo_text)
  roots = [
    n
    for insts in comps.values()
    for i in insts
    if i.opcode == "while" and scope in i.op_name
    for n in _called(i)
  ]
  seen: set[str] = set()
  stack = list(roots)
  while stack:
    c = stack.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for i in comps[c]:
      stack.extend(_called(i))
  return [i for c in seen for i in comps[c]]


def collectives(instructions: list[Instruction], kind: str = "all-gather") -> list[Instruction]:
  """The instructions of a collective kind (`all-gather`, `all-reduce`, ...; async starts too)."""
  return [i for i in instructions if i.opcode in (kind, f"{kind}-start")]
