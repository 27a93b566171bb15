"""Opening a GGUF file: gguf's reader with a truncated or malformed file refused in one line;
its metadata read by key, each value of the wrong type or range refused in one line naming the
file, the key and what it must be."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np


class GGUFError(ValueError):
  """A GGUF file this importer cannot turn into a Hugging Face directory (one line)."""


def open_reader(path: str):
  """gguf's reader of `path`, or a GGUFError when it is missing, truncated or not GGUF."""
  import gguf

  if not os.path.isfile(path):
    what = "is a directory, not a GGUF file" if os.path.isdir(path) else "no such file"
    raise GGUFError(f"{path}: {what}")
  size = os.path.getsize(path)

  class Truncated(Exception):
    pass

  class Reader(gguf.GGUFReader):
    # gguf's reader slices its memory map, so a cut file fails later (a reshape, an index) with
    # an error that does not say why: every read past the end is caught here instead.
    def _get(self, offset, dtype, count=1, override_order=None):
      end = int(offset) + np.dtype(dtype).itemsize * int(count)
      if end > size:
        raise Truncated(end)
      return super()._get(offset, dtype, count, override_order)

  try:
    reader = Reader(path, "r")
  except Truncated as e:
    raise GGUFError(
      f"{path}: truncated: it needs {e.args[0]:,} bytes but the file holds {size:,} bytes"
    ) from None
  except Exception as e:  # the reader raises ValueError, IndexError, ... on bad bytes
    msg = " ".join(str(e).split())
    raise GGUFError(f"{path}: not a complete GGUF file ({type(e).__name__}: {msg})") from None
  reader.path = path  # each metadata error names the file
  return reader


REQUIRED = object()  # the `default` of a key that must be present


def field(reader, key: str, default: Any = None) -> Any:
  """The value of metadata `key` in `reader`'s file, `default` when absent (a GGUFError when
  `default` is REQUIRED), or a GGUFError naming the file and key when its text is not UTF-8."""
  f = reader.fields.get(key)
  if f is None:
    if default is REQUIRED:
      raise GGUFError(f"{reader.path}: metadata {key} is missing")
    return default
  try:
    return f.contents()
  except UnicodeDecodeError as e:
    raise GGUFError(
      f"{reader.path}: metadata {key} is not UTF-8 text ({e}); GGUF strings must be UTF-8"
    ) from None


def _shown(value: Any) -> str:
  """`value`'s repr, cut to 60 characters (an array where a number belongs stays one line)."""
  text = repr(value)
  return text if len(text) <= 60 else text[:56] + " ..."


def _checked(reader, key: str, default: Any, ok: Callable[[Any], bool], allowed: str) -> Any:
  """Metadata `key` where `ok(value)`, `default` when absent (see `field`); else a GGUFError
  naming the file, the key, its value and what it must be (`allowed`)."""
  if key not in reader.fields:
    return field(reader, key, default)
  value = field(reader, key)
  if not ok(value):
    raise GGUFError(f"{reader.path}: {key}={_shown(value)} must be {allowed}")
  return value


def _is_int(v: Any) -> bool:
  """Whether `v` is an integer of GGUF's integer types (a bool or a float is not)."""
  return isinstance(v, int) and not isinstance(v, bool)


def whole(reader, key: str, default: Any = None, *, least: int = 0) -> Any:
  """Metadata `key`: an integer >= `least`, checked (`default` when absent)."""
  return _checked(
    reader, key, default, lambda v: _is_int(v) and v >= least, f"a whole number >= {least}"
  )


def positive(reader, key: str, default: Any = None) -> Any:
  """Metadata `key`: a finite number > 0 as a float, checked (`default` when absent)."""
  value = _checked(reader, key, default, _is_positive, "a finite number > 0")
  return None if value is None else float(value)


def _is_positive(v: Any) -> bool:
  """Whether `v` is a finite number > 0 of GGUF's number types (NaN is not)."""
  return (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0


def flag(reader, key: str, default: bool = False) -> bool:
  """Metadata `key`: a GGUF bool, checked (`default` when absent)."""
  return _checked(reader, key, default, lambda v: isinstance(v, bool), "true or false")


def text(reader, key: str, default: Any = None) -> Any:
  """Metadata `key`: a string, checked (`default` when absent)."""
  return _checked(reader, key, default, lambda v: isinstance(v, str), "a string")


def array(reader, key: str, kind: type, default: Any = None) -> Any:
  """Metadata `key`: an array of `kind` (str or int) values, checked (`default` when absent)."""
  item = _is_int if kind is int else lambda v: isinstance(v, kind)
  what = "whole numbers" if kind is int else "strings"
  return _checked(
    reader,
    key,
    default,
    lambda v: isinstance(v, list) and all(item(x) for x in v),
    f"an array of {what}",
  )
