"""Which JAX backend a run uses, chosen by JAX's own means.

`JAX_PLATFORMS` (or `jax_platforms`) is obeyed when set. Otherwise JAX starts every backend it
has a plugin for and picks the first that starts; when that leaves the CPU, `log_fallback` says
why in one line (which accelerator backend failed, or that none is installed); the run's banner
calls it, so the banner stays the first line. The native start-up chatter
of a backend that fails (libtpu's on a machine without a TPU) is caught and goes to the log at
debug level instead of the terminal.

JAX's persistent compilation cache (`use_compilation_cache`, `train.compilation_cache`) is set
here too, before the first compilation.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import tempfile
from collections.abc import Iterator

from absl import logging

from jaxrl_llm.config import ConfigError

PLUGINS = "jax[cuda12] for an NVIDIA GPU, jax[tpu] for a TPU, jax[rocm] for an AMD GPU"


_FALLBACK: dict[str, object] = {}  # why this process fell back to the CPU, once `choose` ran


class BackendError(RuntimeError):
  """The backend that `JAX_PLATFORMS` names could not start."""


@contextlib.contextmanager
def native_stderr(lines: list[str]) -> Iterator[None]:
  """Catches what native code writes to file descriptor 2 inside the block into `lines`
  (Python's own writes to stderr too); the terminal sees none of it."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as sink:
    os.dup2(sink.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      sink.seek(0)
      lines.extend(sink.read().decode(errors="replace").splitlines())


def failed_backends() -> dict[str, str]:
  """The accelerator backends JAX tried and could not start, with the first line of why."""
  from jax._src import xla_bridge

  errors = getattr(xla_bridge, "_backend_errors", {})  # filled by JAX's backend start-up
  out = {name: str(why).strip().splitlines()[0][:200] for name, why in errors.items() if why}
  for name in out:
    if "libtpu_lockfile" not in str(errors[name]):
      continue
    if not any(glob.glob(pattern) for pattern in TPU_DEVICE_FILES):
      # libtpu takes its lock before it looks for a TPU: another CPU-only process holds it.
      out[name] = f"{_NO_DEVICE[1]}TPU device files here ({', '.join(TPU_DEVICE_FILES)})"
    else:  # libtpu's advice, to delete a lock a live process holds, would break that process
      out[name] = (
        "the TPU is held by another process (its /tmp/libtpu_lockfile: another run, or a sweep "
        "with --parallel > 1); leave the lock alone and wait for that process, or run there"
      )
  return out


# Where a machine shows its TPU chips (TPU VMs: /dev/accel*; newer generations: /dev/vfio/N).
TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")


# How JAX's built-in TPU client says that libtpu is not installed, or that it is but this machine
# has no TPU: neither is a backend that failed.
_NOT_INSTALLED = ("Failed to open libtpu.so",)
_NO_DEVICE = ("No jellyfish device found", "TPU initialization failed: No ")


def absent(failed: dict[str, str]) -> dict[str, str]:
  """The entries of `failed` (`failed_backends`) that mean a backend this machine does not
  have (no plugin library, no device), not one that failed to start: {name: what is absent}."""
  out = {}
  for name, why in failed.items():
    if any(p in why for p in _NOT_INSTALLED):
      out[name] = "not installed"
    elif any(p in why for p in _NO_DEVICE):
      out[name] = f"installed, but this machine has no {name.upper()}"
  return out


def cpu_reason(failed: dict[str, str]) -> str:
  """Why JAX fell back to the CPU, in one sentence."""
  missing = absent(failed)
  real = {k: v for k, v in failed.items() if k not in missing}
  if real:
    tried = "; ".join(f"{name}: {why}" for name, why in sorted(real.items()))
    return f"no accelerator backend started ({tried})"
  devices = {k: v for k, v in missing.items() if v != "not installed"}
  if devices:
    said = "; ".join(f"{name}: {why}" for name, why in sorted(devices.items()))
    return f"no accelerator device here ({said})"
  return f"no accelerator backend is installed ({PLUGINS})"


FAKE_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU's concurrency-optimised scheduler let the in-process devices of one program reach two
# all-reduces in different orders: the default config on 4 such devices (fsdp=4, 2 minibatches)
# aborted in the collective rendezvous at its first RL step.
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def cpu_device_flags(flags: str, num_cpu_devices: str = "") -> str:
  """`flags` (XLA_FLAGS) with `CPU_SCHEDULER_FLAG=false` added where they, or
  `num_cpu_devices` (JAX_NUM_CPU_DEVICES), ask for several CPU devices in one process and the
  flags do not set that flag themselves; otherwise `flags` unchanged."""
  count = [f.partition("=")[2] for f in flags.split() if f.startswith(FAKE_DEVICES_FLAG + "=")]
  asked = [n.strip() for n in [*count[-1:], num_cpu_devices] if n.strip().isdecimal()]
  if not any(int(n) >= 2 for n in asked) or CPU_SCHEDULER_FLAG in flags:
    return flags
  return f"{flags} {CPU_SCHEDULER_FLAG}=false".strip()


def choose(debug: bool = False) -> str:
  """Starts JAX's backends (XLA_FLAGS first through `cpu_device_flags`) and returns the default
  one's name (`cpu`, `gpu`, `tpu`). With `JAX_PLATFORMS` set it is obeyed, and a backend it
  names that cannot start raises BackendError. Otherwise a fall-back to the CPU is noted for `log_fallback`; the start-up
  chatter of failed backends is logged at debug level (shown when `debug`)."""
  os.environ["XLA_FLAGS"] = cpu_device_flags(  # before a backend starts
    os.environ.get("XLA_FLAGS", ""), os.environ.get("JAX_NUM_CPU_DEVICES", "")
  )
  import jax

  asked = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
  chatter: list[str] = []
  try:
    with native_stderr(chatter):
      name = jax.default_backend()
  except Exception as e:  # RuntimeError; an AssertionError for a platform with no plugin
    if not asked:
      raise
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else "no plugin for it"
    raise BackendError(
      f"JAX_PLATFORMS={asked} names a backend that could not start: {first}; unset "
      "JAX_PLATFORMS to let JAX choose, or name one this machine has (cpu always starts)"
    ) from None
  finally:
    for line in chatter:
      (logging.info if debug else logging.debug)("backend start-up: %s", line)
  _FALLBACK.clear()
  if name == "cpu" and not asked:
    failed = failed_backends()
    _FALLBACK.update(reason=cpu_reason(failed), failed=bool(set(failed) - set(absent(failed))))
  return name


def log_fallback() -> str | None:
  """Logs, in one line, why this process runs on the CPU when `choose` fell back to it (a
  warning where an accelerator backend failed to start, info where none is installed) and
  returns that line; None, logging nothing, otherwise."""
  if not _FALLBACK:
    return None
  line = f"running on the CPU: {_FALLBACK['reason']}"
  (logging.warning if _FALLBACK["failed"] else logging.info)(line)
  return line


def compilation_cache_dir(setting: str, environ=os.environ) -> str | None:
  """The persistent compilation cache's directory for `train.compilation_cache` (None: no
  cache): "" none; "auto" the environment's JAX_COMPILATION_CACHE_DIR where it is set (empty:
  none), else $XDG_CACHE_HOME/jaxrl_llm/xla (default ~/.cache/jaxrl_llm/xla); else the
  directory it names (`~` expanded). A directory the setting names that is a file or cannot be
  written is a ConfigError; "auto"'s in that case is none, with a warning (a read-only home
  must not stop a run)."""
  if setting != "auto":
    path = os.path.expanduser(setting) or None
  elif "JAX_COMPILATION_CACHE_DIR" in environ:
    path = environ["JAX_COMPILATION_CACHE_DIR"] or None
  else:
    home = environ.get("HOME") or os.path.expanduser("~")
    base = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    path = os.path.join(base, "jaxrl_llm", "xla")
  problem = path and "://" not in path and _unwritable(path)
  if problem and setting != "auto":
    raise ConfigError(
      f"train.compilation_cache={setting!r}: {problem}; allowed: a directory this process can "
      "write (made if missing), '' (no cache) or 'auto'"
    )
  if problem:
    logging.warning("no compilation cache: %s (train.compilation_cache=auto)", problem)
  return None if problem else path


def use_compilation_cache(setting: str) -> str | None:
  """Points JAX's persistent compilation cache at `compilation_cache_dir(setting)` before
  anything compiles, so that a relaunch, a resume or another seed of the same program loads
  what an earlier launch compiled instead of compiling it again; returns the directory."""
  import jax

  path = compilation_cache_dir(setting)
  jax.config.update("jax_compilation_cache_dir", path)
  return path


def _unwritable(path: str) -> str | None:
  """Why the directory `path` cannot hold the cache (a file is there, or the directory or its
  nearest existing parent is not writable), or None."""
  if os.path.exists(path) and not os.path.isdir(path):
    return f"{path} is a file, not a directory"
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing.rstrip(os.sep)) or os.curdir
  if not os.path.isdir(existing):
    return f"{existing} is a file, not a directory"
  if not os.access(existing, os.W_OK | os.X_OK):
    return f"{existing} is not writable"
  return None
