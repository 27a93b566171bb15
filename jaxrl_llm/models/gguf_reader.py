"""Opening a GGUF file: gguf's reader with a truncated or malformed file refused in one line."""

from __future__ import annotations

import os
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
  return reader


def field(reader, key: str, default: Any = None) -> Any:
  """The value of metadata `key` in `reader`'s file, `default` when absent."""
  f = reader.fields.get(key)
  return default if f is None else f.contents()
