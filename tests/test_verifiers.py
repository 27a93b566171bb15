"""Tests for the host-side verifiers: answer extraction, equivalence, rewards, score_batch."""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from fractions import Fraction

import numpy as np
import pytest

from jaxrl_llm.data import verifiers as V
from jaxrl_llm.data.verifiers import rewards as R

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None

# ---- extraction -----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "text, expected",
  [
    (r"so \boxed{42}.", ["42"]),
    (r"\boxed{\frac{\sqrt{3}}{2}}", [r"\frac{\sqrt{3}}{2}"]),
    (r"first \boxed{1} then \boxed{2}", ["1", "2"]),
    (r"\fbox{7} and \boxed 5.", ["7", "5"]),
    (r"\boxed{\{1, 2\}}", [r"\{1, 2\}"]),
    (r"\boxed{ x^{2} }", ["x^{2}"]),
    (r"\boxed{unbalanced", []),
    (r"\boxedx{3}", []),
    ("no box here", []),
  ],
)
def test_extract_boxed(text, expected):
  assert V.extract_boxed(text) == expected


@pytest.mark.parametrize(
  "text, expected",
  [
    ("Natalia sold 48 clips.\n#### 72", "72"),
    ("#### 1 \n#### 1,000\nextra words", "1,000"),
    ("####   ", None),
    ("no marker 5", None),
  ],
)
def test_extract_gsm8k(text, expected):
  assert V.extract_gsm8k(text) == expected


@pytest.mark.parametrize(
  "text, expected",
  [
    ("She has 1,234 apples and 5 pears.", "5"),
    ("total: 1,234,567", "1234567"),
    ("it is -3", "-3"),
    ("it is \u22123", "-3"),  # Unicode minus
    ("pages 3-4", "4"),  # a dash between numbers is not a sign
    ("x = 2.50 dollars", "2.50"),
    ("about .5 of it", ".5"),
    ("ratio 3/4", "3/4"),
    ("speed 2.5e3 m/s", "2.5e3"),
    ("The answer is 17.", "17"),
    ("(1,2)", "2"),
    ("no digits", None),
  ],
)
def test_extract_last_number(text, expected):
  assert V.extract_last_number(text) == expected


@pytest.mark.parametrize(
  "text, mode, expected",
  [
    (r"#### 3 but \boxed{4}", "auto", "4"),
    ("work... #### 12", "auto", "12"),
    ("I think it is 9, maybe 10", "auto", "10"),
    ("nothing", "auto", None),
    ("#### 3\nbut 4", "gsm8k", "3"),
    ("3 but 4", "gsm8k", None),
    ("3 but 4", "boxed", None),
    (r"\boxed{} then 6", "auto", "6"),  # an empty box is no answer
    (r"\boxed{3} 4", "last_number", "4"),
  ],
)
def test_extract_answer(text, mode, expected):
  assert V.extract_answer(text, mode) == expected


def test_extract_answer_rejects_unknown_mode():
  with pytest.raises(ValueError, match="last_number"):
    V.extract_answer("1", mode="first")


# ---- normalisation and numbers --------------------------------------------------------------


@pytest.mark.parametrize(
  "raw, expected",
  [
    (r"$5 \text{ cm}$", "5"),
    (r"\$1,000", "1000"),
    (r"10\%", "10"),
    (r"30^\circ", "30"),
    (r"30^{\circ}", "30"),
    ("x = 5", "5"),
    ("Answer: 7.", "7"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"\dfrac12", r"\frac{1}{2}"),
    (r"3\!\,000", "3000"),
    ("2x", "2x"),  # a variable is not a unit
    (r"\text{(A)}", "(A)"),
  ],
)
def test_normalize(raw, expected):
  assert V.normalize(raw) == expected


@pytest.mark.parametrize(
  "raw, expected",
  [
    ("42", Fraction(42)),
    ("-3", Fraction(-3)),
    ("1,000", Fraction(1000)),
    ("3/4", Fraction(3, 4)),
    (r"\frac{1}{2}", Fraction(1, 2)),
    (r"-\tfrac{3}{6}", Fraction(-1, 2)),
    (r"\frac12", Fraction(1, 2)),
    (r"\frac{\frac{1}{2}}{3}", Fraction(1, 6)),
    (r"1\frac{1}{2}", Fraction(3, 2)),
    ("2.5", 2.5),
    ("1.5e3", 1500.0),
    (r"1.5 \times 10^{-3}", 0.0015),
    (r"\sqrt{2}", None),
    ("1/0", None),
    ("abc", None),
  ],
)
def test_parse_number(raw, expected):
  got = V.parse_number(raw)
  assert got == expected
  assert type(got) is type(expected)


# ---- equivalence: the tricky-format table ---------------------------------------------------

