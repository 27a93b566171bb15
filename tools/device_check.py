"""Every fast path `auto` may choose, checked on this machine against its reference.

  python tools/device_check.py [--interpret] [--json=PATH]

Runs each check of `jaxrl_llm.kernels.verify` (the Mosaic GPU grouped matmul forward and both
backward kernels, cuDNN attention at an odd length with padding, the bf16 and int8 sampler
copies, the chunked log-probs) in values and gradients, and prints a Markdown table headed by
the device kind and the JAX version. A check that cannot run here says why (`skip`). With
`--interpret` the grouped forward kernel runs under the Pallas GPU interpreter (on CPU).
Exit status 1 when any check fails or errors, else 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run from a checkout without installing it
  sys.path.insert(0, _REPO)

import jax  # noqa: E402

from jaxrl_llm import fast_paths, launch, paths, terminal  # noqa: E402, F401  (fast_paths: the checks)
from jaxrl_llm.kernels import verify  # noqa: E402


def main(argv: list[str]) -> int:
  """Parse flags, run the checks, print the table (and write JSON); 1 if any failed."""
  parser = terminal.ArgParser(description=__doc__.splitlines()[0])
  parser.add_argument("--interpret", action="store_true", help="grouped kernels interpreted")
  parser.add_argument("--json", help="also write the results here as JSON")
  args = parser.parse_args(argv)
  if args.json is not None and (problem := paths.file_problem(args.json)):  # before the checks
    parser.error(f"--json={args.json} {problem}")
  launch.choose_backend()  # as the trainer's command line: a failing plugin's chatter kept off
  device = jax.devices()[0]
  results = verify.run_all(interpret=args.interpret)
  print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}")
  print(verify.table(results))
  if args.json is not None:  # its folders are made; an earlier file is replaced whole, or kept
    record = {"device_kind": device.device_kind, "jax": jax.__version__}
    record["results"] = [dataclasses.asdict(r) for r in results]
    paths.makedirs(os.path.dirname(os.path.abspath(args.json)))
    paths.write_text(args.json, json.dumps(record, indent=1))
  return int(any(r.status in ("fail", "error") for r in results))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
