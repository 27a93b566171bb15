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
on its eval file, or with `--evaluated` on the first `task.eval_size` records, the problems the
trainer's evaluation scores (every prompt of tools/make_arith.py fits the config's
`data.prompt_len`, so none is skipped). Prints one markdown table per task, best first
(`--json`: one JSON object).
A bad config ends with one `error:` line and exit code 2.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXIT_BAD_INPUT = 2
FLAGS = ("--json", "--evaluated")  # besides --config and its overrides


def _file_table(cfg, evaluated: bool = False) -> dict:
  """The arithmetic records' trivial baselines (their eval file's `operands`; with `evaluated`,
  the first `task.eval_size` records')."""
  from jaxrl_llm.data import arith

  files = cfg.data.eval_files or ()
  records = []
  for path in files if not isinstance(files, str) else [files]:
    with open(path) as f:
      records += [json.loads(line) for line in f if line.strip()]
  if not records or "operands" not in records[0]:
    raise ValueError(
      f"data.eval_files={files!r}: trivial answers are known for the built-in tasks and for "
      "arithmetic records with `operands` (tools/make_arith.py), not for these files"
    )
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

  configs = [a for a in argv if a.startswith("--config")]
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
  unknown = [a for a in argv if not a.startswith("--config") and a not in FLAGS]
  if unknown:
    print(f"error: unknown flag {unknown[0]}; want --config=FILE, --config.FIELD=VALUE, "
          f"{', '.join(FLAGS)} or --help", file=sys.stderr)  # fmt: skip
    return EXIT_BAD_INPUT
  from jaxrl_llm import backend

  backend.choose()  # as the trainer's command line does: no backend's start-up chatter here
  try:
    out = tables([a for a in argv if a != "--json"])  # --evaluated is read by `tables`
  except (ValueError, OSError) as e:
    print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    return EXIT_BAD_INPUT
  if "--json" in argv:
    print(json.dumps(out if len(out) > 1 else out[0], indent=2))
  else:
    print("\n\n".join(map(markdown, out)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
