"""Settings with a second home: where the package knows about a config setting outside its
declaration ("every setting said once").

  python tools/settings_homes.py [--max N]

Prints one line per place a setting has a second home (`setting: file:line what`), then
`N of M settings have a second home` (M: the rows of `jaxrl_llm.config.reference()`, 145 when
this was written); `--max N` exits 1 when more than N settings have one.

Method. The settings are the rows of `reference()`: `seed` and `section.field` (the `model.*`
rows are `ModelConfig`'s fields and the model section's run fields), each with its default.
Their declarations' homes are `jaxrl_llm/config/` and `jaxrl_llm/models/config.py`; every other
`jaxrl_llm/**/*.py` is parsed with `ast` (nothing is imported or run but `reference()`) and a
setting has a second home when one of these holds there:

(a) dotted name: a string constant is exactly the setting's dotted name (`"kl.beta"`). Only
    whole constants count; docstrings and the literal parts of f-strings are prose that names
    a setting for a reader (messages, help), not a home. `DISPLAY_CHOICES` lists the allowed
    exceptions (display choices, such as TensorBoard HParams columns); it is empty.
(b) name list: a tuple, list or set literal (including `frozenset((...))`'s), or the key set
    of a dict literal whose values are all literals (a table about the names), whose string
    elements are all field names or dotted setting names and include at least two field names
    of one section: each of those is a second home of that section's setting. Also a
    one-element such literal assigned to an ALL_CAPS name (a leading underscore allowed) whose
    element is a field name (a second home of every setting with that field name). And a
    comprehension over `dataclasses.fields(C)` that picks fields by name
    (`f.name.startswith("lora_")`), for the fields of C it picks (C a section class or
    `ModelConfig`). Not counted: a collection that also holds other strings (another
    vocabulary that shares some spellings: Hugging Face's config.json keys, PEFT's
    adapter_config.json, tensor conditions), and a dict of computed values (keyword arguments
    in another spelling, `ModelConfig(**{"d_model": d, ...})`, which use the declaration as a
    call does).
(c) default written twice: a class-level annotated assignment (a dataclass field, a Flax
    module attribute: a settings object of its own), named like a setting's field,
    whose default is a literal (or a module-level name bound to one, or
    `field(default=literal)`) equal to that setting's default (booleans only equal booleans;
    2 equals 2.0; lists equal tuples). One name is excluded: `name`. The `name` fields of the
    choice sections (task.name, advantage.name, ...) select a registered implementation, and
    an implementation declaring its own name (`ReverseTask.name = "reverse"`) is that
    choice's identity, equal to the default only because the default selects it. A
    function's keyword defaults are not counted: they are a pure function's own API for
    direct callers (tests, tools; `behaviour_weight(cap=2.0)` is the spec's C), while the
    trainer passes each such value from the settings tree. One class is excluded:
    `models/families.Family`, the table of Hugging Face families, whose fields (`qk_norm`)
    say what a family's checkpoints hold, read from there, not a setting's default.

The mesh section is named after the mesh: its fields are the sizes of the axes that
`jaxrl_llm/sharding.py` declares (`MESH_AXES`), so lists of axis names in sharding.py (which
axes `-1` fills, which split the batch) are the axes' vocabulary, not lists of settings; rule
(b) skips name lists of mesh axes there.

The objective's hyperparameters (objective.clip_low, ...) are declared by the registered
objectives (`register_objective`): the decorated function's keyword parameters, its
registration's arguments and the module-level values those name (a `docs=` table) are their
home too, so rules (b) and (c) skip a registered objective's own hyperparameters there.

The count is of distinct settings; a setting found by several rules or places is one.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run from a checkout without installing it
  sys.path.insert(0, str(_REPO))

HOMES = ("jaxrl_llm/config/", "jaxrl_llm/models/config.py")  # the declarations' homes
DISPLAY_CHOICES: frozenset[str] = frozenset()  # dotted names allowed as display choices (none)
_CAPS = re.compile(r"_*[A-Z][A-Z0-9_]*$")
_NOT_DEFAULTS = frozenset({"name"})  # rule (c): an implementation's own name (see above)
_NOT_SETTINGS = frozenset({"Family"})  # rule (c): classes of another vocabulary (see above)
_AXES_HOME = "jaxrl_llm/sharding.py"  # rule (b): where the mesh's axis names are declared
_REGISTRARS = frozenset({"register_objective"})  # their functions declare objective.* fields


@dataclasses.dataclass(frozen=True, order=True)
class SecondHome:
  """One place outside the declarations that knows about `setting`."""

  path: str
  line: int
  setting: str
  what: str

  def __str__(self) -> str:
    return f"{self.setting}: {self.path}:{self.line} {self.what}"


def settings() -> list[tuple[str, Any]]:
  """(dotted name, default) of every config setting, in the reference's order."""
  from jaxrl_llm.config import reference

  return [(name, default) for name, default, _ in reference()]


