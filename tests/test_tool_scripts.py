"""The measuring tools run as the docs say: `tools/soak.py` (host memory over a run),
`tools/trace_summary.py` (where a profiled program's device time goes) and
`tools/decode_copies.py` (the sampler alone and packed: seconds and KV-cache copies); the GPU
scripts' output as they run and the parts they cut the model's wheel into."""

import json
import os
import subprocess
import sys
import tarfile

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO, TINY_CLI, cli_env

TINY = (
  *TINY_CLI,
  "--config.sft.steps=0",
  "--config.train.log_every=1",
  "--config.train.eval_every=100",
)


def _tool(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, *args], cwd=REPO, env=cli_env(), capture_output=True, text=True,
    timeout=timeout,
  )  # fmt: skip


@pytest.mark.extended
def test_soak_samples_the_trainers_host_memory_over_its_steps(tmp_path):
  """`tools/soak.py --steps=N -- <overrides>` runs the trainer in the given workdir and prints
  one JSON object: its exit status, the RSS at the first logged step, at each quarter and at the
  end, the largest seen (at least each of those; MiB, so below the machine's memory) and the
  growth (end - first)."""
  proc = _tool(
    "tools/soak.py", "--steps=8", "--interval_s=0.2", f"--workdir={tmp_path / 'run'}", "--", *TINY
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["returncode"] == 0 and got["steps"] == 8
  quarters, first, end = got["rss_mib_quarters"], got["rss_mib_first_step"], got["rss_mib_end"]
  assert len(quarters) == 4 and first > 50 and end > 50  # a Python process with JAX: > 50 MiB
  assert got["rss_mib_max"] >= max(first, end, *quarters)
  assert got["rss_mib_max"] < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
  assert got["growth_mib"] == pytest.approx(end - first, abs=0.11)
  assert (tmp_path / "run" / "checkpoints" / "8").is_dir()  # the trainer ran to its end


def test_trace_summary_lists_a_real_traces_top_kernels(tmp_path):
  """`tools/trace_summary.py DIR --device=CPU` reads the perfetto trace jax.profiler wrote:
  the CPU process, its busy time, and the top kernels by total time (at most --top, largest
  first, shares of the busy time). For a device the trace lacks (the default GPU) it names the
  processes there are; for a directory without a trace it prints one error line, exit 2."""
  fn = jax.jit(lambda x: jnp.sin(x @ x).sum())
  x = jnp.ones((128, 128))
  fn(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path / "trace"), create_perfetto_trace=True):
    for _ in range(3):
      fn(x).block_until_ready()
  proc = _tool("tools/trace_summary.py", str(tmp_path / "trace"), "--device=CPU", "--top=3")
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = json.loads(proc.stdout)
  top = got["top"]
  assert got["processes"] == ["/host:CPU"] and 1 <= len(top) <= 3
  assert [r["ms"] for r in top] == sorted((r["ms"] for r in top), reverse=True)
  assert got["busy_ms"] >= sum(r["ms"] for r in top) > 0 and got["span_ms"] > 0
  assert all(r["count"] >= 1 and r["share"] == pytest.approx(r["ms"] / got["busy_ms"]) for r in top)
  other = json.loads(_tool("tools/trace_summary.py", str(tmp_path / "trace")).stdout)
  assert other["processes"] == other["top"] == [] and "/host:CPU" in other["all_processes"]
  (tmp_path / "none").mkdir()
  missing = _tool("tools/trace_summary.py", str(tmp_path / "none"))
  assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
    f"error: no perfetto_trace.json.gz under {tmp_path / 'none'} (make one with "
    "tools/bench.py --profile_dir=DIR, or train with train.profile_steps=N)"
  ]


def _trace(root, fn, x) -> str:
  """Traces three calls of `fn(x)` (compiled before) into `root`; returns its perfetto trace."""
  fn(x).block_until_ready()
  with jax.profiler.trace(str(root), create_perfetto_trace=True):
    for _ in range(3):
      fn(x).block_until_ready()
  (path,) = [str(p) for p in root.rglob("*perfetto_trace.json.gz")]
  return path


