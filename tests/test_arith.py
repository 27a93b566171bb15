"""The arithmetic word-problem dataset (`jaxrl_llm.data.arith`), its `Answer: N` verifiers, the
tool that writes it (`tools/make_arith.py`) and a `FileTask` read from the written files."""

import json
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, cli_env, tiny_config
from text_fixtures import build_bpe_tokenizer

from jaxrl_llm.data import arith, file_task
from jaxrl_llm.data import verifiers as V


@pytest.fixture(scope="module")
def splits():
  """A small (train, eval) pair of seed 0."""
  return arith.generate(3000, 300, seed=0)


def _value(expr: str, operands: list[int]) -> int:
  """The expression's value, computed apart from `arith.evaluate` (Python's own precedence)."""
  text = re.sub(r"[abc]", lambda m: str(operands["abc".index(m[0])]), expr)
  assert re.fullmatch(r"[\d +*()-]+", text), text
  return eval(text, {"__builtins__": {}})


def test_generation_is_deterministic_per_seed():
  assert arith.generate(300, 30, seed=0) == arith.generate(300, 30, seed=0)
  assert arith.generate(300, 30, seed=0) != arith.generate(300, 30, seed=1)
  # The held-out split does not depend on how many training problems are drawn.
  assert arith.generate(0, 30, seed=0)[1] == arith.generate(300, 30, seed=0)[1]


def test_no_operand_multiset_is_in_both_splits_and_eval_is_distinct(splits):
  train, evaluation = splits
  assert (len(train), len(evaluation)) == (3000, 300)
  key = lambda r: tuple(sorted(r["operands"]))  # noqa: E731
  assert not {key(r) for r in train} & {key(r) for r in evaluation}
  assert {arith.split_of(r["operands"]) for r in evaluation} == {"eval"}
  assert {arith.split_of(r["operands"]) for r in train} == {"train"}
  assert len({r["prompt"] for r in evaluation}) == len(evaluation)
  assert len({(*r["operands"], *r["ops"]) for r in evaluation}) == len(evaluation)
  assert len({r["prompt"] for r in train}) == len(train)
  # Both kinds of problem, every operator mix and level, in the split that trains.
  assert {len(r["operands"]) for r in train} == {2, 3}
  assert {tuple(r["ops"]) for r in train} == set(arith.TEMPLATES)
  assert {r["level"] for r in train} == set(arith.LEVELS)


def _check_record(r: dict) -> None:
  """Every stated property of one record."""
  xs, expr = r["operands"], r["expr"]
  assert int(r["answer"]) == _value(expr, xs) and r["answer"] == str(int(r["answer"]))
  assert r["ops"] == re.findall(r"[-+*]", expr)
  assert sorted(re.findall(r"[abc]", expr)) == list("abc"[: len(xs)])
  assert int(r["answer"]) > 0 and int(r["answer"]) not in xs
  # Every step positive ("a - b + c" needs a > b): the running sum of the additive terms.
  assert "(" not in expr
  terms = re.split(r" ([+-]) ", expr)
  running = _value(terms[0], xs)
  for op, term in zip(terms[1::2], terms[2::2]):
    running += _value(term, xs) if op == "+" else -_value(term, xs)
    assert running > 0, (expr, xs)
  assert all(2 <= x <= 999 for x in xs)
  for m in re.finditer(r"([abc]) \* ([abc])(?: \* ([abc]))?", expr):
    factors = [xs["abc".index(v)] for v in m.groups() if v]
    assert min(factors) <= 12 or max(factors) <= 30, (expr, xs)
  question, instruction = r["prompt"].rsplit("\n", 1)
  assert instruction == arith.INSTRUCTION and "{" not in question and "}" not in question
  assert [int(n) for n in re.findall(r"\d+", question)] == xs  # the numbers, in text order


def test_every_answer_is_its_expression_of_the_operands(splits):
  for r in splits[0] + splits[1]:
    _check_record(r)


def test_every_template_renders_at_every_level():
  assert all(len(ts) >= 6 for ts in arith.TEMPLATES.values())
  assert set(arith.TEMPLATES) == set(arith.MIX_WEIGHTS)
  rng = random.Random(0)
  for mix, templates in arith.TEMPLATES.items():
    for t in templates:
      assert tuple(arith.expr_ops(t.expr)) == mix
      assert len(t.kinds) == len(set(re.findall(r"\{([abc])\}", t.text)))
      for level in arith.LEVELS:
        for _ in range(5):
          _check_record(arith.make_record(rng, t, level))