def section_classes() -> dict[str, str]:
  """{class name: section} of the config's section classes (and ModelConfig: `model`)."""
  from jaxrl_llm.config import Config

  out = {cls.__name__: name for name, cls in Config.sections().items()}
  return out | {"ModelConfig": "model"}


def package_sources(root: Path = _REPO) -> dict[str, str]:
  """{repo-relative path: source} of every package module outside the declarations' homes."""
  out = {}
  for path in sorted((root / "jaxrl_llm").rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if not rel.startswith(HOMES):
      out[rel] = path.read_text()
  return out


def _same(a: Any, b: Any) -> bool:
  """Equal defaults: booleans only equal booleans, numbers by value, lists as tuples."""
  if isinstance(a, bool) or isinstance(b, bool):
    return isinstance(a, bool) and isinstance(b, bool) and a == b
  if isinstance(a, list | tuple) and isinstance(b, list | tuple):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, int | float) and isinstance(b, int | float):
    return a == b
  return type(a) is type(b) and a == b


_NO_VALUE = object()


class _Module:
  """One parsed module and the facts the rules need about it."""

  def __init__(self, path: str, source: str):
    self.tree = ast.parse(source, filename=path)
    self.docstrings = set()
    for node in ast.walk(self.tree):
      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
          self.docstrings.add(id(body[0].value))
    self.fstring_parts = {
      id(v)
      for node in ast.walk(self.tree)
      if isinstance(node, ast.JoinedStr)
      for v in node.values
      if isinstance(v, ast.Constant)
    }
    self.constants: dict[str, Any] = {}  # module-level names bound to literals
    self.assigned: dict[int, str] = {}  # id(literal) -> the name it is assigned to
    for node in ast.walk(self.tree):
      targets, value = [], None
      if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
      elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
      names = [t.id for t in targets if isinstance(t, ast.Name)]
      if not names:
        continue
      literal = _unwrap_collection(value)
      if literal is not None:
        self.assigned[id(literal)] = names[0]
    for node in self.tree.body:
      if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target, value = node.targets[0], node.value
      elif isinstance(node, ast.AnnAssign) and node.value is not None:
        target, value = node.target, node.value
      else:
        continue
      if isinstance(target, ast.Name):
        try:
          self.constants[target.id] = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
          pass
    self.registered = _registrations(self.tree)

  def value(self, node: ast.expr) -> Any:
    """The literal a default expression denotes, else _NO_VALUE."""
    if (
      isinstance(node, ast.Call)
      and _name(node.func) == "field"
      and any(k.arg == "default" for k in node.keywords)
    ):
      node = next(k.value for k in node.keywords if k.arg == "default")
    if isinstance(node, ast.Name):
      return self.constants.get(node.id, _NO_VALUE)
    try:
      return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
      return _NO_VALUE


