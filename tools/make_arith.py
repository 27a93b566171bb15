"""Writes the arithmetic word-problem dataset (`jaxrl_llm.data.arith`) as prompt files.

  python tools/make_arith.py OUT_DIR [--n_train=20000] [--n_eval=500] [--seed=0] [--overwrite]

Writes OUT_DIR/train.jsonl, OUT_DIR/eval.jsonl (records with `prompt` and `answer` fields, for
`--config.data.train_files` / `--config.data.eval_files` with
`--config.data.correct_term=answer_line_correct`) and OUT_DIR/trivial.json, the held-out accuracy
of trivial answers, which it also prints as JSON. An OUT_DIR that already holds one of them is
refused unless `--overwrite` is given, and so are more than 1,000,000 training or 100,000 held-out
problems (about 2 and 3 minutes of drawing here). Bad arguments end with one line on stderr,
`error: <what is wrong>`, and exit code 2 (nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_llm.terminal import ArgParser

EXIT_BAD_INPUT = 2
# The largest splits drawn: about 0.1 ms a training problem and 1.5 ms a held-out one on one core
# (the held-out split keeps 1 draw in 10), so a mistyped count is refused, not hours of drawing.
MAX_TRAIN, MAX_EVAL = 1_000_000, 100_000


class ArgError(Exception):
  """A bad command line (reported as one `error:` line, exit code 2)."""


def build_parser() -> argparse.ArgumentParser:
  """The command line: OUT_DIR and the split sizes and seed."""
  p = ArgParser(raise_as=ArgError, prog="make_arith.py", description=__doc__.split("\n", 1)[0])
  p.add_argument("out_dir", help="directory for train.jsonl, eval.jsonl and trivial.json")
  p.add_argument("--n_train", type=int, default=20000, help="training problems (default 20000)")
  p.add_argument("--n_eval", type=int, default=500, help="held-out problems (default 500)")
  p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
  p.add_argument("--overwrite", action="store_true", help="replace the files of an earlier write")
  return p


def main(argv=None) -> dict:
  """Parses the arguments and writes the splits; returns `arith.write_splits`'s summary."""
  args = build_parser().parse_args(argv)
  if not (0 <= args.n_train <= MAX_TRAIN and 1 <= args.n_eval <= MAX_EVAL):
    raise ArgError(
      f"--n_train={args.n_train} --n_eval={args.n_eval}: need 0 <= n_train <= {MAX_TRAIN} "
      f"and 1 <= n_eval <= {MAX_EVAL}"
    )
  if not args.out_dir.strip():
    raise ArgError("OUT_DIR is empty; want the directory for train.jsonl, eval.jsonl, trivial.json")
  if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
    raise ArgError(f"{args.out_dir}: exists and is not a directory")
  names = ("train.jsonl", "eval.jsonl", "trivial.json")
  there = [n for n in names if os.path.lexists(os.path.join(args.out_dir, n))]
  if there and not args.overwrite:
    raise ArgError(
      f"{args.out_dir} already holds {', '.join(there)}; pass --overwrite to replace them, or "
      "name another OUT_DIR"
    )
  blocked = [n for n in there if os.path.isdir(os.path.join(args.out_dir, n))]
  if blocked:  # os.replace would fail there after the files before it were replaced
    raise ArgError(f"{os.path.join(args.out_dir, blocked[0])}: is a directory, not a file")
  from jaxrl_llm.data import arith

  return arith.write_splits(args.out_dir, n_train=args.n_train, n_eval=args.n_eval, seed=args.seed)


def cli(argv=None) -> int:
  """Runs `main` and prints the trivial-answer table; a bad argument prints one `error:` line
  to stderr and returns exit code 2."""
  try:
    summary = main(sys.argv[1:] if argv is None else list(argv))
  except (ArgError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  print(json.dumps(summary["baselines"], indent=2))
  print(f"wrote {summary['n_train']} train and {summary['n_eval']} eval problems to "
        f"{os.path.dirname(summary['train']) or '.'}", file=sys.stderr)  # fmt: skip
  return 0


if __name__ == "__main__":
  sys.exit(cli())
