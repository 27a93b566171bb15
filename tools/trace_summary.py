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

import argparse
import collections
import glob
import gzip
import json
import os
import sys


def newest_trace(root: str) -> str:
  """The newest perfetto trace under `root` (FileNotFoundError naming `root` if none)."""
  paths = glob.glob(os.path.join(root, "**", "*perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {root}")
  return max(paths, key=os.path.getmtime)


def summarize(events: list[dict], device: str = "GPU", top: int = 15) -> dict[str, object]:
  """Busy time, span and top kernels of the complete events ("ph": "X") of the processes
  whose name contains `device` (e.g. "/device:GPU:0")."""
  names = {
    e["pid"]: e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  pids = {pid for pid, name in names.items() if device.lower() in name.lower()}
  total, count = collections.Counter(), collections.Counter()
  first, last = float("inf"), float("-inf")
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in pids or "dur" not in e:
      continue
    total[e["name"]] += float(e["dur"])
    count[e["name"]] += 1
    first, last = min(first, float(e["ts"])), max(last, float(e["ts"]) + float(e["dur"]))
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
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("root", help="the directory given to jax.profiler.trace")
  parser.add_argument("--top", type=int, default=15, help="kernels listed")
  parser.add_argument("--device", default="GPU", help="substring of the device processes' names")
  args = parser.parse_args(argv)
  try:
    path = newest_trace(args.root)
  except FileNotFoundError as e:
    print(f"error: {e} (make one with tools/bench.py --profile_dir=DIR)", file=sys.stderr)
    return 2
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  print(json.dumps(summarize(events, args.device, args.top), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
