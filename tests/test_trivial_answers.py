"""Trivial answers of every task: what a policy scores on a held-out split without solving
anything (tools/trivial_answers.py), and a countdown no rule over its prompt solves."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, cli_env

from jaxrl_llm.data import arith, tasks
from jaxrl_llm.data.tasks.trivial import trivial_table


def test_no_trivial_answer_solves_5_percent_of_countdowns_held_out_split():
  """configs/countdown.py's task on 2,000 held-out problems: no digit, no two digits joined by
  an operator (`d1+d2`, which solved 25% of the old split), no chain of every digit with fixed
  operators and no constant answer is right on 5% of them."""
  task = tasks.get_task("countdown", numbers=4, eval_size=2000)
  table = trivial_table(task)
  assert table["n"] == 2000
  assert {"d1", "d4", "d1+d2", "d3*d4", "all +*+"} <= set(table["rules"])
  assert any(rule.startswith("constant ") for rule in table["rules"])
  assert table["best"] < 0.05, table
  assert 0 < table["best"]  # the rules do hit sometimes: the table measures something


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_every_tasks_held_out_problems_are_distinct(name):
  """No two evaluation problems are the same problem or a reordering of one (the old
  countdown split held 220 distinct problems in 256)."""
  task = tasks.get_task(name)
  index = task.eval_indices()
  assert len(index) == task.eval_size == 256
  assert len(np.unique(task.split_key(index))) == len(index)
  assert task.is_held_out(index).all()


def test_the_table_scores_a_rule_that_is_the_answer_as_solving_everything():
  """The scorer is the task's own verifier: on `sort`, a rule that sorts the letters scores 1,
  echoing the string scores the share of held-out strings already sorted."""

  class Sorting(tasks.SortTask):
    def trivial_rules(self, prompts):
      out = super().trivial_rules(prompts)
      return {**out, "sorted": ["".join(sorted(s)) for s in out["echo"]]}

  task = Sorting()
  table = trivial_table(task)
  assert table["rules"]["sorted"] == 1.0 and table["best_rule"] == "sorted"
  strings = [p.removesuffix(":") for p in task.render(task.eval_indices())[0]]
  share = np.mean([s == "".join(sorted(s)) for s in strings])
  assert table["rules"]["echo"] == pytest.approx(share)


def _tool(*args):
  cmd = [sys.executable, str(REPO / "tools" / "trivial_answers.py"), *args]
  return subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.extended
def test_the_tool_prints_every_tasks_table_and_refuses_a_bad_config_in_one_line(tmp_path):
  """Without a config: one table per built-in task. With the arithmetic config's files: the
  records' own baselines. A bad value: one `error:` line, exit 2."""
  proc = _tool("--json")
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert [t["task"] for t in out] == sorted(tasks.TASKS)
  assert all(0 <= t["best"] < 0.05 and t["n"] == 256 for t in out), out
  arith.write_splits(str(tmp_path), n_train=10, n_eval=300, seed=1)
  config = f"--config={REPO / 'configs' / 'smollm2_arith.py'}"
  proc = _tool(config, f"--config.data.eval_files={tmp_path / 'eval.jsonl'}", "--json")
  assert proc.returncode == 0, proc.stderr
  table = json.loads(proc.stdout)
  assert table["task"] == "arith" and table["n"] == 300 and "first+second" in table["rules"]
  assert table["best"] < 0.02
  proc = _tool(f"--config={REPO / 'configs' / 'countdown.py'}", "--config.task.numbers=9")
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
    "error: invalid config: task.numbers=9 must be in [2, 5]"
  ]


def test_the_tool_answers_help_and_refuses_an_unknown_flag_before_computing_anything():
  """`--help` prints the usage and exits 0; a flag it does not know is one `error:` line, exit
  2, with nothing printed on stdout."""
  proc = _tool("--help")
  assert proc.returncode == 0 and proc.stdout.startswith("What a policy scores")
  assert "| trivial answer |" not in proc.stdout  # the usage alone: no table computed
  proc = _tool("--jsn")
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.strip().splitlines() == [
    "error: unknown flag --jsn; want --config=FILE, --config.FIELD=VALUE, --json, --evaluated "
    "or --help"
  ]


def test_evaluated_scores_the_problems_the_trainers_evaluation_scores(tmp_path):
  """`--evaluated`: the first `task.eval_size` records (64 in the adapter settings), where the
  best constant can score more than on the whole file; without it, the whole file."""
  arith.write_splits(str(tmp_path), n_train=10, n_eval=300, seed=1)
  records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
  args = [f"--config={REPO / 'configs' / 'smollm2_arith.py'}:calc"]
  args += [f"--config.data.eval_files={tmp_path / 'eval.jsonl'}", "--json"]
  whole, first = _tool(*args), _tool(*args, "--evaluated")
  assert whole.returncode == first.returncode == 0, whole.stderr + first.stderr
  whole, first = json.loads(whole.stdout), json.loads(first.stdout)
  assert (whole["n"], first["n"]) == (300, 64)
  assert first["best"] == arith.trivial_baselines(records[:64])["best"]
  assert whole["best"] == arith.trivial_baselines(records)["best"]


def test_the_real_models_problems_not_written_yet_say_how_to_write_them(tmp_path):
  """tasks.md's `--config=configs/smollm2_arith.py` on a machine whose cache lacks the problems
  (`tools/get_smollm2.py` writes them): one line naming the file and the command that writes it
  (it named the missing file alone); a missing file elsewhere is named as before."""
  env = cli_env() | {"JAXRL_LLM_CACHE": str(tmp_path / "cache")}
  cmd = [sys.executable, str(REPO / "tools" / "trivial_answers.py")]
  config = f"--config={REPO / 'configs' / 'smollm2_arith.py'}"
  proc = subprocess.run([*cmd, config], cwd=REPO, env=env, capture_output=True, text=True)
  missing = tmp_path / "cache" / "arith" / "eval.jsonl"
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
    f"error: data.eval_files='{missing}': Dataset file {missing} does not exist; write it "
    "first: python tools/get_smollm2.py"
  ], proc.stderr[-2000:]
  elsewhere = tmp_path / "mine.jsonl"
  proc = _tool(config, f"--config.data.eval_files={elsewhere}")
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
    f"error: data.eval_files='{elsewhere}': Dataset file {elsewhere} does not exist."
  ], proc.stderr[-2000:]
