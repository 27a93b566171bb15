"""Checksums of a checkpoint step: `<step>/checksums.json`, written after a save, checked on load.

The manifest maps every file of the step (relative path) to its size and CRC-32:
`{"format": "crc32", "files": {path: [size, crc32]}}`. `write_manifest` takes them,
`verify_manifest` says which file changed, vanished or was truncated since. When and by which
process they are written, and what a restore does with a step that fails them, is
`jaxrl_llm.checkpoint.Checkpointer`'s job. Every file operation goes through `jaxrl_llm.paths`,
so a step may live on `gs://` as well as on a local disk.
"""

from __future__ import annotations

import json
import zlib

from etils import epath

from jaxrl_llm import paths

MANIFEST = "checksums.json"  # the manifest's file name inside a step directory
COMMIT_FILE = (
  "commit_success.txt"  # orbax's commit marker: a step directory without it is unfinished
)

# orbax rewrites these two at its commit, after our checksums may have been taken: the step's
# metadata (timestamps) and the commit marker. They hold no arrays.
_UNCHECKED = (MANIFEST, "_CHECKPOINT_METADATA", COMMIT_FILE)


def _crc32(path: paths.PathLike, chunk: int = 1 << 22) -> int:
  crc = 0
  with paths.as_path(path).open("rb") as f:
    while block := f.read(chunk):
      crc = zlib.crc32(block, crc)
  return crc


def _files(root: epath.Path) -> list[epath.Path]:
  return [p for p in paths.files_under(root) if p.relative_to(root).as_posix() not in _UNCHECKED]


def has_manifest(step_dir: paths.PathLike) -> bool:
  """Whether `step_dir` holds a checksums manifest."""
  return paths.exists(paths.as_path(step_dir) / MANIFEST)


def write_manifest(step_dir: paths.PathLike) -> None:
  """Writes `<step_dir>/checksums.json`: {relative path: [size, crc32]} of every file in it."""
  root = paths.as_path(step_dir)
  entries = {str(p.relative_to(root)): [paths.size(p), _crc32(p)] for p in _files(root)}
  paths.write_text(root / MANIFEST, json.dumps({"format": "crc32", "files": entries}, indent=0))


def verify_manifest(step_dir: paths.PathLike) -> str | None:
  """Why `step_dir` does not match its checksums (None: it does, or it has no manifest)."""
  root = paths.as_path(step_dir)
  manifest = root / MANIFEST
  if not paths.exists(manifest):
    return None
  try:
    entries = json.loads(paths.read_text(manifest))["files"]
  except (ValueError, KeyError, TypeError) as e:
    return f"its {MANIFEST} is unreadable ({e})"
  well_formed = isinstance(entries, dict) and all(
    isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v) for v in entries.values()
  )
  if not well_formed:  # valid JSON of another shape: as unreadable as a flipped byte
    return f"its {MANIFEST} is unreadable (not {{path: [size, crc32]}})"
  unlisted = sorted(set(str(p.relative_to(root)) for p in _files(root)) - set(entries))
  if unlisted:  # an emptied or stale manifest checks nothing of these
    return f"{unlisted[0]} is not in its {MANIFEST}"
  for rel, (size, crc) in entries.items():
    path = root / rel
    if not paths.exists(path):
      return f"{rel} is missing"
    if (found := paths.size(path)) != size:
      return f"{rel} has {found} bytes, {size} were written"
    if _crc32(path) != crc:
      return f"{rel} does not match its checksum"
  return None
