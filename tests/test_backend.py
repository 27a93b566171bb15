"""The backend choice: JAX_PLATFORMS obeyed, otherwise JAX's pick, a CPU fall-back said in one
line, and a failed plugin's native chatter kept off the terminal. Each case runs in a fresh
process, since a process starts its backends once (the test process has JAX_PLATFORMS=cpu)."""

import importlib.util
import subprocess
import sys

import pytest
from conftest import REPO, cli_env

from jaxrl_llm import backend
from jaxrl_llm.config import ConfigError

# A backend plugin that fails to start, as a GPU or TPU plugin does on a machine without the
# device: it writes to the native stderr first, as libtpu does.
_FAILING = """
import os
from jax._src import xla_bridge
def failing():
  os.write(2, b"E0000 plugin start-up chatter\\n")
  raise RuntimeError("NOT_FOUND: no such device here")
xla_bridge.register_backend_factory("failing", failing, priority=900)
"""

_CHOOSE = """
from absl import logging
logging.set_verbosity(logging.INFO)
from jaxrl_llm import backend
from jaxrl_llm.config import ConfigError
try:
  print(backend.choose(debug={debug}))
  backend.log_fallback()
except backend.BackendError as e:
  print(f"error: {{e}}")
"""


def _choose(platforms: str | None, failing: bool = False, debug: bool = False):
  """Runs backend.choose in a fresh process; returns (stdout, stderr lines)."""
  # libtpu's lock (/tmp/libtpu_lockfile) held by another process (a TPU plan compiling beside
  # the tests) would make libtpu fail as "in use", not "no TPU": the lock is not what is tested.
  env = cli_env("JAX_PLATFORMS") | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  if platforms is not None:
    env["JAX_PLATFORMS"] = platforms
  code = (_FAILING if failing else "") + _CHOOSE.format(debug=debug)
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc.stdout.strip(), proc.stderr.splitlines()


def _said(lines: list[str], text: str) -> list[str]:
  return [line for line in lines if text in line]


def test_unset_lets_jax_pick_and_a_cpu_fallback_says_why_in_one_line():
  """No JAX_PLATFORMS: JAX's pick; on this machine the CPU, with one line naming the reason."""
  out, err = _choose(None)
  if out != "cpu":
    pytest.skip(f"this machine has an accelerator backend ({out})")
  said = _said(err, "running on the CPU: ")
  assert len(said) == 1, err
  if importlib.util.find_spec("libtpu"):  # the tpu extra on a machine without a TPU: no failure
    assert "no accelerator device here (tpu: installed, but this machine has no TPU)" in said[0]
    assert not _said(err, "InitGoogle") and not _said(err, "TPU_WORKER"), err  # libtpu's chatter
  else:
    assert "no accelerator backend is installed" in said[0], said


def test_a_backend_that_is_absent_is_not_blamed():
  """JAX's TPU client without libtpu ("Failed to open libtpu.so"), or libtpu without a TPU:
  what is absent, not a failure; a real failure is named beside them."""
  plain = {"tpu": "INTERNAL: Failed to open libtpu.so: cannot open shared object file"}
  assert backend.absent(plain) == {"tpu": "not installed"}
  assert backend.cpu_reason(plain).startswith("no accelerator backend is installed (jax[cuda12]")
  no_tpu = {"tpu": "NOT_FOUND: TPU initialization failed: No jellyfish device found."}
  assert backend.cpu_reason(no_tpu) == (
    "no accelerator device here (tpu: installed, but this machine has no TPU)"
  )
  both = {**no_tpu, "cuda": "INTERNAL: CUDA driver version is insufficient"}
  assert backend.cpu_reason(both) == (
    "no accelerator backend started (cuda: INTERNAL: CUDA driver version is insufficient)"
  )


def test_a_failing_backend_falls_back_with_its_reason_and_its_chatter_stays_in_the_log():
  """A plugin that fails: CPU, one line naming the plugin and its error; its native stderr
  output reaches the terminal only under debug, as a log line."""
  out, err = _choose(None, failing=True)
  assert out == "cpu"
  said = _said(err, "running on the CPU: ")
  assert len(said) == 1 and "failing: NOT_FOUND: no such device here" in said[0], err
  assert not _said(err, "plugin start-up chatter"), err
  out, err = _choose(None, failing=True, debug=True)
  chatter = _said(err, "plugin start-up chatter")
  assert len(chatter) == 1 and "backend start-up: " in chatter[0], err