EQUIVALENCE_CASES = [
  # fractions and decimals
  (r"\frac{1}{2}", "0.5", True),
  ("0.5", "1/2", True),
  ("1/2", r"\frac{1}{2}", True),
  (r"\dfrac{1}{2}", "0.5", True),
  (r"\tfrac{1}{2}", r"\frac12", True),
  (r"\frac{2}{4}", r"\frac{1}{2}", True),
  ("0.3333333", r"\frac{1}{3}", True),  # decimals are compared with a relative tolerance
  ("0.33", r"\frac{1}{3}", False),
  ("2.50", "2.5", True),
  (".5", "0.5", True),
  (r"1\frac{1}{2}", "1.5", True),
  # LaTeX wrappers
  ("$5$", "5", True),
  (r"\(5\)", "5", True),
  (r"\boxed{5}", "5", True),
  (r"\displaystyle 5", "5", True),
  # units, percent, degrees, currency
  (r"5 \text{ cm}", "5", True),
  ("5 cm", "5", True),
  (r"12\text{ dollars}", "12", True),
  (r"3 \text{m}^2", "3", True),
  (r"10\%", "10", True),
  ("10 percent", "10", True),
  (r"30^\circ", "30", True),
  ("30°", "30", True),
  (r"\$18", "18", True),
  # signs and separators
  ("-3", "\u22123", True),  # ASCII vs Unicode minus
  ("-3", "3", False),
  ("1,000", "1000", True),
  ("1,000,000", "1000000", True),
  ("5.", "5", True),  # answer followed by a period
  ("x = 5", "5", True),
  (r"\theta = 5", "5", True),
  ("The answer is 5", "5", True),
  # scientific notation
  ("1.5e3", "1500", True),
  (r"1.5 \times 10^{3}", "1500", True),
  ("2e-3", "0.002", True),
  # tuples, intervals, sets and lists
  (r"\left( 1, 2 \right)", "(1,2)", True),
  ("(1, 2)", "(2, 1)", False),  # tuples are ordered
  ("(0.5, 2)", r"(\frac12, 2)", True),
  ("[1, 2)", "(1, 2)", False),  # half-open is not open
  (r"\{3, 2\}", r"\{2, 3\}", True),  # sets are unordered
  ("2, 3", "3,2", True),  # several answers, as a set
  ("2, 3", "2", False),
  # symbolic answers fall back to normalised strings
  (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", True),
  (r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt{3}}{2}", True),
  (r"2\sqrt{2}", r"2 \sqrt{2}", True),
  (r"\sqrt{2}", r"\sqrt{3}", False),
  (r"\pi", r"\pi", True),
  ("y = 2x + 1", "2x+1", True),
  (r"\text{(A)}", "(A)", True),
  # wrong or missing answers
  ("4", "5", False),
  ("", "5", False),
  (None, "5", False),
  ("12", "1,2", False),
]


@pytest.mark.parametrize("pred, ref, expected", EQUIVALENCE_CASES)
def test_is_equivalent_builtin(pred, ref, expected):
  assert V.is_equivalent(pred, ref) is expected
  if pred is not None:
    assert V.is_equivalent(ref, pred) is expected  # symmetric


def test_equivalence_table_is_large():
  assert len(EQUIVALENCE_CASES) >= 40


def test_is_equivalent_rel_tol_and_exact_fractions():
  assert V.is_equivalent("3.14159", "3.1416", rel_tol=1e-4)
  assert not V.is_equivalent("3.14159", "3.1416")
  # Integers and fractions are exact whatever the tolerance.
  assert not V.is_equivalent("1000000001", "1000000000", rel_tol=1e-6)


def test_is_equivalent_rejects_unknown_backend():
  with pytest.raises(ValueError, match="builtin"):
    V.is_equivalent("1", "1", backend="sympy")


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify is not installed")
@pytest.mark.parametrize(
  "pred, ref, expected",
  [
    ("0.5", r"\frac{1}{2}", True),
    (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", True),
    (r"\left( 1, 2 \right)", "(1,2)", True),
    ("x = 5", "5", True),
    ("3", "4", False),
  ],
)
def test_is_equivalent_math_verify(pred, ref, expected):
  assert V.is_equivalent(pred, ref, backend="math_verify") is expected


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify is not installed")
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_math_verify_term_runs_in_workers(executor):
  # math_verify's own SIGALRM timeouts only work on a main thread (a process worker's is one);
  # in worker threads score_batch's timeout applies instead.
  terms = {"mv": V.get_reward_fn("math_verify_correct")}
  scores, stats = V.score_batch(
    [r"\boxed{\dfrac{1}{2}}", "#### 3"], ["0.5", "4"], terms=terms, executor=executor
  )
  np.testing.assert_array_equal(scores["mv"], [1, 0])
  assert stats["verifier/errors"] == 0


def test_math_verify_backend_names_missing_package(monkeypatch):
  monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
  with pytest.raises(ImportError, match="math-verify"):
    V.is_equivalent("1", "1", backend="math_verify")


# ---- reward functions -----------------------------------------------------------------------


@pytest.mark.parametrize(
  "completion, reference, extract, expected",
  [
    (r"... so the answer is $\boxed{\dfrac{1}{2}}$.", "0.5", "auto", 1.0),
    (r"\boxed{3} wait, no: \boxed{4}", "4", "auto", 1.0),  # last box wins
    (r"\boxed{3} wait, no: \boxed{4}", "3", "auto", 0.0),
    ("She pays 18 dollars.\n#### 18", "Janet ... 16 - 3 - 4 = 9, 9 * 2 = 18\n#### 18", "auto", 1.0),
    ("the total is 1,000", "1000", "auto", 1.0),
    ("I cannot solve this.", "7", "auto", 0.0),  # no answer → incorrect
    ("it is 7", "7", "boxed", 0.0),  # boxed extraction finds nothing
    ("#### 7", r"so \boxed{7}", "gsm8k", 1.0),  # a boxed reference is read too
  ],
)
def test_correctness_reward(completion, reference, extract, expected):
  assert V.correctness_reward(completion, reference, extract=extract) == expected


@pytest.mark.parametrize(
  "completion, template, expected",
  [
    (r"work \boxed{5}", "boxed", 1.0),
    (r"\boxed{5} and \boxed{6}", "boxed", 0.0),
    (r"\boxed{}", "boxed", 0.0),
    ("just 5", "boxed", 0.0),
    ("<think>2+3=5</think> The answer is 5.", "think", 1.0),
    ("  <think>\nhmm\n</think>\n\\boxed{5}", "think", 1.0),
    ("<think>2+3=5</think>", "think", 0.0),  # no answer after thinking
    ("<think></think> 5", "think", 0.0),  # empty thinking
    ("The answer is 5 <think>x</think> 5", "think", 0.0),  # must start with the block
    ("<think>a</think><think>b</think> 5", "think", 0.0),
    ("<think>never closed 5", "think", 0.0),
    ("steps\n#### 42", "gsm8k", 1.0),
    ("#### 4\n#### 42", "gsm8k", 0.0),
    ("#### ", "gsm8k", 0.0),
  ],
)
def test_format_reward(completion, template, expected):
  assert V.format_reward(completion, template=template) == expected


def test_format_reward_rejects_unknown_template():
  with pytest.raises(ValueError, match="think"):
    V.format_reward("x", template="xml")


def test_registry():
  for name in ["math_correct", "math_format_boxed", "think_format", "gsm8k_correct"]:
    fn = V.get_reward_fn(name)
    assert isinstance(fn(r"<think>t</think> \boxed{2}", "2"), float)
  assert V.get_reward_fn("math_correct")(r"\boxed{2}", "2") == 1.0
  assert V.get_reward_fn("think_format")(r"<think>t</think> \boxed{2}", "2") == 1.0
  with pytest.raises(ValueError, match=r"math_correct.*think_format"):
    V.get_reward_fn("nope")


# ---- score_batch ----------------------------------------------------------------------------
# Top-level so that executor='process' can pickle them.


def _raises_on_bad(completion: str, reference: str) -> float:
  """Raises on completions containing 'bad'."""
  if "bad" in completion:
    raise RuntimeError("verifier crashed")
  return 1.0


def _sleeps_on_slow(completion: str, reference: str, seconds: float = 1.0) -> float:
  """Sleeps `seconds` on completions containing 'slow'."""
  if "slow" in completion:
    time.sleep(seconds)
  return 0.5


def _not_a_number(completion: str, reference: str):
  """Returns NaN, a string (numeric or not), a value float32 cannot hold, or 0.5 ("fine"):
  all but the last count as errors."""
  returns = {"bad": float("nan"), "huge": 1e39, "text": "0.7", "fine": 0.5}
  return returns.get(completion, "yes")


COMPLETIONS = [r"\boxed{2}", "bad \\boxed{3}", "slow \\boxed{4}", r"\boxed{5}"]
REFERENCES = ["2", "3", "5", "5"]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_score_batch_errors_and_timeouts(executor):
  terms = {
    "correct": V.math_correct,
    "crashy": _raises_on_bad,
    # A thread cannot be killed: it sleeps on after the batch returns, so far longer than the
    # timeout on both sides of the bound below, whatever the machine's load.
    "sleepy": functools.partial(_sleeps_on_slow, seconds=10.0 if executor == "thread" else 60.0),
  }
  t0 = time.monotonic()
  scores, stats = V.score_batch(
    COMPLETIONS, REFERENCES, terms=terms, timeout_s=0.5, max_workers=4, executor=executor
  )
  elapsed = time.monotonic() - t0
  assert set(scores) == set(terms)
  for v in scores.values():
    assert v.dtype == np.float32 and v.shape == (4,)
  np.testing.assert_array_equal(scores["correct"], [1, 1, 0, 1])
  np.testing.assert_array_equal(scores["crashy"], [1, 0, 1, 1])
  np.testing.assert_array_equal(scores["sleepy"], [0.5, 0.5, 0, 0.5])
  assert stats["verifier/errors/crashy"] == 1 and stats["verifier/timeouts/crashy"] == 0
  assert stats["verifier/timeouts/sleepy"] == 1 and stats["verifier/errors/sleepy"] == 0
  assert stats["verifier/errors/correct"] == 0 and stats["verifier/timeouts/correct"] == 0
  assert stats["verifier/errors"] == 1 and stats["verifier/timeouts"] == 1
  assert elapsed < 8.0  # the hung call (10 s or 60 s) is not waited for


def test_score_batch_threads_recover_when_every_worker_hangs():
  completions = ["slow"] * 2 + ["ok"] * 6
  terms = {"sleepy": functools.partial(_sleeps_on_slow, seconds=2.0)}
  scores, stats = V.score_batch(
    completions, [""] * 8, terms=terms, timeout_s=0.3, max_workers=2, executor="thread"
  )
  np.testing.assert_array_equal(scores["sleepy"], [0, 0] + [0.5] * 6)
  assert stats["verifier/timeouts"] == 2 and stats["verifier/errors"] == 0


def test_score_batch_process_kills_hung_workers_and_reruns_the_rest():
  completions = ["slow", "ok", "ok", "slow", "ok", "ok"]
  terms = {"sleepy": functools.partial(_sleeps_on_slow, seconds=60.0), "crashy": _raises_on_bad}
  t0 = time.monotonic()
  scores, stats = V.score_batch(
    completions, [""] * 6, terms=terms, timeout_s=0.5, max_workers=2, executor="process"
  )
  assert time.monotonic() - t0 < 15.0
  np.testing.assert_array_equal(scores["sleepy"], [0, 0.5, 0.5, 0, 0.5, 0.5])
  np.testing.assert_array_equal(scores["crashy"], [1] * 6)
  assert stats["verifier/timeouts/sleepy"] == 2 and stats["verifier/errors"] == 0


def test_score_batch_counts_non_numeric_results_as_errors():
  scores, stats = V.score_batch(
    ["bad", "huge", "text", "other", "fine"],
    [""] * 5,
    terms={"nan": _not_a_number},
    executor="thread",
  )
  np.testing.assert_array_equal(scores["nan"], [0, 0, 0, 0, 0.5])  # 1e39 was inf in float32
  assert stats["verifier/errors/nan"] == 4


def test_score_batch_process_rejects_unpicklable_terms():
  with pytest.raises(ValueError, match="pickled"):
    V.score_batch(["a"], ["b"], terms={"lam": lambda c, r: 1.0}, executor="process")


def test_score_batch_validates_inputs_and_handles_empty():
  with pytest.raises(ValueError, match="references"):
    V.score_batch(["a", "b"], ["a"], terms={"c": V.math_correct})
  with pytest.raises(ValueError, match="executor"):
    V.score_batch(["a"], ["a"], terms={"c": V.math_correct}, executor="gpu")
  scores, stats = V.score_batch([], [], terms={"c": V.math_correct})
  assert scores["c"].shape == (0,) and stats["verifier/errors"] == 0
  scores, stats = V.score_batch(["a"], ["a"], terms={})
  assert scores == {} and stats["verifier/timeouts"] == 0


def test_score_batch_with_registry_terms_and_no_timeout():
  terms = {n: V.get_reward_fn(n) for n in ["math_correct", "think_format", "math_format_boxed"]}
  completions = [r"<think>1+1</think> \boxed{2}", r"\boxed{3}", "<think>x</think> 2"]
  scores, stats = V.score_batch(completions, ["2", "2", "2"], terms=terms, timeout_s=None)
  np.testing.assert_array_equal(scores["math_correct"], [1, 0, 1])
  np.testing.assert_array_equal(scores["think_format"], [1, 0, 1])
  np.testing.assert_array_equal(scores["math_format_boxed"], [1, 1, 0])
  assert stats["verifier/errors"] == 0 and stats["verifier/timeouts"] == 0


def test_reference_answer():
  assert R.reference_answer("a\n#### 5") == "5"
  assert R.reference_answer(r"so \boxed{1} no \boxed{2}") == "2"
  assert R.reference_answer(" 7 ") == "7"
