"""Tests for the character tokenizer, the built-in tasks and their pure-JAX verifier."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.data import pipeline
from jaxrl_llm.data.task import Task
from jaxrl_llm.data.tasks import AdditionTask, CharTokenizer, ReverseTask, SortTask, get_task

TOK = CharTokenizer()
TASK_NAMES = ["addition", "reverse", "sort"]


def _rows(a: np.ndarray) -> set[bytes]:
  return {r.tobytes() for r in np.ascontiguousarray(a)}


# ---- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_special_ids_and_vocab():
  assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
  assert TOK.vocab_size % 8 == 0
  assert TOK.vocab_size >= 3 + len(TOK.alphabet)
  assert TOK.vocab_size == 32


def test_tokenizer_round_trip():
  text = TOK.alphabet + "12+34=46"
  ids = TOK.encode(text, bos=True, eos=True)
  assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
  assert all(3 <= i < TOK.vocab_size for i in ids[1:-1])
  assert TOK.decode(ids) == text
  assert TOK.decode([*ids, 5, 6]) == text  # stops at the first eos
  assert TOK.decode([0, 0, *ids, 5], stop_at_eos=False) == text + "<eos>" + TOK.alphabet[2]
  assert TOK.decode([TOK.vocab_size - 1]) == "?"  # unused id


def test_tokenizer_rejects_unknown_character():
  with pytest.raises(ValueError, match=r"'x'.*allowed characters.*0123456789"):
    TOK.encode("12x")
  with pytest.raises(ValueError, match="'Z'"):
    TOK.encode_batch(["ab", "aZ"], 4, bos=False, eos=True, left_pad=False)


def test_encode_batch_matches_encode():
  texts = ["12+3=", "", "9+9="]
  tokens, mask = TOK.encode_batch(texts, 8, bos=True, eos=False, left_pad=True)
  for row, m, text in zip(tokens, mask, texts):
    ids = TOK.encode(text, bos=True)
    np.testing.assert_array_equal(row, [0] * (8 - len(ids)) + ids)
    np.testing.assert_array_equal(m, row != 0)
  answer, amask = TOK.encode_batch(["46", "1"], 4, bos=False, eos=True, left_pad=False)
  np.testing.assert_array_equal(
    answer, [[*TOK.encode("46", eos=True), 0], [*TOK.encode("1"), 2, 0, 0]]
  )
  np.testing.assert_array_equal(amask, [[1, 1, 1, 0], [1, 1, 0, 0]])
  with pytest.raises(ValueError, match="does not fit"):
    TOK.encode_batch(["12345"], 4, bos=True, eos=False, left_pad=True)


# ---- tasks: registry, shapes, split ---------------------------------------------------------


def test_registry():
  assert isinstance(get_task("addition", digits=3), AdditionTask)
  assert isinstance(get_task("reverse"), ReverseTask)
  assert isinstance(get_task("sort"), SortTask)
  with pytest.raises(
    ValueError, match=r"valid task names: \['addition', 'countdown', 'reverse', 'sort'\]"
  ):
    get_task("multiply")
  with pytest.raises(ValueError, match=r"unknown arguments \['digitz'\]"):
    get_task("addition", digitz=3)
  # One config section may carry every task's fields; other tasks' fields are ignored.
  assert get_task("addition", digits=3, min_len=3, max_len=4) == AdditionTask(digits=3)
  assert get_task("reverse", digits=3, min_len=3, max_len=4) == ReverseTask(min_len=3, max_len=4)
  with pytest.raises(ValueError, match="digits"):
    get_task("addition", digits=0)
  with pytest.raises(ValueError, match="min_len"):
    get_task("reverse", min_len=4, max_len=3)


def test_static_sizes():
  add = get_task("addition")
  assert (add.prompt_len, add.answer_len, add.max_new_tokens, add.num_problems) == (7, 4, 4, 10_000)
  rev = get_task("reverse")
  assert (rev.prompt_len, rev.answer_len, rev.max_new_tokens, rev.num_problems) == (
    7,
    6,
    6,
    111_100,
  )
  hash(add), hash(rev)  # usable as static jit arguments


@pytest.mark.parametrize("name", TASK_NAMES)
def test_builtin_tasks_implement_the_task_interface(name):
  """Rewards in-graph; train_iterator is the grain pipeline over train_examples(seed) in the
  same order, per shard; eval_set is eval_examples() with no host answers."""
  task = get_task(name)
  assert isinstance(task, Task) and not task.rewards_on_host
  assert callable(task.reward_terms) and task.host_reward_terms is None
  assert task.data_stats == {}
  shard = {"shard_index": 1, "shard_count": 2}
  got = task.train_iterator(4, 3, **shard)
  want = pipeline.make_prompt_iterator(task.train_examples(3), 4, seed=3, **shard)
  for _ in range(3):
    a, b = next(got), next(want)
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  ev, answers = task.eval_set(multiple_of=8)
  assert answers is None
  for key, value in task.eval_examples().items():
    np.testing.assert_array_equal(ev[key], value)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_examples_well_formed(name):
  task = get_task(name)
  ev = task.eval_examples()
  n = ev["tokens"].shape[0]
  assert n == task.eval_size == 256
  assert ev["tokens"].shape == ev["mask"].shape == (n, task.prompt_len)
  assert ev["answer"].shape == ev["answer_mask"].shape == (n, task.answer_len)
  assert ev["tokens"].dtype == ev["answer"].dtype == np.int32
  assert ev["mask"].dtype == ev["answer_mask"].dtype == bool
  np.testing.assert_array_equal(ev["mask"], ev["tokens"] != TOK.pad_id)
  np.testing.assert_array_equal(ev["answer_mask"], ev["answer"] != TOK.pad_id)
  assert ev["mask"][:, -1].all()  # left-padded
  first = np.argmax(ev["mask"], axis=1)
  assert (ev["tokens"][np.arange(n), first] == TOK.bos_id).all()
  last = ev["answer_mask"].sum(1) - 1
  assert (ev["answer"][np.arange(n), last] == TOK.eos_id).all()
  assert ((ev["answer"] == TOK.eos_id).sum(1) == 1).all()
  # Answers are what the task says they are.
  for row, ans in zip(ev["tokens"][:50], ev["answer"][:50]):
    prompt, target = TOK.decode(row), TOK.decode(ans)
    if name == "addition":
      a, b = prompt.rstrip("=").split("+")
      assert target == str(int(a) + int(b))
    elif name == "reverse":
      assert prompt.endswith(">") and target == prompt[:-1][::-1]
    else:
      assert prompt.endswith(":") and target == "".join(sorted(prompt[:-1]))


@pytest.mark.parametrize("name", TASK_NAMES)
def test_train_eval_disjoint_and_deterministic(name):
  task = get_task(name)
  ev = task.eval_examples()
  np.testing.assert_array_equal(ev["tokens"], task.eval_examples()["tokens"])
  eval_prompts = _rows(ev["tokens"])
  assert len(eval_prompts) == ev["tokens"].shape[0]  # no duplicate eval problems
  for seed in (0, 1):
    tr = task.train_examples(seed)
    assert 0.85 * task.num_problems < tr["tokens"].shape[0] < 0.95 * task.num_problems
    assert not eval_prompts & _rows(tr["tokens"])
  a, b = task.train_examples(0)["tokens"], task.train_examples(1)["tokens"]
  assert _rows(a) == _rows(b) and not np.array_equal(a, b)  # same split, seed-shuffled order


def test_addition_commuted_pairs_share_a_side():
  task = get_task("addition")
  train = {TOK.decode(r) for r in task.train_examples(0)["tokens"]}
  for row in task.eval_examples()["tokens"]:
    a, b = TOK.decode(row).rstrip("=").split("+")
    assert f"{b}+{a}=" not in train


def test_sampled_problem_space_is_disjoint():
  task = get_task("addition", digits=5, train_size=20_000, eval_size=64)
  assert task.num_problems == 10**10
  tr, ev = task.train_examples(3), task.eval_examples()
  assert tr["tokens"].shape == (20_000, 13) and ev["tokens"].shape == (64, 13)
  assert not _rows(ev["tokens"]) & _rows(tr["tokens"])


def test_small_space_and_train_size():
  task = get_task("addition", digits=1, train_size=50)
  assert task.train_examples(0)["tokens"].shape[0] == 50
  assert 0 < task.eval_examples()["tokens"].shape[0] < 100  # all of the small held-out part
  with pytest.raises(ValueError, match="train_size"):
    get_task("addition", digits=1, train_size=1000).train_examples(0)


# ---- verifier -------------------------------------------------------------------------------


def _pad(ids: list[int], width: int) -> list[int]:
  return (ids + [TOK.pad_id] * width)[:width]


def _reward(task, completions: list[list[int]], masks: list[int], target: str, t: int, prompt=""):
  """Runs jitted reward_terms on hand-built completions (mask = number of valid tokens) after
  `prompt` (left-padded; all padding when empty)."""
  b = len(completions)
  comp = np.asarray([_pad(c, t) for c in completions], np.int32)
  cmask = (np.arange(t)[None, :] < np.asarray(masks)[:, None]).astype(np.float32)
  ans, amask = TOK.encode_batch([target] * b, task.answer_len, bos=False, eos=True, left_pad=False)
  prompt, _ = TOK.encode_batch([prompt] * b, task.prompt_len, bos=True, eos=False, left_pad=True)
  out = jax.jit(task.reward_terms)(prompt, comp, cmask, ans, amask)
  assert set(out) >= {"correct", "format", "partial"}
  for v in out.values():
    assert v.shape == (b,) and v.dtype == np.float32
  return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("t", [3, 4, 7])
def test_addition_reward_terms(t):
  task = get_task("addition")
  e = TOK.encode
  cases = [
    (e("46", eos=True), 3),  # correct
    (e("47", eos=True), 3),  # wrong digit
    (e("46"), 2),  # no eos
    (e("46", eos=True) + e("9+"), 5),  # junk after eos still correct
    (e("4", eos=True), 2),  # answer prefix only
    (e("461", eos=True), 4),  # answer plus an extra digit
    ([TOK.eos_id], 1),  # empty answer
    (e("4+", eos=True), 3),  # non-digit character
    (e("46", eos=True), 2),  # eos outside the completion mask
  ]
  r = _reward(task, [c for c, _ in cases], [min(m, t) for _, m in cases], "46", t, "12+34=")
  correct = [1, 0, 0, 1, 0, 0, 0, 0, 0]
  fmt = [1, 1, 0, 1, 1, 0 if t < 4 else 1, 0, 0, 0]
  np.testing.assert_array_equal(r["correct"], correct)
  np.testing.assert_array_equal(r["format"], fmt)
  np.testing.assert_allclose(r["partial"][:3], [1, 2 / 3, 2 / 3], rtol=1e-6)
  assert r["partial"][4] == pytest.approx(1 / 3)


def test_reverse_reward_terms():
  task = get_task("reverse")
  e = TOK.encode
  cases = [
    (e("dcba", eos=True), 5),
    (e("abcd", eos=True), 5),
    (e("dcb", eos=True), 4),
    (e("dcba", eos=True) + e("ee"), 7),
    (e("dc1a", eos=True), 5),
  ]
  r = _reward(task, [c for c, _ in cases], [m for _, m in cases], "dcba", 8)
  np.testing.assert_array_equal(r["correct"], [1, 0, 0, 1, 0])
  np.testing.assert_array_equal(r["format"], [1, 1, 1, 1, 0])


@pytest.mark.parametrize("name", TASK_NAMES)
def test_reference_answers_score_full_reward(name):
  task = get_task(name)
  ev = task.eval_examples()
  t = task.max_new_tokens
  comp = ev["answer"][:, :t]
  out = jax.jit(task.reward_terms)(
    ev["tokens"], comp, ev["answer_mask"][:, :t].astype(np.float32), ev["answer"], ev["answer_mask"]
  )
  assert np.all(np.asarray(out["correct"]) == 1)
  assert np.all(np.asarray(out["format"]) == 1)
  assert np.all(np.asarray(out["partial"]) == 1)
  shifted = np.roll(ev["answer"], 1, axis=0)  # someone else's answer
  differs = (shifted != ev["answer"]).any(1)
  out = jax.jit(task.reward_terms)(
    ev["tokens"], shifted, (shifted != 0).astype(np.float32), ev["answer"], ev["answer_mask"]
  )
  np.testing.assert_array_equal(np.asarray(out["correct"]), 1 - differs)


def test_describe():
  task = get_task("addition")
  prompt, _ = TOK.encode_batch(["12+34=", "1+1="], 7, bos=True, eos=False, left_pad=True)
  comp = np.asarray([_pad([*TOK.encode("46", eos=True), 5], 4), _pad(TOK.encode("3"), 4)])
  assert task.describe(prompt, comp) == [("12+34=", "46<eos>"), ("1+1=", "3 <no eos>")]
  assert task.describe(prompt[0], comp[0]) == ("12+34=", "46<eos>")


def test_addition_scores_the_prompts_own_sum_whatever_the_trace():
  """The addition verifier computes each prompt's sum (operands of 1 to 9 digits, left-padded
  prompts): the right sum scores 1 against a wrong trace, a tool-calling trace, or one taken
  from another problem, and the trace itself scores 0 where it is wrong."""
  for digits in (1, 3, 9):
    task = get_task("addition", digits=digits, wrong_traces=0.3, tool_traces=0.5)
    index = np.random.default_rng(digits).integers(0, task.num_problems, 300)
    prompts, traces = task.render(index)
    truth = [str(sum(int(x) for x in p[:-1].split("+"))) for p in prompts]
    tok = task.tokenizer
    p_ids, _ = tok.encode_batch(prompts, task.prompt_len, bos=True, eos=False, left_pad=True)
    a_ids, a_mask = tok.encode_batch(traces, task.answer_len, bos=False, eos=True, left_pad=False)
    score = jax.jit(task.reward_terms)

    def correct(answers, tok=tok, task=task, score=score, ids=(p_ids, a_ids, a_mask)):
      c, m = tok.encode_batch(answers, task.answer_len, bos=False, eos=True, left_pad=False)
      return np.asarray(score(ids[0], c, m.astype(np.float32), *ids[1:])["correct"])

    np.testing.assert_array_equal(correct(truth), 1)
    np.testing.assert_array_equal(correct([str(int(x) + 1) for x in truth]), 0)
    finals = [t.split(",")[-1] for t in traces]  # a tool trace's answer after the tool's
    np.testing.assert_array_equal(correct(finals), [f == x for f, x in zip(finals, truth)])
    assert 0 < np.mean([f != x for f, x in zip(finals, truth)]) < 0.5  # some wrong, training side


def test_addition_tool_traces_hold_what_the_calculator_answers():
  """`tool_traces=0.5`: about half the traces are `a+b'=s,s`, the answer `s,` exactly what
  `envs.Calculator` appends to that call, the final `s` the plain trace's answer (misread
  alike on the wrong ones); none on the held-out side is wrong; `answer_len` bounds them."""
  import jax.numpy as jnp

  from jaxrl_llm import envs

  plain = get_task("addition", digits=3, wrong_traces=0.3)
  tooled = get_task("addition", digits=3, wrong_traces=0.3, tool_traces=0.5)
  index = np.arange(0, 1_000_000, 1009)
  prompts, traces = tooled.render(index)
  assert [t.split(",")[-1] for t in traces] == plain.render(index)[1]
  calls = [t.split("=")[0] + "=" for t in traces if "=" in t]
  assert 0.45 < len(calls) / len(traces) < 0.55
  assert max(map(len, traces)) + 1 <= tooled.answer_len
  tok = tooled.tokenizer
  comp, _ = tok.encode_batch(calls, 8, bos=False, eos=False, left_pad=False)
  end = jnp.asarray([len(c) - 1 for c in calls])
  assert isinstance(envs.get_env("calculator", tooled), envs.Calculator)
  for name in tooled.trace_tools:  # the tools the config check lets a traced run use
    answer, length, error = envs.get_env(name, tooled).respond(
      jnp.zeros((len(calls), 1), jnp.int32), jnp.asarray(comp), jnp.zeros_like(end), end
    )
    shown = [tok.decode(a[:n]) for a, n in zip(np.asarray(answer), np.asarray(length))]
    assert shown == [t.split("=")[1].split(",")[0] + "," for t in traces if "=" in t], name
    assert not np.asarray(error).any(), name
  held = tooled.key_held_out(tooled.split_key(index))
  truth = [str(sum(int(x) for x in p[:-1].split("+"))) for p in prompts]
  assert all(t.split(",")[-1] == x for t, x, h in zip(traces, truth, held) if h)


@pytest.mark.parametrize(
  "name, fields, n, space",
  [
    ("addition", {"digits": 1}, 5, "addition with digits=1"),
    ("reverse", {"min_len": 2, "max_len": 2}, 10, "reverse with min_len=2, max_len=2"),
  ],
)
def test_an_evaluation_smaller_than_eval_size_is_said_at_start(caplog, name, fields, n, space):
  """1-digit addition evaluated 5 prompts for task.eval_size=256 without a word: every
  eval/accuracy a multiple of 0.2 while the config said 256."""
  from types import SimpleNamespace

  from jaxrl_llm import sharding
  from jaxrl_llm.run.held_out import Evaluator

  task = get_task(name, eval_size=256, **fields)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.BATCH_AXES)
  exp = SimpleNamespace(task=task, mesh=mesh, batch_sharding=sharding.rows(mesh))
  with caplog.at_level("WARNING"):
    Evaluator(SimpleNamespace(exp=exp))
  said = [r.getMessage() for r in caplog.records if "held-out evaluation" in r.getMessage()]
  assert said == [
    f"held-out evaluation: {n} prompts, fewer than task.eval_size=256: the held-out split of "
    f"{space} has only {n} problems (its problem space is smaller)"
  ]
  assert len(task.eval_indices()) == n
  assert get_task(name, eval_size=n, **fields).eval_shortfall() is None