_LOCK_HELD = _FAILING.replace(
  "NOT_FOUND: no such device here",
  "ABORTED: The TPU is already in use by process with pid 4242. Not attempting to load "
  'libtpu.so in this process.\\nRun \\"$ sudo rm /tmp/libtpu_lockfile\\".',
)


@pytest.mark.parametrize("tpu_here", [True, False])
def test_a_tpu_held_by_another_process_is_said_so_without_the_advice_to_delete_its_lock(tpu_here):
  """libtpu, when another process holds its lock, advises `sudo rm /tmp/libtpu_lockfile`, which
  would break that process: where the machine shows TPU device files the fall-back line (a
  warning) says the TPU is busy instead; where it shows none (libtpu takes the lock before it
  looks for a TPU: a CPU-only process beside holds it) the line (info) says there is no TPU."""
  devices = "backend.TPU_DEVICE_FILES = ('/',)\n" if tpu_here else ""
  code = _LOCK_HELD + _CHOOSE.format(debug=False).replace("try:\n", devices + "try:\n")
  if not tpu_here and any(__import__("glob").glob(p) for p in backend.TPU_DEVICE_FILES):
    pytest.skip("this machine shows TPU device files")
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO,
    env=cli_env("JAX_PLATFORMS"), capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  said = _said(proc.stderr.splitlines(), "running on the CPU: ")
  assert proc.stdout.strip() == "cpu" and len(said) == 1, proc.stderr[-2000:]
  if tpu_here:
    assert said[0].startswith("WARNING") and "failing: the TPU is held by another" in said[0]
  else:
    assert said[0].startswith("INFO") and "no accelerator device here (" in said[0], said
    assert "failing: installed, but this machine has no FAILING" in said[0], said
  assert "sudo rm" not in proc.stderr, proc.stderr[-2000:]


def test_jax_platforms_is_obeyed():
  """JAX_PLATFORMS=cpu: the CPU without a fall-back line, even beside a failing plugin; a
  named backend that cannot start (or has no plugin) is one error line, no fall-back."""
  out, err = _choose("cpu", failing=True)
  assert out == "cpu" and not _said(err, "running on the CPU"), err
  out, err = _choose("failing", failing=True)
  assert out.startswith("error: JAX_PLATFORMS=failing names a backend that could not start: ")
  assert "no such device here" in out and "cpu always starts" in out, out
  assert not _said(err, "plugin start-up chatter"), err
  out, _ = _choose("nosuchplatform")
  assert out.startswith("error: JAX_PLATFORMS=nosuchplatform names a backend"), out


