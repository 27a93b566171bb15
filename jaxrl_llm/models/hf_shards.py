"""Safetensors shards of a Hugging Face checkpoint, written beside the directory's weights
and moved in at the end (`ShardWriter`): an export interrupted or failed leaves an export
already there whole. `weight_files` names the weight files an export replaces."""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from jaxrl_llm import paths
from jaxrl_llm.models.hf_layout import INDEX_FILE, SINGLE_FILE

__all__ = ["ShardWriter", "weight_files"]


def weight_files(path: str | os.PathLike) -> list[str]:
  """The weight files in directory `path` that an export there replaces (sorted; none when it
  does not exist)."""
  path = glob.escape(os.fspath(path))
  return sorted(
    glob.glob(os.path.join(path, "model*.safetensors")) + glob.glob(os.path.join(path, INDEX_FILE))
  )


class ShardWriter:
  """Collects tensors into safetensors shards of at most `max_bytes` (written by the `writer`
  process only); `close` gives them Hugging Face's names and writes the index if there are
  several."""

  def __init__(self, path: str, max_bytes: int, writer: bool):
    self.path, self.max_bytes, self.writer = path, max_bytes, writer
    self.shards: list[list[str]] = []
    self.current: dict[str, np.ndarray] = {}
    self.size = self.total = 0

  def add(self, name: str, t: np.ndarray) -> None:
    """Adds tensor `name`, starting a new shard first if it would overflow the current one."""
    if self.current and self.size + t.nbytes > self.max_bytes:
      self._flush()
    self.current[name] = t
    self.size += t.nbytes
    self.total += t.nbytes

  def _flush(self) -> None:
    from safetensors.numpy import save_file

    if not self.current:
      return
    self.shards.append(list(self.current))  # before the write: `abort` removes one cut short
    if self.writer:
      save_file(self.current, self._tmp(len(self.shards) - 1), metadata={"format": "pt"})
    self.current, self.size = {}, 0

  def _tmp(self, i: int) -> str:
    return os.path.join(self.path, f".shard-{i}.tmp")

  def close(self) -> None:
    """Writes the last shard, moves them all in under Hugging Face's names (with the index if
    there are several), then removes the weight files of an export there before that these do
    not replace: until the renames, that export stays whole."""
    self._flush()
    if not self.writer:
      return
    old = weight_files(self.path)
    n = len(self.shards)
    names = (
      [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for i, name in enumerate(names):
      paths.publish(self._tmp(i), os.path.join(self.path, name))
    if n > 1:
      weight_map = {t: names[i] for i, shard in enumerate(self.shards) for t in shard}
      index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
      paths.write_text(os.path.join(self.path, INDEX_FILE), json.dumps(index, indent=2))
    kept = {os.path.join(self.path, name) for name in [*names, INDEX_FILE if n > 1 else ""]}
    for f in old:
      if f not in kept:
        os.remove(f)

  def abort(self) -> None:
    """Removes the shards written so far (an interrupted export): what was there stays."""
    if self.writer:
      for i in range(len(self.shards)):
        if os.path.exists(self._tmp(i)):
          os.remove(self._tmp(i))
