"""Structure the learner keeps: short module-level functions, no deep closures, no cycles."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "jaxrl_llm"
RL_FILES = sorted((PKG / "rl").glob("*.py"))
PACKAGE_FILES = sorted(PKG.rglob("*.py"))


def _functions(tree: ast.AST, depth: int = 0):
  """(name, line count, nesting depth) of every def, depth 0 = module level or method."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      yield node.name, node.end_lineno - node.lineno + 1, depth
      yield from _functions(node, depth + 1)
    elif isinstance(node, ast.ClassDef):
      yield from _functions(node, depth)
    else:
      yield from _functions(node, depth)


@pytest.mark.parametrize("path", RL_FILES, ids=lambda p: p.name)
def test_learner_functions_are_short_and_closures_shallow(path):
  for name, lines, depth in _functions(ast.parse(path.read_text())):
    assert lines <= 60, f"{path.name}:{name} has {lines} lines (limit 60)"
    assert depth <= 1, f"{path.name}:{name} is nested {depth} levels deep (limit 1)"


def test_make_rl_step_fits_one_screen():
  tree = ast.parse((PKG / "rl" / "step.py").read_text())
  lengths = {name: lines for name, lines, _ in _functions(tree)}
  assert lengths["make_rl_step"] <= 50 and lengths["learn"] <= 40


def test_model_config_does_not_import_the_moe_layer():
  source = (PKG / "models" / "config.py").read_text()
  assert "models.moe" not in source and "import moe" not in source


def test_objectives_do_not_import_the_learner():
  for path in (PKG / "objectives").glob("*.py"):
    source = path.read_text()
    assert "jaxrl_llm.rl" not in source and "jaxrl_llm import rl" not in source, path.name


@pytest.mark.parametrize("path", PACKAGE_FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_function_in_the_package_is_over_60_lines(path):
  for name, lines, _ in _functions(ast.parse(path.read_text())):
    assert lines <= 60, f"{path.relative_to(PKG)}:{name} has {lines} lines (limit 60)"


def _windows(path: pathlib.Path, size: int = 6):
  """(normalised text, first line) of every run of `size` consecutive code lines of a file."""
  lines = [
    (i + 1, line.strip())
    for i, line in enumerate(path.read_text().splitlines())
    if line.strip() and not line.strip().startswith(("#", "import ", "from "))
  ]
  for k in range(len(lines) - size + 1):
    block = tuple(text for _, text in lines[k : k + size])
    if sum(len(t.strip("()[]{},:")) for t in block) >= 60:  # not a run of brackets
      yield block, lines[k][0]


def test_no_block_of_six_lines_is_written_twice_in_the_package():
  """The same six code lines (whitespace aside) appear in one place of the package only."""
  seen: dict[tuple[str, ...], str] = {}
  repeated = []
  for path in PACKAGE_FILES:
    last = {}
    for block, line in _windows(path):
      where = f"{path.relative_to(PKG)}:{line}"
      if block in seen and last.get(block, -99) < line - 6:
        repeated.append(f"{seen[block]} ~ {where}")
      seen.setdefault(block, where)
      last[block] = line
  assert not repeated, "\n".join(repeated[:10])