def test_trace_summary_reads_the_newest_trace_under_the_directory(tmp_path):
  """With two traces under DIR, `tools/trace_summary.py DIR` summarises the one written last
  (by modification time, not by path order): its program is listed, the other's is not."""

  def in_the_newer_trace(x):
    return jnp.cos(x @ x).sum()

  def in_the_older_trace(x):
    return jnp.tanh(x + 1).max()

  x = jnp.ones((64, 64))
  newer = _trace(tmp_path / "a", jax.jit(in_the_newer_trace), x)
  older = _trace(tmp_path / "b", jax.jit(in_the_older_trace), x)  # "b" after "a", written later
  os.utime(older, (os.path.getmtime(newer) - 60,) * 2)  # but older by its modification time
  proc = _tool("tools/trace_summary.py", str(tmp_path), "--device=CPU", "--top=100000")
  assert proc.returncode == 0, proc.stderr[-2000:]
  kernels = " ".join(r["kernel"] for r in json.loads(proc.stdout)["top"])
  assert "in_the_newer_trace" in kernels and "in_the_older_trace" not in kernels, kernels[:3000]


@pytest.mark.extended
def test_trace_summary_of_the_benchs_profiled_warm_step(tmp_path):
  """The docs' chain: `tools/bench.py --shape=tiny --profile_dir=DIR` then
  `tools/trace_summary.py DIR`: the trace holds the fused step; with every kernel listed the
  shares add up to 1 and the times to the busy time; the default --top=15 is the 15 largest."""
  bench = _tool(
    "tools/bench.py", "--shape=tiny", "--steps=1", f"--profile_dir={tmp_path}", timeout=600
  )
  assert bench.returncode == 0, bench.stderr[-3000:]
  assert json.loads(bench.stdout)["shape"] == "tiny"
  full = _tool("tools/trace_summary.py", str(tmp_path), "--device=CPU", "--top=100000")
  assert full.returncode == 0, full.stderr[-2000:]
  got = json.loads(full.stdout)
  rows = got["top"]
  assert got["processes"] == ["/host:CPU"] and len(rows) > 15
  assert any("fused_step" in r["kernel"] for r in rows), [r["kernel"] for r in rows[:50]]
  assert sum(r["share"] for r in rows) == pytest.approx(1.0)
  assert sum(r["ms"] for r in rows) == pytest.approx(got["busy_ms"])
  assert len({r["kernel"] for r in rows}) == len(rows)
  top15 = json.loads(_tool("tools/trace_summary.py", str(tmp_path), "--device=CPU").stdout)
  assert top15["top"] == rows[:15] and top15["busy_ms"] == got["busy_ms"]


