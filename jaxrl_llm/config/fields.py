"""What every settings section is built from: a frozen dataclass whose fields are the config
section's fields, each with its default and a one-line comment written after it (the only place
a field is documented), coerced from the user's ml-collections values and range-checked."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import math
import textwrap
import tokenize
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import numpy as np

_CASTS = {"float": float, "int": int, "bool": bool, "str": str}


# What the program must know of a setting, written as field metadata beside its declaration
# (`setting(default, ...)`), never as lists of field names elsewhere.
PER_RUN = "per_run"  # a pack may vary it: TRACED, it enters the step as a per-run value; STATE,
# it sets each run's initial state (the seed)
TRACED, STATE = "traced", "state"
SWITCH = "switch"  # it switches a term on (> 0) or off (0): a pack's runs must agree on which
RESUME = "resume"  # False: how an update is computed, or what is only evaluated, so changing it
# does not block a resume (True: changing it blocks one; default: the section's `LEARNED`)
HPARAM = "hparam"  # a column of TensorBoard's HParams view (a display choice)
INVOCATION = "invocation"  # it ends or paces one invocation without changing what the run
# computes: invocations of one run may differ in it (run records, sweeps and plots ignore it)
CONSTANT = "constant"  # TRACED, but a single run compiles it in as a constant: its traced form
# costs more than its constant one, so a single run's program changes with its value


def traced_dtype(values: Any) -> Any:
  """The dtype a traced field's values enter the step in: int32 when every value is an int (an
  integer field: parsing casts each value to its field's type), else float32; one place, so a
  single run, a pack and their compile-only plans agree on the step's argument types."""
  vals = values if isinstance(values, list | tuple) else [values]
  whole = all(isinstance(v, int) and not isinstance(v, bool) for v in vals)
  return np.dtype(np.int32 if whole else np.float32)


def setting(
  default: Any,
  *,
  per_run="",
  switch=False,
  resume=None,
  hparam=False,
  invocation=False,
  constant=False,
) -> Any:
  """A settings field with its `default` and what the program must know of it (the keys
  above; `per_run`: "", TRACED or STATE), as `dataclasses.field` metadata."""
  meta = {PER_RUN: per_run, SWITCH: switch, RESUME: resume, HPARAM: hparam, INVOCATION: invocation}
  meta[CONSTANT] = constant
  return dataclasses.field(default=default, metadata=meta)


def tag_matches(field: dataclasses.Field, key: str, value: Any = None) -> bool:
  """Whether `field`'s metadata sets `key` (to `value`, if given)."""
  own = field.metadata.get(key)
  return bool(own) if value is None else own == value


class ConfigError(ValueError):
  """A config value is missing, unknown or out of range."""


def invalid(errors: list[str]) -> ConfigError:
  """The error for `errors` (each names a field and what it allows): one line for one problem,
  a line each under `invalid config:` for several."""
  if len(errors) == 1:
    return ConfigError(f"invalid config: {errors[0]}")
  return ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def coerce(annotation: str, value: Any, where: str) -> Any:
  """`value` as the annotated type ("float", "int | None", ...), or a ValueError naming it
  (a float must be finite: inf and nan are refused everywhere)."""
  kinds = [k.strip() for k in annotation.split("|")]
  if value is None:
    if "None" in kinds:
      return None
    raise ValueError(f"{where} must be set (got None)")
  base = next(k for k in kinds if k != "None")
  if base not in _CASTS:  # tuples and other structured fields are kept as given
    return value
  if base == "bool" and not isinstance(value, bool | int):
    raise ValueError(f"{where}={value!r} must be a bool")
  if base == "int" and (isinstance(value, bool) or (isinstance(value, float) and value % 1)):
    raise ValueError(f"{where}={value!r} must be a whole number")  # int() would drop it silently
  try:
    out = _CASTS[base](value)
  except (TypeError, ValueError):
    if "str" in kinds and isinstance(value, str):  # "int | str": a number or a word (auto)
      return value
    raise ValueError(f"{where}={value!r} must be a {base}") from None
  if base == "float" and not math.isfinite(out):
    raise ValueError(f"{where}={value!r} must be a finite number")
  return out


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
  """The comment written after each field of dataclass `cls` in its source ("" if none): on
  the declaration's last line (a declaration the formatter wraps ends with it)."""
  source = textwrap.dedent(inspect.getsource(cls))
  tokens = tokenize.generate_tokens(io.StringIO(source).readline)
  comments = {
    t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT
  }
  docs = {}
  for node in ast.parse(source).body[0].body:
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      docs[node.target.id] = comments.get(node.end_lineno, "")
  return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def need(ok: bool, message: str) -> list[str]:
  """[message] unless `ok` (the building block of range checks)."""
  return [] if ok else [message]