def _registrations(tree: ast.Module) -> dict[int, set[str]]:
  """{id(node): hyperparameter names} of every node of a registered objective's declaration:
  the registration call, the module-level values it names, the function's defaults."""
  values = {}
  for node in tree.body:
    if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
      for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
        if isinstance(target, ast.Name):
          values[target.id] = node.value
  out: dict[int, set[str]] = {}
  for fn in ast.walk(tree):
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
      continue
    for deco in fn.decorator_list:
      if not (isinstance(deco, ast.Call) and _name(deco.func) in _REGISTRARS):
        continue
      a = fn.args
      params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
      nodes = list(ast.walk(deco))
      named = [values[n.id] for n in nodes if isinstance(n, ast.Name) and n.id in values]
      nodes += [n for v in named for n in ast.walk(v)]
      nodes += [n for _, d in _defaults(fn) for n in ast.walk(d)]
      for n in nodes:
        out.setdefault(id(n), set()).update(params)
  return out


def _name(node: ast.expr) -> str:
  """`f` of `f` or `a.b.f`; "" otherwise."""
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    return node.attr
  return ""


def _unwrap_collection(node: ast.expr | None) -> ast.expr | None:
  """The literal of a tuple/list/set/dict literal or of `frozenset(literal)`-like calls."""
  if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
    return node
  if (
    isinstance(node, ast.Call)
    and _name(node.func) in ("frozenset", "set", "tuple", "list")
    and len(node.args) == 1
  ):
    return _unwrap_collection(node.args[0])
  return None


