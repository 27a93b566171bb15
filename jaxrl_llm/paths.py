"""One path abstraction for the workdir: local paths and object-store URLs alike (`etils.epath`).

A workdir may be a local path or a `gs://` URL (tested against an emulator; `s3://` and `az://`
take the same calls but are untested and need `s3fs` / `adlfs`); events, `config.json` and
checkpoints are all written through these helpers, never `os`/`open`, so a URL never becomes a
local folder named `gs:`. `etils.epath` reaches object stores through fsspec (gcsfs for gs://)
when TensorFlow is not installed, and orbax writes its arrays there with tensorstore.

Object stores have no directories, renames or appends: a "directory" exists while an object
lies under it (`makedirs` is a no-op there), `rename` copies then deletes object by object (not
atomic), and a file written by appends is rewritten whole at each flush (`AppendFile`). A single
object write is atomic, so `write_text` writes in place there and through a temporary file and a
rename locally.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from typing import IO

import fsspec
from etils import epath

PathLike = str | os.PathLike

# epath's schemes (anything else that looks like a URL would become a local relative path).
REMOTE_SCHEMES = ("gs", "s3", "az", "hf")

for _protocol in ("gs", "gcs", "s3", "s3a", "az", "abfs"):
  # Several clients (epath, TensorBoard's reader) hold their own fsspec instances, and
  # tensorstore writes around fsspec: a cached listing would miss their newer files.
  fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)


def dir_problem(path: str) -> str | None:
  """Why the local `path` cannot be, or be made, a directory to write in, found without
  creating anything: a file there, a file in place of a directory above it, or a directory
  above it that cannot be written, or no path at all; None when it can."""
  if not path:
    return "is empty; give a folder"
  if os.path.lexists(path) and not os.path.isdir(path):
    return "is a file, not a directory"
  if os.path.isdir(path):
    return None
  above = os.path.dirname(os.path.abspath(path))
  while not os.path.lexists(above):
    above = os.path.dirname(above)
  if not os.path.isdir(above):
    return f"cannot be made: {above} is a file, not a directory"
  if not os.access(above, os.W_OK | os.X_OK):
    return f"cannot be made: {above} cannot be written"
  return None


def file_problem(path: str) -> str | None:
  """Why a file cannot be written at the local `path`, found without creating anything: a
  directory there, a read-only file there, or a folder above it that cannot be made or written
  (`dir_problem`; the writer makes missing folders), a URL, or no path at all; None when it
  can."""
  if not path:
    return "is empty; give a file path"
  if scheme(path) is not None:
    return "is a URL; give a local file path"
  if os.path.isdir(path):
    return "is a directory; give a file path"
  folder = os.path.dirname(os.path.abspath(path))
  if problem := dir_problem(folder):
    return f"cannot be written: its folder {folder} {problem}"
  if os.path.isdir(folder) and not os.access(folder, os.W_OK | os.X_OK):
    return f"cannot be written: its folder {folder} is read-only"
  if os.path.lexists(path) and not os.access(path, os.W_OK):
    return "cannot be written: the file there is read-only"
  return None


def scheme(path: PathLike) -> str | None:
  """The URL scheme of `path` ('gs', 's3', ...), or None for a local path."""
  head, sep, _ = os.fspath(path).partition("://")
  return head if sep and head.isalnum() else None


def as_path(path: PathLike) -> epath.Path:
  """`path` as an `epath.Path`: local paths and gs:// (s3://, az://, hf://) URLs; `file://` URLs
  become local paths. Raises ValueError for other URL schemes rather than making a local folder
  of them."""
  if isinstance(path, epath.Path):
    return path
  s = os.fspath(path)
  kind = scheme(s)
  if kind == "file":
    return epath.Path(s[len("file://") :])
  if kind is not None and kind not in REMOTE_SCHEMES:
    raise ValueError(
      f"unsupported URL {s!r}: use a local path or one of "
      + ", ".join(f"{k}://" for k in REMOTE_SCHEMES)
    )
  return epath.Path(s)


def is_remote(path: PathLike) -> bool:
  """Whether `path` is an object-store URL (gs://, s3://, ...) rather than a local path."""
  return scheme(as_path(path)) is not None


def join(path: PathLike, *parts: str) -> str:
  """`path / part / ...` as a string (a URL stays a URL)."""
  return os.fspath(as_path(path).joinpath(*parts))


def exists(path: PathLike) -> bool:
  """Whether `path` exists (for a directory of an object store: whether anything lies under it)."""
  return as_path(path).exists()


def is_dir(path: PathLike) -> bool:
  """Whether `path` is a directory (on an object store: a prefix that objects lie under)."""
  return as_path(path).is_dir()


def makedirs(path: PathLike) -> None:
  """Creates directory `path` and its parents if missing (a no-op on object stores)."""
  as_path(path).mkdir(parents=True, exist_ok=True)


def listdir(path: PathLike) -> list[epath.Path]:
  """The entries of directory `path`, sorted by name; [] when it does not exist."""
  p = as_path(path)
  if not p.exists():
    return []
  return sorted(p.iterdir(), key=lambda child: child.name)


def files_under(root: PathLike) -> list[epath.Path]:
  """Every file below directory `root`, at any depth, sorted by path."""
  out = []
  for child in listdir(root):
    if child.is_dir():
      out.extend(files_under(child))
    else:
      out.append(child)
  return sorted(out, key=os.fspath)


def size(path: PathLike) -> int:
  """Size of file `path` in bytes."""
  return as_path(path).stat().length


def read_text(path: PathLike) -> str:
  """The text of file `path`."""
  return as_path(path).read_text()


def write_text(path: PathLike, text: str) -> None:
  """Writes `text` to file `path` so that readers see the old or the new content, never part of
  it: locally a temporary file renamed over `path`; remotely one object write (atomic there)."""
  p = as_path(path)
  if is_remote(p):
    p.write_text(text)
    return
  tmp = p.parent / f".{p.name}.tmp-{os.getpid()}"
  try:
    tmp.write_text(text)
    tmp.replace(p)
  except BaseException:  # a full disk, an interrupt: no partial temporary file is left behind
    tmp.unlink(missing_ok=True)
    raise


def publish(tmp: str | os.PathLike, dest: str | os.PathLike) -> None:
  """Moves local file `tmp` over `dest` in one rename, first giving it the permissions a file
  created with `open` would have (0o666 less the umask): a library that writes its files
  owner-only (safetensors) must not make an export unreadable to others."""
  os.chmod(tmp, 0o666 & ~_umask())
  os.replace(tmp, dest)


def _umask() -> int:
  """The process's umask, read where the system shows it (Linux's /proc/self/status) so that
  no other thread's file is created under a changed one; elsewhere set and restored at once."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  umask = os.umask(0)
  os.umask(umask)
  return umask


def write_csv(path: PathLike, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
  """Writes a table as CSV to `path` (None as an empty cell, floats at full precision) with
  `write_text`, making missing folders: a failed write leaves a file already there as it was."""
  text = io.StringIO()
  w = csv.writer(text)
  w.writerow(header)
  w.writerows(["" if v is None else v for v in row] for row in rows)
  makedirs(as_path(path).parent)
  write_text(path, text.getvalue())


def rename(src: PathLike, dst: PathLike) -> None:
  """Moves file or directory `src` to `dst`, which must not exist (FileExistsError).

  Locally one atomic rename; on an object store each object is copied then deleted, so a crash
  part-way leaves some objects under each name.
  """
  s, d = as_path(src), as_path(dst)
  if d.exists():
    raise FileExistsError(f"cannot move {s} to {d}: it exists")
  s.rename(d)


def remove_tree(path: PathLike) -> None:
  """Deletes file or directory `path` with everything below it (nothing if it does not exist)."""
  p = as_path(path)
  if p.is_dir():
    p.rmtree()
  elif p.exists():
    p.unlink()


class AppendFile:
  """A binary file written from start to end by appends, such as a TensorBoard event file.

  Locally an ordinary file (truncated on open). Object stores cannot append: the bytes are kept in
  a local temporary file and each `flush` rewrites the whole object (as TensorFlow's GCS file
  system does), so callers should start a new file once one is large (`size`).
  """

  def __init__(self, path: PathLike):
    """Opens `path` for writing (creating its directory locally); nothing is uploaded yet."""
    self.path = as_path(path)
    self.remote = is_remote(self.path)
    self.size = 0
    self._dirty = False
    if self.remote:
      self._file: IO[bytes] = tempfile.TemporaryFile()
    else:
      makedirs(self.path.parent)
      self._file = self.path.open("wb")

  def write(self, data: bytes) -> None:
    """Appends `data` (it reaches the file system at the next `flush`)."""
    self._file.write(data)
    self.size += len(data)
    self._dirty = True

  def flush(self) -> None:
    """Makes every byte written so far visible at `path`."""
    self._file.flush()
    if self.remote and self._dirty:
      self._file.seek(0)
      with self.path.open("wb") as out:
        shutil.copyfileobj(self._file, out)
      self._file.seek(0, os.SEEK_END)
    self._dirty = False

  def close(self) -> None:
    """Flushes and closes the file; later calls are no-ops."""
    if self._file.closed:
      return
    try:
      self.flush()
    finally:
      self._file.close()

  @property
  def closed(self) -> bool:
    """Whether `close` was called."""
    return self._file.closed