def test_trivial_answers_score_under_two_percent_on_a_held_out_split():
  for seed in (0, 1, 2):
    _, evaluation = arith.generate(0, 500, seed=seed)
    table = arith.trivial_baselines(evaluation)
    assert table["best"] <= arith.MAX_ANSWER_SHARE < 0.02, (seed, table)
    assert table["best"] == max(v for k, v in table.items() if k not in ("best", "best_rule"))
    assert set(table) >= {"constant", "first", "second", "last", "largest", "first+second"}


def test_trivial_baselines_find_a_planted_answer():
  rec = lambda xs, ans: {"operands": xs, "answer": str(ans)}  # noqa: E731
  echo = [rec([i + 3, 2 * i + 5, 7], i + 3) for i in range(20)]
  table = arith.trivial_baselines(echo)
  assert table["first"] == 1.0 and table["best"] == 1.0 and table["best_rule"] == "first"
  assert table["second"] == 0.0 and table["constant"] == 0.05
  constant = [rec([i + 2, i + 3], 42) for i in range(10)]
  assert arith.trivial_baselines(constant)["constant"] == 1.0
  half = [rec([i + 2, 3], (i + 2) * 3 if i % 2 else 1000 + i) for i in range(10)]
  table = arith.trivial_baselines(half)
  assert table["first*second"] == 0.5 and table["best_rule"] == "first*second"
  assert arith.trivial_baselines([rec([5, 9, 4], 9)])["largest"] == 1.0
  assert arith.trivial_baselines([rec([5, 9, 4], 4)])["last"] == 1.0


@pytest.mark.parametrize(
  "completion, score",
  [
    ("12 + 35 = 47\nAnswer: 47", 1.0),
    ("**Answer:** 47", 1.0),
    ("work\n**Answer: 47**\n", 1.0),
    ("answer: 47.", 1.0),
    ("`Answer: 47`", 1.0),
    ("Answer: 48", 0.0),  # wrong number
    ("The answer is 47.", 0.0),  # no Answer line
    ("Answer: 47 apples", 0.0),  # not a bare integer
    ("Answer: 47\nAnswer: 46", 0.0),  # the last Answer line counts
    ("Answer: 46\nAnswer: 47", 1.0),
    ("Answer: 47\nso that is it", 1.0),  # trailing text: correct, but not the format
  ],
)
def test_answer_line_correct(completion, score):
  assert V.answer_line_correct(completion, "47") == score
  assert V.get_reward_fn("answer_line_correct") is V.answer_line_correct


def test_answer_line_correct_reads_thousands_commas_and_refuses_huge_text():
  assert V.answer_line_correct("Answer: 1,234", "1234") == 1.0
  assert V.answer_line_correct("Answer: 1234", "1234") == 1.0
  assert V.answer_line_correct("Answer: 1,23,4", "1234") == 0.0
  assert V.answer_line_correct("Answer: -12", "-12") == 1.0
  huge = "x" * V.math.MAX_TEXT_CHARS + "\nAnswer: 7"
  assert V.answer_line_correct(huge, "7") == 0.0 and V.answer_line_format(huge) == 0.0


@pytest.mark.parametrize(
  "completion, score",
  [
    ("12 + 35 = 47\nAnswer: 47", 1.0),
    ("work\n**Answer:** 1,047.\n\n", 1.0),
    ("Answer: 47", 1.0),
    ("12 + 35 = 47", 0.0),  # missing line
    ("Answer: 47\nAnswer: 47", 0.0),  # two Answer lines
    ("Answer: 47\nI hope this helps.", 0.0),  # text after the Answer line
    ("Answer: forty-seven", 0.0),
  ],
)
def test_answer_line_format(completion, score):
  assert V.answer_line_format(completion) == score
  assert V.answer_line_format(completion, "3") == score  # the reference is ignored
  assert V.get_reward_fn("answer_line_format") is V.answer_line_format


def _tool(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "tools/make_arith.py", *args],
    cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120,
  )  # fmt: skip


def test_the_tool_writes_the_splits_and_prints_the_trivial_table(tmp_path):
  proc = _tool(str(tmp_path / "out"), "--n_train=200", "--n_eval=40", "--seed=3")
  assert proc.returncode == 0, proc.stderr
  table = json.loads(proc.stdout)
  assert table == json.loads((tmp_path / "out" / "trivial.json").read_text())
  lines = lambda f: (tmp_path / "out" / f).read_text().splitlines()  # noqa: E731
  train, evaluation = [json.loads(x) for x in lines("train.jsonl")], lines("eval.jsonl")
  assert len(train) == 200 and len(evaluation) == 40
  assert [json.loads(x) for x in evaluation] == arith.generate(200, 40, seed=3)[1]
  assert table == arith.trivial_baselines(arith.generate(0, 40, seed=3)[1])