def _strings(node: ast.expr) -> list[str]:
  """The string elements of a collection literal (a dict's keys)."""
  elts = node.keys if isinstance(node, ast.Dict) else node.elts
  return [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _a_name_list(node: ast.expr, fields_of: Mapping[str, set[str]], dotted: Mapping) -> bool:
  """Whether a collection literal can be a list of setting names: every element a string that
  is a field name or a dotted setting name (a dict: its keys, and its values all literals)."""
  if isinstance(node, ast.Dict):
    if any(k is None for k in node.keys):  # `{**other}`
      return False
    for v in node.values:
      try:
        ast.literal_eval(v)
      except (ValueError, TypeError, SyntaxError, RecursionError):
        return False
  elts = node.keys if isinstance(node, ast.Dict) else node.elts
  elts = [e for e in elts if not isinstance(e, ast.Starred)]  # `*OTHER`: judged on its own
  names = _strings(node)
  if not elts or len(names) != len(elts):
    return False
  known = set().union(*fields_of.values())
  return all(n in known or n in dotted for n in names)


def _defaults(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
  """(parameter, default expression) of a function's parameters that have defaults."""
  a = fn.args
  positional = [*a.posonlyargs, *a.args]
  yield from zip(positional[len(positional) - len(a.defaults) :], a.defaults)
  yield from ((p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)


def _picked_fields(comp: ast.AST, classes: Mapping[str, str]) -> tuple[str, str, str] | None:
  """(section, method, pattern) of `[f.name for f in fields(C) if f.name.startswith(p)]`."""
  gens = getattr(comp, "generators", [])
  for gen in gens:
    it = gen.iter
    if not (isinstance(it, ast.Call) and _name(it.func) == "fields" and len(it.args) == 1):
      continue
    section = classes.get(_name(it.args[0]))
    if section is None:
      continue
    for cond in gen.ifs:
      for node in ast.walk(cond):
        if (
          isinstance(node, ast.Call)
          and _name(node.func) in ("startswith", "endswith")
          and len(node.args) == 1
          and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
        ):
          return section, node.func.attr, node.args[0].value
  return None


def second_homes(
  sources: Mapping[str, str],
  table: Sequence[tuple[str, Any]],
  classes: Mapping[str, str] | None = None,
) -> list[SecondHome]:
  """Every second home (rules (a)-(c) of the module docstring) of the settings in `table`
  ((dotted name, default) pairs) in `sources` ({path: source}); `classes` maps class names to
  their sections for the `fields(C)` rule."""
  classes = classes or {}
  defaults = dict(table)
  fields_of: dict[str, set[str]] = {}  # section -> field names ("" : the top-level `seed`)
  settings_of: dict[str, list[str]] = {}  # field name -> dotted settings
  for dotted in defaults:
    section, _, field = dotted.rpartition(".")
    fields_of.setdefault(section, set()).add(field)
    settings_of.setdefault(field, []).append(dotted)
  out: list[SecondHome] = []

  def add(path, node, dotted, what):
    if dotted.startswith("objective.") and dotted[10:] in mod.registered.get(id(node), ()):
      return  # a registered objective's declaration of its own hyperparameter
    out.append(SecondHome(path, node.lineno, dotted, what))

  for path, source in sources.items():
    mod = _Module(path, source)
    for node in ast.walk(mod.tree):
      # (a) a dotted setting name as a whole string constant.
      if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in defaults
        and "." in node.value
        and node.value not in DISPLAY_CHOICES
        and id(node) not in mod.docstrings
        and id(node) not in mod.fstring_parts
      ):
        add(path, node, node.value, f"string constant {node.value!r}")
      # (b) a list of field names.
      collection = isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict)
      axes = (
        collection and path == _AXES_HOME and set(_strings(node)) <= fields_of.get("mesh", set())
      )
      if collection and not axes and _a_name_list(node, fields_of, defaults):
        literal = node
        names = _strings(literal)
        where = mod.assigned.get(id(literal))
        label = f"name list {where}" if where else "name list"
        for section, fields in fields_of.items():
          hit = sorted(set(names) & fields)
          if len(hit) >= 2:
            for field in hit:
              dotted = f"{section}.{field}" if section else field
              add(path, literal, dotted, f"{label} ({', '.join(hit)})")
        elts = literal.keys if isinstance(literal, ast.Dict) else literal.elts
        if len(elts) == 1 and names and where and _CAPS.match(where):
          for dotted in settings_of.get(names[0], []):
            add(path, literal, dotted, f"{label} ({names[0]})")
      if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
        picked = _picked_fields(node, classes)
        if picked:
          section, method, pattern = picked
          for field in sorted(fields_of.get(section, ())):
            if getattr(field, method)(pattern):
              shown = f"{pattern}*" if method == "startswith" else f"*{pattern}"
              add(path, node, f"{section}.{field}", f"fields picked by name {shown!r}")
      # (c) a default written twice.
      pairs: Iterable[tuple[str, ast.expr]] = ()
      if isinstance(node, ast.ClassDef) and node.name not in _NOT_SETTINGS:
        pairs = [
          (s.target.id, s.value)
          for s in node.body
          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value
        ]
        kind = f"field of {node.name}"
      for name, expr in pairs:
        if name not in settings_of or name in _NOT_DEFAULTS:
          continue
        value = mod.value(expr)
        if value is _NO_VALUE:
          continue
        for dotted in settings_of[name]:
          if _same(value, defaults[dotted]):
            add(path, expr, dotted, f"default {name}={value!r} written twice ({kind})")
  order = {dotted: i for i, dotted in enumerate(defaults)}
  return sorted(set(out), key=lambda h: (order[h.setting], h.path, h.line, h.what))


def count(root: Path = _REPO) -> tuple[list[SecondHome], int]:
  """(every second home in the package at `root`, the number of settings)."""
  table = settings()
  return second_homes(package_sources(root), table, section_classes()), len(table)


def main(argv: Sequence[str] | None = None) -> int:
  """Prints each setting read in more than one place; with --max, exits 1 above that many."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--max", type=int, default=None, help="exit 1 above this many settings")
  args = parser.parse_args(argv)
  if args.max is not None and args.max < 0:
    print(f"error: --max={args.max}: give a count of settings >= 0", file=sys.stderr)
    return 2
  homes, total = count()
  for home in homes:
    print(home)
  n = len({h.setting for h in homes})
  print(f"{n} of {total} settings have a second home")
  if args.max is not None and n > args.max:
    print(f"{n} settings have a second home, more than --max={args.max}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  os.chdir(_REPO)
  sys.exit(main())
