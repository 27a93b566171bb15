"""What a policy scores on a task's held-out split without solving anything: its trivial
answers' accuracy, to read beside the policy's.

  python tools/trivial_answers.py                                  # every built-in task
  python tools/trivial_answers.py --config=configs/countdown.py    # a config's task
  python tools/trivial_answers.py --config=configs/countdown.py --config.task.numbers=3
  python tools/trivial_answers.py --config=configs/smollm2_arith.py --evaluated

For a built-in task: its rules over the prompt (an operand, the first two added, every digit
chained by fixed operators, the string echoed, ...) and its best constant answer, scored by the
task's own verifier on its evaluation set (`jaxrl_llm.data.tasks.trivial`). For the arithmetic
word problems of configs/smollm2_arith.py (records with `operands`): `arith.trivial_baselines`
on its held-out records, read as the trainer reads them (`data.eval_files`, or without them the
`data.eval_fraction` split of `data.train_files`), or with `--evaluated` on the first
`task.eval_size` records, the problems the trainer's evaluation scores (every prompt of
tools/make_arith.py fits the config's `data.prompt_len`, so none is skipped). Prints
one markdown table per task, best first (`--json`: one JSON object).
A bad config or a malformed record ends with one `error:` line and exit code 2.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXIT_BAD_INPUT = 2
FLAGS = ("--json", "--evaluated")  # besides --config and its overrides
CONFIG_FLAGS = ("--config=", "--config.")  # --config=FILE[:SETTING], --config.FIELD=VALUE
KNOWN = (
  "trivial answers are known for the built-in tasks and for arithmetic records with `operands` "
  "(tools/make_arith.py)"
)


def _eval_records(cfg) -> list[dict]:
  """The held-out records of a file config as the trainer reads them (`data.eval_files`, a
  comma-separated list, or without them the `data.eval_fraction` share of `data.train_files`),
  each with its `operands`: one `ValueError` naming the file, the record and what is wrong."""
  from jaxrl_llm.data import file_task, records

  d = cfg.data
  fields = {"prompt_field": d.prompt_field, "answer_field": d.answer_field}
  split = lambda spec: [f.strip() for f in (spec or "").split(",") if f.strip()]  # noqa: E731
  eval_files = split(d.eval_files)
  try:
    if eval_files:
      out = records.load_records(eval_files, **fields, metadata_fields=("operands",))
    else:  # the trainer's split of the train files, by the same key
      loaded = records.load_records(split(d.train_files), **fields, metadata_fields=("operands",))
      out = records.train_eval_split(
        loaded, eval_fraction=d.eval_fraction, seed=file_task.SPLIT_KEY
      )[1]
  except (FileNotFoundError, records.DataError) as e:
    named = (
      f"data.eval_files={d.eval_files!r}" if eval_files else f"data.train_files={d.train_files!r}"
    )
    more = f"; {KNOWN}" if "'operands'" in str(e) else ""
    raise ValueError(f"{named}: {e}{more}") from e
  if not out:
    raise ValueError(
      "the evaluation split is empty: set data.eval_files or a data.eval_fraction > 0"
    )
  for k, r in enumerate(out):
    ops = r["operands"]
    if not (isinstance(ops, list) and ops and all(type(x) is int for x in ops)):
      raise ValueError(
        f"held-out record {k} ({r['prompt'][:40]!r}): operands={ops!r}; want a non-empty list "
        "of integers"
      )
    try:
      int(r["answer"])
    except ValueError:
      raise ValueError(
        f"held-out record {k} ({r['prompt'][:40]!r}): answer={r['answer']!r}; want an integer"
      ) from None
  return out


def _file_table(cfg, evaluated: bool = False) -> dict:
  """The arithmetic records' trivial baselines (their held-out records' `operands`; with
  `evaluated`, the first `task.eval_size` records')."""
  from jaxrl_llm.data import arith

  records = _eval_records(cfg)
  if evaluated and cfg.task.eval_size:
    records = records[: cfg.task.eval_size]
  table = arith.trivial_baselines(records)
  rules = {k: v for k, v in table.items() if k not in ("best", "best_rule")}
  return {"task": "arith", "n": len(records), "rules": rules, "best": table["best"],
          "best_rule": table["best_rule"]}  # fmt: skip


def tables(argv: list[str]) -> list[dict]:
  """The trivial-answer table of the config in `argv` (every built-in task without one)."""
  from jaxrl_llm.data import tasks
  from jaxrl_llm.data.tasks.trivial import trivial_table

  configs = [a for a in argv if a.startswith(CONFIG_FLAGS)]
  if not configs:
    return [trivial_table(tasks.get_task(name)) for name in sorted(tasks.TASKS)]
  from jaxrl_llm import launch
  from jaxrl_llm.config import parse

  cfg = parse(launch.parse_config(["trivial_answers.py", *configs]))
  if not cfg.uses_files:
    return [trivial_table(tasks.get_task(cfg.task.name, **cfg.task.task_fields))]
  return [_file_table(cfg, "--evaluated" in argv)]


def markdown(table: dict) -> str:
  """One task's table: rule and held-out accuracy, best first."""
  lines = [f"{table['task']} ({table['n']} held-out problems): best {table['best']:.3f} "
           f"({table['best_rule']})", "", "| trivial answer | held-out accuracy |", "|---|---|"]  # fmt: skip
  for rule, acc in sorted(table["rules"].items(), key=lambda kv: -kv[1]):
    lines.append(f"| `{rule}` | {acc:.3f} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  """Prints the tables; a bad config or flag is one `error:` line, exit code 2."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if {"-h", "--help"} & set(argv):
    print(__doc__.strip())
    return 0
  unknown = [a for a in argv if not a.startswith(CONFIG_FLAGS) and a not in FLAGS]
  if unknown:
    print(f"error: unknown flag {unknown[0]}; want --config=FILE, --config.FIELD=VALUE, "
          f"{', '.join(FLAGS)} or --help", file=sys.stderr)  # fmt: skip
    return EXIT_BAD_INPUT
  from absl import flags

  from jaxrl_llm import backend

  backend.choose()  # as the trainer's command line does: no backend's start-up chatter here
  try:
    out = tables([a for a in argv if a != "--json"])  # --evaluated is read by `tables`
  except (ValueError, OSError, flags.Error) as e:  # flags.Error: an override's value or form
    print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    return EXIT_BAD_INPUT
  if "--json" in argv:
    print(json.dumps(out if len(out) > 1 else out[0], indent=2))
  else:
    print("\n\n".join(map(markdown, out)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