def allowed(field: str, value: str, choices: tuple[str, ...]) -> list[str]:
  """An error naming `field`, its value and the allowed names, unless `value` is one of them."""
  return [] if value in choices else [f"{field}={value!r}; allowed: {', '.join(choices)}"]


def at_least(section: str, obj: Any, low: float, *names: str, note: str = "") -> list[str]:
  """Errors for each field of `names` below `low` (`note` is appended, e.g. '(0 = off)')."""
  out = []
  for name in names:
    value = getattr(obj, name)
    out += need(value >= low, f"{section}.{name}={value} must be >= {low:g}{note}")
  return out


def is_on(coef: Any) -> bool:
  """Whether a coefficient turns its term on (> 0). A traced value is a per-run value of a
  pack, whose runs all agree on it being on (`run.pack` refuses to mix 0 with > 0)."""
  return isinstance(coef, jax.Array) or coef > 0


class Section:
  """Mixin of a settings section: built from a config section with exactly its fields."""

  SECTION: ClassVar[str]
  LEARNED: ClassVar[bool] = False  # its fields decide what is learned: a change blocks a resume

  @classmethod
  def blocks_resume(cls, name: str) -> bool:
    """Whether changing field `name` blocks resuming a workdir (without train.resume_changed):
    the field's own `resume` metadata, else the section's `LEARNED`."""
    own = {f.name: f.metadata.get(RESUME) for f in dataclasses.fields(cls)}.get(name)
    return cls.LEARNED if own is None else own

  @classmethod
  def tagged(cls, key: str, value: Any = None) -> tuple[str, ...]:
    """The fields whose metadata sets `key` (PER_RUN, SWITCH, HPARAM): to `value` if given."""
    return tuple(f.name for f in dataclasses.fields(cls) if tag_matches(f, key, value))

  @classmethod
  def from_section(cls, section: Mapping[str, Any]):
    """The settings of `section` (a ConfigDict or dict); ValueError on missing/unknown keys."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    given = dict(section.items())
    unknown, missing = sorted(set(given) - set(fields)), sorted(set(fields) - set(given))
    if unknown or missing:
      raise ValueError(
        f"config section {cls.SECTION!r}: unknown fields {unknown}, missing fields {missing}; "
        f"allowed: {sorted(fields)}"
      )
    return cls(**{k: coerce(t, given[k], f"{cls.SECTION}.{k}") for k, t in fields.items()})

  @classmethod
  def defaults(cls) -> dict[str, Any]:
    """{field: default} in declaration order (the embedded default config's section)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}

  @classmethod
  def docs(cls) -> dict[str, str]:
    """{field: its one-line comment}."""
    return field_docs(cls)

  @classmethod
  def kinds(cls) -> dict[str, type]:
    """{field: the Python type of its values} (placeholders of unset fields use it)."""
    out = {}
    for f in dataclasses.fields(cls):
      base = next(k.strip() for k in str(f.type).split("|") if k.strip() != "None")
      out[f.name] = _CASTS.get(base, object)
    return out

  def to_dict(self) -> dict[str, Any]:
    """The section as the config's JSON would hold it."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def errors(self) -> list[str]:
    """Range-check messages of this section alone (empty when valid)."""
    return []


class LearnedSection(Section):
  """A section whose fields decide what the learner optimises and on what: changing one blocks
  resuming a workdir (unless the field says `resume=False`, or train.resume_changed)."""

  LEARNED: ClassVar[bool] = True