def test_command_line_refuses_a_backend_that_cannot_start(tmp_path):
  """The trainer's command line: one `error:` line and exit 2 before anything is built."""
  env = cli_env()
  env["JAX_PLATFORMS"] = "nosuchplatform"
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py"]
  proc = subprocess.run(
    [*cmd, f"--workdir={tmp_path / 'w'}"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "JAX_PLATFORMS=nosuchplatform" in errors[0], proc.stderr
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "w" / "checkpoints").exists()


_DRY_RUNS = {
  "trainer": "from jaxrl_llm import main\nsys.argv = ['main', '--config=configs/default.py', "
  "'--dry_run', *TINY]\nmain.run()",
  "packed sweep": "sys.path.insert(0, 'tools')\nimport sweep\nsys.exit(sweep.main(["
  "'--config=configs/default.py', f'--root={ROOT}', '--seeds=0,1', '--packed', '--dry_run', "
  "*(f'--set={a.removeprefix(\"--config.\")}' for a in TINY)]))",
}


@pytest.mark.slow
@pytest.mark.parametrize("which", list(_DRY_RUNS))
def test_a_dry_run_keeps_a_failing_plugins_chatter_off_the_terminal(tmp_path, which):
  """`--dry_run` (the trainer's, and a packed sweep's) starts the backends as a run does: a
  failing plugin's native stderr stays off the terminal (libtpu's six lines, on a machine with
  the tpu extra and no TPU, were printed around the plan's one line)."""
  from conftest import TINY_CLI

  code = (
    _FAILING
    + f"import sys\nTINY = {list(TINY_CLI)!r}\nROOT = {str(tmp_path / 'pack')!r}\n"
    + _DRY_RUNS[which]
  )
  env = cli_env("JAX_PLATFORMS") | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # libtpu's lock: others'
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip().splitlines()[-1].startswith("dry run: "), proc.stdout
  assert "plugin start-up chatter" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_device_check_keeps_a_failing_plugins_chatter_off_the_terminal(tmp_path):
  """tools/device_check.py (as bench.py and decode_copies.py) starts the backends as the
  trainer does: a failing plugin's native stderr stays off the terminal, where libtpu's six
  lines were printed above the table on a machine with the tpu extra and no TPU."""
  code = _FAILING + (
    "import sys\nsys.path.insert(0, 'tools')\nimport device_check\n"
    f"sys.exit(device_check.main(['--json={tmp_path / 'checks.json'}']))"
  )
  env = cli_env("JAX_PLATFORMS") | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # libtpu's lock: others'
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("device: "), proc.stdout[:500]
  assert "plugin start-up chatter" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
  "flags, num, added",
  [
    ("--xla_force_host_platform_device_count=4", "", True),
    ("--xla_backend_optimization_level=1 --xla_force_host_platform_device_count=8", "", True),
    ("--xla_force_host_platform_device_count=1", "", False),  # one device: no collective
    ("", "", False),
    ("--xla_force_host_platform_device_count=4 "
     "--xla_cpu_enable_concurrency_optimized_scheduler=true", "", False),  # the user's: kept
    ("", "4", True),  # JAX_NUM_CPU_DEVICES=4 makes 4 devices too (it was missed)
    ("--xla_backend_optimization_level=1", "2", True),
    ("", "1", False),
    ("", "\u00b2", False),  # a superscript two: a digit to isdigit, no number to int
  ],
)  # fmt: skip
def test_several_cpu_devices_in_one_process_get_the_plain_scheduler(flags, num, added):
  out = backend.cpu_device_flags(flags, num)
  plain = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
  assert out == (f"{flags} {plain}".strip() if added else flags)


@pytest.mark.parametrize(
  "setting, environ, want",
  [
    ("auto", {"HOME": "/h"}, "/h/.cache/jaxrl_llm/xla"),
    ("auto", {"HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/x/jaxrl_llm/xla"),
    ("auto", {"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": "/j"}, "/j"),
    ("auto", {"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": ""}, None),  # set empty: none
    ("", {"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": "/j"}, None),
    ("/d", {"JAX_COMPILATION_CACHE_DIR": "/j"}, "/d"),
    ("gs://bucket/xla", {}, "gs://bucket/xla"),
  ],
)
def test_the_compilation_cache_setting_names_its_directory(setting, environ, want):
  """`train.compilation_cache`: "auto" is the environment's JAX_COMPILATION_CACHE_DIR where it
  is set (set empty: none), else under $XDG_CACHE_HOME or ~/.cache; "" none; else the
  directory named (not made here: the first compiled program makes it)."""
  assert backend.compilation_cache_dir(setting, environ) == want


def test_a_compilation_cache_that_cannot_be_a_directory_is_one_line_or_none_for_auto(
  tmp_path, caplog
):
  """A named directory that is a file, or lies under one, is a ConfigError naming the setting
  and what is allowed; "auto"'s default directory under a file is none, with a warning: a
  home the run cannot write to must not stop it."""
  (tmp_path / "file").write_text("")
  for setting in (str(tmp_path / "file"), str(tmp_path / "file" / "xla")):
    with pytest.raises(ConfigError) as err:
      backend.compilation_cache_dir(setting, {})
    line = str(err.value)
    assert line.startswith(f"train.compilation_cache={setting!r}: {tmp_path / 'file'} is a file")
    assert "allowed: a directory this process can write" in line and "\n" not in line
  with caplog.at_level("WARNING"):
    assert backend.compilation_cache_dir("auto", {"XDG_CACHE_HOME": str(tmp_path / "file")}) is None
  assert "no compilation cache: " in caplog.text and "is a file" in caplog.text
