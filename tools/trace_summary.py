"""Where a profiled step's device time goes: the top kernels of a `jax.profiler` trace.

  python tools/trace_summary.py DIR [--top=15] [--device=GPU]

Reads the newest `perfetto_trace.json.gz` under DIR (written by
`jax.profiler.trace(DIR, create_perfetto_trace=True)`; `tools/bench.py --profile_dir=DIR`
makes one of a warm fused step; the trainer's `--config.train.profile_steps=N` one of N RL updates in
its local workdir) and prints one JSON object: the device's busy time, the span
from its first to its last kernel, and the kernels with the most total time, each with its
count and share of the busy time. The same trace opens in TensorBoard's profile plugin. Busy time is
the sum over the listed processes' events: where they overlap (several devices or streams, or on
the CPU a program's event around the ops it runs) it can exceed the span, and a share is a share
of that sum, not of the wall time.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import math
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run from a checkout without installing it
  sys.path.insert(0, _REPO)

from jaxrl_llm import terminal  # noqa: E402


def newest_trace(root: str) -> str:
  """The newest perfetto trace under `root` (FileNotFoundError naming `root` if none)."""
  if os.path.isfile(root):
    raise FileNotFoundError(f"{root} is a file; give the directory jax.profiler.trace wrote")
  if not os.path.isdir(root):
    raise FileNotFoundError(f"{root}: no such directory; give the one jax.profiler.trace wrote")
  pattern = os.path.join(glob.escape(root), "**", "*perfetto_trace.json.gz")
  paths = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {root}")
  return max(paths, key=os.path.getmtime)


def _field(event: dict, key: str, kind: type | tuple[type, ...], want: str, within=None):
  """`event[key]` when it is a `kind` (a finite one for a number), else ValueError naming the
  event (`within`, when `event` is a part of it) and what it should hold."""
  value = event.get(key)
  finite = not isinstance(value, float) or math.isfinite(value)
  if isinstance(value, bool) or not isinstance(value, kind) or not finite:
    shown = json.dumps(event if within is None else within)
    raise ValueError(f"event {shown[:100]}{'...' if len(shown) > 100 else ''}: want {want}")
  return value


def summarize(events: list[dict], device: str = "GPU", top: int = 15) -> dict[str, object]:
  """Busy time, span and top kernels of the complete events ("ph": "X") of the processes
  whose name contains `device` (e.g. "/device:GPU:0")."""
  names = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      pid = _field(e, "pid", (int, str), "a pid (a number or a string)")
      args = _field(e, "args", dict, 'args holding the process name: {"name": "..."}')
      names[pid] = _field(args, "name", str, "args.name: a process name (a string)", e)
  pids = {pid for pid, name in names.items() if device.lower() in name.lower()}
  total, count = collections.Counter(), collections.Counter()
  first, last = float("inf"), float("-inf")
  for e in events:
    pid = e.get("pid")
    if e.get("ph") != "X" or not isinstance(pid, (int, str)) or pid not in pids or "dur" not in e:
      continue
    name = _field(e, "name", str, "a kernel name (a string)")
    ts, dur = (
      _field(e, k, (int, float), f"{k}: a finite number (microseconds)") for k in ("ts", "dur")
    )
    total[name] += float(dur)
    count[name] += 1
    first, last = min(first, float(ts)), max(last, float(ts) + float(dur))
  busy = sum(total.values())
  rows = [
    {"kernel": k[:120], "ms": v / 1e3, "count": count[k], "share": v / busy if busy else 0.0}
    for k, v in total.most_common(top)
  ]
  span = (last - first) / 1e3 if busy else 0.0
  if not pids:  # name what there is, so the next call can pick the right --device
    return {"processes": [], "all_processes": sorted(set(names.values())), "top": []}
  return {
    "processes": sorted(names[p] for p in pids),
    "busy_ms": busy / 1e3,
    "span_ms": span,
    "top": rows,
  }


def main(argv: list[str]) -> int:
  """Parse flags, summarise the newest trace under DIR, print JSON."""
  parser = terminal.ArgParser(description=__doc__.splitlines()[0])
  parser.add_argument("root", help="the directory given to jax.profiler.trace")
  parser.add_argument("--top", type=terminal.count, default=15, help="kernels listed")
  parser.add_argument("--device", default="GPU", help="substring of the device processes' names")
  args = parser.parse_args(argv)
  try:
    path = newest_trace(args.root)
  except FileNotFoundError as e:
    hint = "make one with tools/bench.py --profile_dir=DIR, or train with train.profile_steps=N"
    print(f"error: {e} ({hint})", file=sys.stderr)
    return 2
  try:
    summary = summarize(read_events(path), args.device, args.top)
  except ValueError as e:
    print(f"error: {path}: {e}", file=sys.stderr)
    return 2
  print(json.dumps(summary, indent=1))
  if not summary["processes"]:  # e.g. a CPU run's trace read with the default --device=GPU
    there = ", ".join(summary["all_processes"]) or "none"
    print(
      f"note: no process named like --device={args.device} in {path} (its processes: {there}); "
      "pick one of them with --device",
      file=sys.stderr,
    )
  return 0


def read_events(path: str) -> list[dict]:
  """The trace events of the gzipped perfetto trace at `path`; ValueError says why a file is
  not one (not gzip, cut short, not JSON, no list of events)."""
  try:
    with gzip.open(path, "rt") as f:
      trace = json.load(f)
  except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"not a readable gzipped JSON trace ({type(e).__name__}: {e})") from None
  events = trace.get("traceEvents") if isinstance(trace, dict) else trace
  if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
    raise ValueError("not a trace: want a JSON list of events, or an object with traceEvents")
  return events


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