@pytest.mark.parametrize("bad", [["--n_train=many"], ["--n_eval=0"], ["--bogus=1"], []])
def test_the_tool_refuses_bad_arguments_with_one_error_line(tmp_path, bad):
  args = [str(tmp_path / "out"), *bad] if bad else []
  proc = _tool(*args)
  assert proc.returncode == 2 and proc.stdout == ""
  assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")
  assert not (tmp_path / "out").exists()


def test_a_file_task_reads_the_written_splits_and_scores_answer_lines(tmp_path):
  from jaxrl_llm.config import parse

  out = arith.write_splits(str(tmp_path / "arith"), n_train=40, n_eval=8, seed=0)
  config = tiny_config(
    **{
      "data.train_files": out["train"],
      "data.eval_files": out["eval"],
      "data.tokenizer": str(build_bpe_tokenizer(tmp_path / "tok")),
      "data.template": "chat",
      "data.prompt_len": 512,
      "data.eval_fraction": 0.0,
      "data.correct_term": "answer_line_correct",
      "task.eval_size": 4,
    }
  )
  config.task.reward_weights = {"correct": 1.0, "answer_line_format": 0.2}
  assert parse(config).data.correct_term == "answer_line_correct"  # the config accepts both
  task = file_task.build_file_task(config, "")
  assert task.correct_term == "answer_line_correct"
  assert task.reward_fns == {"answer_line_format": V.answer_line_format}
  assert len(task.train_records) == 40 and len(task.eval_records) == 8
  evals = [json.loads(x) for x in open(out["eval"])]
  batch, answers = task.eval_set()
  assert list(answers) == [r["answer"] for r in evals[: len(answers)]] and len(answers) == 4
  assert batch["tokens"].shape == (4, 512)
  # The host reward path: decoded completions scored by the two terms in worker processes.
  texts = [f"so\nAnswer: {answers[0]}", f"Answer: {answers[1]}\nbye", "Answer: 0"]
  ids = [[*task.tokenizer.encode(t), task.tokenizer.eos_id] for t in texts]
  tokens = np.full((3, max(map(len, ids))), task.tokenizer.pad_id, np.int32)
  for row, x in zip(tokens, ids):
    row[: len(x)] = x
  terms, stats = task.host_reward_terms(tokens, list(answers[:3]))
  np.testing.assert_array_equal(terms["correct"], [1, 1, 0])
  np.testing.assert_array_equal(terms["answer_line_format"], [1, 0, 1])
  assert stats["verifier/errors"] == 0 and stats["verifier/timeouts"] == 0


@pytest.mark.slow
def test_get_smollm2_writes_the_splits_again_after_a_write_cut_short(tmp_path):
  """tools/get_smollm2.py's data step: what an interrupted write leaves (train.jsonl and a
  truncated eval.jsonl, no trivial.json; or no train.jsonl) is written again in full, equal to
  a clean write, and a complete directory is kept as it is."""
  sys.path.insert(0, str(REPO / "tools"))
  import get_smollm2

  clean = tmp_path / "clean" / "arith"
  arith.write_splits(str(clean))
  want = {n: (clean / n).read_text() for n in ("train.jsonl", "eval.jsonl", "trivial.json")}
  assert not list(clean.glob("*.partial"))
  for cut in ("no_trivial", "no_train"):
    data = tmp_path / cut / "arith"
    data.mkdir(parents=True)
    if cut == "no_trivial":
      (data / "train.jsonl").write_text(want["train.jsonl"])
      (data / "eval.jsonl").write_text(want["eval.jsonl"][:1000])  # cut mid-record
    else:
      (data / "eval.jsonl").write_text(want["eval.jsonl"])
      (data / "trivial.json").write_text(want["trivial.json"])
    logged = []
    path, trivial = get_smollm2.write_data(str(tmp_path / cut), logged.append)
    assert path == str(data) and not logged and trivial == json.loads(want["trivial.json"])
    assert {n: (data / n).read_text() for n in want} == want, cut
  logged = []
  get_smollm2.write_data(str(tmp_path / "clean"), logged.append)
  assert logged == [f"{clean}: already written"]