@pytest.mark.extended
def test_trace_summary_of_the_trainers_profiled_steps(tmp_path):
  """`--config.train.profile_steps=2` traces updates 2 and 3 (after the compiling one) into the
  workdir; `tools/trace_summary.py <workdir>` reads that trace: the RL update ran twice in it
  (its jitted `fused_step`), and the run went on to its end."""
  run = tmp_path / "run"
  args = (*TINY, "--config.train.num_steps=4", "--config.train.profile_steps=2")
  proc = _tool("-m", "jaxrl_llm.main", "--config=configs/default.py", f"--workdir={run}", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "profiled steps 2..3" in proc.stderr
  (folder,) = (run / "plugins" / "profile").iterdir()
  assert {p.name for p in folder.glob("*perfetto_trace.json.gz")} == {"perfetto_trace.json.gz"}
  got = _tool("tools/trace_summary.py", str(run), "--device=CPU", "--top=100000")
  assert got.returncode == 0, got.stderr[-2000:]
  rows = json.loads(got.stdout)["top"]
  counts = {r["kernel"]: r["count"] for r in rows}
  assert any("fused_step" in k for k in counts), list(counts)[:40]
  (calls,) = [n for k, n in counts.items() if k.endswith(" rl_step")]  # the Python call
  assert calls == 2
  assert (run / "checkpoints" / "4").is_dir()


@pytest.mark.extended
def test_decode_copies_finds_no_cache_copy_in_the_scanned_bf16_sampler_alone_or_packed():
  """`tools/decode_copies.py --scan_layers --dtype=bfloat16` (the row in docs/sweeps.md): one JSON object
  with seconds, cache copies and cache writes for the sampler alone and in a pack of 1; no copy
  of a cache array in either decode loop, the cache written in place (one write per layer group
  and K/V), and the pack's tokens equal to the run's alone."""
  proc = _tool("tools/decode_copies.py", "--scan_layers", "--dtype=bfloat16", timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert (got["scan_layers"], got["dtype"], got["runs"]) == (True, "bfloat16", 1)
  for program in ("alone", "pack"):
    assert got[program]["s"] > 0 and got[program]["cache_copies"] == 0, got
    assert got[program]["cache_writes"] >= 2, got
  assert got["same_tokens"] is True


@pytest.mark.extended  # run it (-m extended) before a GPU session: its results depend on it
def test_gpu_card_writes_each_steps_output_into_out_as_it_runs(tmp_path):
  """tools/gpu_card.sh on this machine with one step (the import check), twice: its stdout and
  stderr go into $OUT/NAME.json and NAME.log as it runs and then into $OUT/card.tgz, its status
  into steps.txt, so $OUT holds 2 files however many steps ran (a device call brings back 8); an
  unknown step is one line, and a step past the budget, or past what it needs of it, is
  skipped, not started."""
  out = tmp_path / "out"
  env = {
    **cli_env(),
    "OUT": str(out),
    "WHEELS": str(tmp_path / "none"),
    "DONE": str(tmp_path / "done"),
  }
  proc = subprocess.run(
    ["bash", "tools/gpu_card.sh", "preflight", "nosuchstep", "preflight"],
    cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert sorted(f.name for f in out.iterdir()) == ["card.tgz", "steps.txt"]
  lines = (out / "steps.txt").read_text().splitlines()
  steps = [line for line in lines if line.startswith("== ") and not line.startswith("== done")]
  assert len(steps) == 2 and all(s.startswith("== preflight: rc=0 in ") for s in steps), lines
  assert lines[-1].startswith("== done in ") and any(line.startswith("jax ") for line in lines)
  with tarfile.open(out / "card.tgz") as tar:
    assert sorted(tar.getnames()) == [".", "./preflight.json", "./preflight.log"]
    assert "'jax':" in tar.extractfile("./preflight.json").read().decode()
  assert "== nosuchstep: no such step" in proc.stdout
  skipped = subprocess.run(
    ["bash", "tools/gpu_card.sh", "preflight"],
    cwd=REPO, env={**env, "BUDGET_S": "5"}, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert "== preflight: skipped" in skipped.stdout
  # the peer comparison needs 240 s of its 300: with less left it is not started to be cut off
  needy = subprocess.run(
    ["bash", "tools/gpu_card.sh", "qwen05_static_trl"],
    cwd=REPO, env={**env, "BUDGET_S": "200"}, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert "== qwen05_static_trl: skipped, " in needy.stdout, needy.stdout[-2000:]
  assert "s left (it needs 240s)" in needy.stdout, needy.stdout[-2000:]


def _wheels_sh(script: str, cwd) -> subprocess.CompletedProcess:
  """`script` in bash with tools/gpu_wheels.sh's functions sourced, in `cwd`."""
  lib = os.path.join(REPO, "tools", "gpu_wheels.sh")
  return subprocess.run(
    ["bash", "-c", f"source {lib} && {script}"], cwd=cwd, capture_output=True, text=True
  )


def test_a_wheel_too_large_for_one_invocation_goes_in_parts_that_join_to_it(tmp_path):
  """tools/gpu_wheels.sh's split_parts and join_parts, as tools/gpu_smollm2.sh cuts the model's
  wheel for invocations that each carry one part: the first part of its own size, the rest of
  another; joined only when every byte is there, else one line naming the parts held."""
  data = os.urandom(1000)
  (tmp_path / "w.whl").write_bytes(data)
  split = _wheels_sh("split_parts w.whl 300 250 parts", tmp_path)
  assert split.returncode == 0 and split.stdout.strip() == "4", split.stderr
  sizes = [(tmp_path / "parts" / f"part{i}").stat().st_size for i in range(4)]
  assert sizes == [300, 250, 250, 200]

  held = tmp_path / "held"
  held.mkdir()
  for i in (0, 1, 3):  # one invocation's part missing
    (held / f"part{i}").write_bytes((tmp_path / "parts" / f"part{i}").read_bytes())
  short = _wheels_sh("join_parts held 1000 joined.whl", tmp_path)
  assert short.returncode == 2 and not (tmp_path / "joined.whl").exists()
  assert short.stderr.count("\n") == 1
  assert "(part0 part1 part3 ) hold 750 of the 1000 bytes of joined.whl" in short.stderr
  (held / "part2").write_bytes((tmp_path / "parts" / "part2").read_bytes())
  joined = _wheels_sh("join_parts held 1000 joined.whl", tmp_path)
  assert joined.returncode == 0 and (tmp_path / "joined.whl").read_bytes() == data

  one = _wheels_sh("split_parts w.whl 1000 250 parts", tmp_path)  # it fits: one part, the old
  assert one.stdout.strip() == "1" and sorted(os.listdir(tmp_path / "parts")) == ["part0"]
  many = _wheels_sh("split_parts w.whl 100 100 parts", tmp_path)  # 1 + 9 parts: the most
  assert many.returncode == 0 and many.stdout.strip() == "10"
  over = _wheels_sh("split_parts w.whl 100 99 parts", tmp_path)
  assert over.returncode == 2 and "needs more than 10 parts" in over.stderr
  assert not list((tmp_path / "parts").iterdir())
