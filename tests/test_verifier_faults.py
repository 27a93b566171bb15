"""Verifiers that cannot hang: real worker processes killed on timeout, a kept pool, input guards.

Everything here runs real processes (no mocks). Hanging terms spin in C holding their GIL, which
no thread timeout can stop; the process executor must kill them and replace its pool.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import random
import string
import threading
import time

import numpy as np
import pytest

from jaxrl_llm.data import verifiers as V
from jaxrl_llm.data.verifiers import math as M
from jaxrl_llm.data.verifiers import scoring

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
EXPLOSIVE = [
  r"\boxed{9^{9^{9^{9}}}}",
  r"\boxed{1000000000!}",
  r"\boxed{(x+1)^{100000}}",
  r"\boxed{\binom{10^9}{5*10^8}}",
]

# ---- terms (top-level, so that worker processes can unpickle them) -------------------------


def _spins_on_hang(completion: str, reference: str) -> float:
  """On 'hang': writes this process's pid to the file `reference`, then spins in C for hours."""
  if "hang" in completion:
    pathlib.Path(reference).write_text(str(os.getpid()))
    sum(range(10**13))  # one C call: holds the GIL and never checks for signals
  return 1.0


def _dies_on_die(completion: str, reference: str) -> float:
  """On 'die': the worker process exits at once (as after a segfault)."""
  if "die" in completion:
    os._exit(3)
  return 1.0


def _interrupts(completion: str, reference: str) -> float:
  """Raises KeyboardInterrupt itself (a term's own failure, not the user's Ctrl-C)."""
  raise KeyboardInterrupt("from the term")


def _huge_error(completion: str, reference: str) -> float:
  """Fails with a message of ten million characters."""
  raise ValueError("x" * 10_000_000)


def _box(inner: str) -> str:
  return r"\boxed{" + inner + "}"


def _nested(depth: int, core: str = "1") -> str:
  return "{" * depth + core + "}" * depth


def _gone(pid: int, within_s: float = 10.0) -> bool:
  """Whether process `pid` disappears within `within_s` seconds."""
  deadline = time.monotonic() + within_s
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.01)
  return False


# ---- the process executor: default, kills hung calls, keeps its pool ------------------------


def test_hung_call_is_killed_through_the_default_executor(tmp_path):
  pidfile = tmp_path / "pid"
  t0 = time.monotonic()
  scores, stats = V.score_batch(
    ["ok", "hang", "ok"], [str(pidfile)] * 3, terms={"spin": _spins_on_hang}, timeout_s=0.5
  )
  elapsed = time.monotonic() - t0
  np.testing.assert_array_equal(scores["spin"], [1, 0, 1])
  assert stats["verifier/timeouts/spin"] == 1 and stats["verifier/timeouts"] == 1
  assert stats["verifier/errors"] == 0
  assert elapsed < 30.0  # the call alone would spin for hours; a thread would never return
  assert _gone(int(pidfile.read_text()))  # the worker that ran it was killed (and reaped)


def test_a_stop_cuts_the_calls_in_flight_and_starts_no_more(tmp_path):
  """`stop` (a run's SIGTERM): a call hung with no time limit is cut once it turns true,
  scored `fill`, counted in `verifier/cut`, its worker killed; once true, no call starts."""
  pidfile = tmp_path / "pid"
  told = lambda: pidfile.exists() and bool(pidfile.read_text())  # noqa: E731  (the call hangs)
  scores, stats = V.score_batch(
    ["ok", "hang"], [str(pidfile)] * 2, terms={"spin": _spins_on_hang}, timeout_s=None,
    fill=-1.0, stop=told,
  )  # fmt: skip
  assert scores["spin"][1] == -1.0 and stats["verifier/cut"] >= 1
  assert stats["verifier/timeouts"] == 0 and stats["verifier/errors"] == 0
  assert _gone(int(pidfile.read_text()))
  scores, stats = V.score_batch(
    ["ok"] * 3, [""] * 3, terms={"spin": _spins_on_hang}, fill=-1.0, stop=told
  )
  assert stats["verifier/cut"] == 3 and list(scores["spin"]) == [-1.0] * 3
  assert "verifier/cut" not in V.score_batch(["ok"], [""], terms={"spin": _spins_on_hang})[1]


def test_kept_pool_is_reused_across_batches_and_replaced_after_a_timeout(tmp_path):
  quick = {"correct": V.math_correct}
  completions, references = [_box(str(i)) for i in range(8)], [str(i) for i in range(8)]
  scores, _ = V.score_batch(completions, references, terms=quick, max_workers=2)
  np.testing.assert_array_equal(scores["correct"], [1] * 8)
  first = scoring.worker_pids()
  assert 1 <= len(first) <= 2
  V.score_batch(completions, references, terms=quick, max_workers=2)
  # The same pool served the second batch: its workers live on (the executor starts its
  # second worker on demand, so one may join them, never more than max_workers).
  again = scoring.worker_pids()
  assert set(first) <= set(again) and len(again) <= 2, (first, again)

  _, stats = V.score_batch(
    ["hang"], [str(tmp_path / "pid")], terms={"spin": _spins_on_hang}, timeout_s=0.3, max_workers=2
  )
  assert stats["verifier/timeouts"] == 1
  assert all(_gone(pid) for pid in first)  # the whole pool was killed...
  scores, stats = V.score_batch(completions, references, terms=quick, max_workers=2)
  np.testing.assert_array_equal(scores["correct"], [1] * 8)
  assert stats["verifier/timeouts"] == 0 and stats["verifier/errors"] == 0
  replaced = scoring.worker_pids()
  assert replaced and not set(replaced) & set(first)  # ...and a fresh one took its place


def test_calls_sharing_a_task_with_a_hung_call_run_again_untimed(tmp_path):
  # 40 calls on one worker travel 8 to a task; the hung call's task-mates that had already
  # returned lose their results with the killed worker, run again, and are not timeouts.
  completions = ["ok"] * 40
  completions[5] = "hang"
  scores, stats = V.score_batch(
    completions,
    [str(tmp_path / "pid")] * 40,
    terms={"spin": _spins_on_hang},
    timeout_s=0.5,
    max_workers=1,
  )
  np.testing.assert_array_equal(scores["spin"], [0 if c == "hang" else 1 for c in completions])
  assert stats["verifier/timeouts"] == 1 and stats["verifier/errors"] == 0


def test_dead_worker_counts_as_an_error_and_the_pool_is_replaced():
  terms = {"die": _dies_on_die}
  scores, stats = V.score_batch(["die"], [""], terms=terms, max_workers=2)
  assert scores["die"][0] == 0 and stats["verifier/errors"] == 1
  scores, stats = V.score_batch(["fine"] * 4, [""] * 4, terms=terms, max_workers=2)
  np.testing.assert_array_equal(scores["die"], [1] * 4)
  assert stats["verifier/errors"] == 0


def test_concurrent_batches_each_get_correct_scores():
  terms = {"correct": V.math_correct}
  results = {}

  def run(k):
    completions = [_box(str(k * 100 + i)) for i in range(20)]
    refs = [str(k * 100 + i) if i % 2 else "-1" for i in range(20)]
    results[k] = V.score_batch(completions, refs, terms=terms, max_workers=2)

  threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for scores, stats in results.values():
    np.testing.assert_array_equal(scores["correct"], [i % 2 for i in range(20)])
    assert stats["verifier/errors"] == 0 and stats["verifier/timeouts"] == 0


def test_shutdown_workers_stops_the_kept_pool():
  V.score_batch(["a", "b"], ["a", "b"], terms={"c": V.math_correct}, max_workers=2)
  pids = scoring.worker_pids()
  assert pids
  scoring.shutdown_workers()
  assert scoring.worker_pids() == [] and all(_gone(pid) for pid in pids)


# ---- guards before parsing --------------------------------------------------------------------


def test_guard_rejects_deep_nesting_and_long_answers():
  limit = M.MAX_BRACE_DEPTH
  assert M.brace_depth("a{b{c}d}{e}") == 2
  assert M.brace_depth(r"\{\{\{1\}\}\}") == 0  # escaped braces do not nest
  assert M.brace_depth("}}}{") == 1  # stray closing braces are ignored
  assert M.within_limits(_nested(limit))
  assert not M.within_limits(_nested(limit + 1))
  assert M.within_limits("1" * M.MAX_ANSWER_CHARS)
  assert not M.within_limits("1" * (M.MAX_ANSWER_CHARS + 1))
  assert not V.is_equivalent(_nested(limit + 1), _nested(limit + 1))  # refused, even if equal
  assert V.parse_number(_nested(limit + 1)) is None


def test_rewards_apply_the_guards():
  limit = M.MAX_BRACE_DEPTH
  # The box adds one level: an answer nested to the limit still parses, one more does not.
  assert V.math_correct(_box(_nested(limit - 1)), "1") == 1.0
  assert V.math_correct(_box(_nested(limit)), "1") == 0.0
  # A braced group renders as its contents: redundant braces are stripped (in linear time).
  assert V.math_correct(r"\boxed{{{1}}}", "1") == 1.0
  # The answer is read from the tail; far earlier text does not matter, however long.
  assert V.math_correct("so on " * 20_000 + _box("7"), "7") == 1.0
  assert V.extract_answer(_box("7") + "." * M.ANSWER_WINDOW_CHARS) is None
  # A completion beyond MAX_TEXT_CHARS scores 0 in every built-in term, unread.
  huge = "x" * M.MAX_TEXT_CHARS + r"<think>a</think> \boxed{7}" + "\n#### 7"
  for name in V.REWARD_FNS:
    if name != "math_verify_correct":
      assert V.get_reward_fn(name)(huge, "7") == 0.0, name


def test_extract_boxed_is_unchanged_by_the_linear_matcher():
  text = r"a \boxed{x^{2}} \boxed{\{1\}} \fbox 5, \boxed{ {{3}} } \boxed{open"
  assert V.extract_boxed(text) == ["x^{2}", r"\{1\}", "5", "{{3}}"]
  assert V.extract_boxed(r"\boxed{" * 5000) == []  # unbalanced boxes: no answer, one pass
  assert V.extract_boxed(r"\boxed{\boxed{1}}") == [r"\boxed{1}"]


def test_hostile_payloads_score_zero_within_the_time_limit():
  rnd = random.Random(0)
  noise = "".join(
    rnd.choice(string.ascii_letters + string.digits + " {}\\^_.,") for _ in range(1 << 20)
  )
  payloads = [_box(_nested(n)) for n in (2_000, 8_000, 32_000, 499_000)]  # 4 KB ... 1 MB
  payloads += [noise[: 1 << 14], noise, r"\boxed{" * 100_000, "1" + ",111" * 200_000]
  payloads += EXPLOSIVE
  terms = {n: V.get_reward_fn(n) for n in ("math_correct", "math_format_boxed", "gsm8k_correct")}
  scores, stats = V.score_batch(payloads, ["2"] * len(payloads), terms=terms, timeout_s=5.0)
  # Before the guards, math_correct took 92 s on the 64 KB nesting alone.
  assert stats["verifier/timeouts"] == 0 and stats["verifier/errors"] == 0
  np.testing.assert_array_equal(scores["math_correct"], 0)
  np.testing.assert_array_equal(scores["gsm8k_correct"], 0)


def test_explosive_payloads_are_compared_as_strings_by_the_builtin_checker():
  for p in EXPLOSIVE:
    assert V.math_correct(p, "1") == 0.0
    assert V.math_correct(p, p) == 1.0  # the same expression matches itself, unevaluated
  assert not V.is_equivalent("1e400", "9" * 1000)  # beyond float range: no OverflowError


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify is not installed")
def test_explosive_payloads_through_math_verify_are_timed_out():
  t0 = time.monotonic()
  scores, stats = V.score_batch(
    EXPLOSIVE,
    ["1"] * len(EXPLOSIVE),
    terms={"mv": V.math_verify_correct},
    timeout_s=2.0,
    max_workers=len(EXPLOSIVE),
  )
  # Through a thread, 9^{9^{9^{9}}} never returned (150 s and counting).
  assert time.monotonic() - t0 < 60.0
  np.testing.assert_array_equal(scores["mv"], 0)
  assert stats["verifier/timeouts"] == len(EXPLOSIVE) and stats["verifier/errors"] == 0


# ---- the trainer's host-reward path -----------------------------------------------------------


def test_file_task_reports_verifier_timeouts(tmp_path):
  # Imported here: worker processes import this module to find its terms, and should not pay
  # for the tokenizer and data stack.
  from text_fixtures import build_bpe_tokenizer

  from jaxrl_llm.data.file_task import FileTask
  from jaxrl_llm.data.tokenizers import HFTokenizer

  tok = HFTokenizer.from_dir(build_bpe_tokenizer(tmp_path / "tok"))
  rows = [tok.encode("hang"), tok.encode(r"so \boxed{1}")]
  width = max(map(len, rows)) + 1
  eos = tok.encode("<|endoftext|>")[0]
  completions = np.array([r + [eos] * (width - len(r)) for r in rows], np.int32)
  task = FileTask(
    tokenizer=tok,
    train_records=[],
    eval_records=[],
    template="plain",
    prompt_len=8,
    max_new_tokens=width,
    reward_fns={"spin": _spins_on_hang},
    timeout_s=0.5,
    eval_size=2,
    correct_term="math_correct",
    special_tokens_in_text=False,
  )
  terms, stats = task.host_reward_terms(completions, [str(tmp_path / "pid"), "1"])
  np.testing.assert_array_equal(terms["spin"], [0, 1])
  np.testing.assert_array_equal(terms["correct"], [0, 1])
  # host_reward_step logs these stats with the step's metrics.
  assert stats["verifier/timeouts"] == 1 and stats["verifier/timeouts/spin"] == 1


# ---- leaks -------------------------------------------------------------------------------------


def _open_fds() -> int:
  return len(os.listdir("/proc/self/fd"))


def _children() -> list[int]:
  psutil = pytest.importorskip("psutil")
  return sorted(p.pid for p in psutil.Process().children(recursive=True))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_thousand_hostile_calls_leak_no_process_or_file_descriptor(tmp_path):
  terms = {"correct": V.math_correct, "spin": _spins_on_hang}
  ok = ([_box("1")] * 8, ["1"] * 8)
  V.score_batch(*ok, terms=terms, max_workers=2)  # the kept pool, at full strength
  fds, children = _open_fds(), _children()
  hostile = [_box(_nested(40_000)), r"\boxed{" * 20_000, *EXPLOSIVE, _box("1"), "x" * 70_000]
  calls = 0
  for k in range(21):
    completions = [hostile[(k + i) % len(hostile)] for i in range(24)]
    if k % 4 == 0:
      completions[k % 24] = "hang"  # every fourth batch kills and replaces the pool
    _, stats = V.score_batch(
      completions, [str(tmp_path / "pid")] * 24, terms=terms, timeout_s=0.5, max_workers=2
    )
    calls += 24 * len(terms)
    assert stats["verifier/errors"] == 0
    assert stats["verifier/timeouts"] == (k % 4 == 0)
  assert calls >= 1_000  # 21 batches x 24 hostile completions x 2 terms
  V.score_batch(*ok, terms=terms, max_workers=2)  # the last pool back to full strength
  assert _open_fds() <= fds + 2
  assert len(_children()) <= len(children)


def test_a_term_that_raises_keyboard_interrupt_fails_its_calls_and_is_not_a_ctrl_c(caplog):
  """A term raising KeyboardInterrupt in a worker was taken for the user's Ctrl-C: the run
  stopped "by SIGINT" and told the user to relaunch, which failed the same way. A worker
  ignores SIGINT (the trainer takes Ctrl-C and kills its workers), so the interrupt is the
  call's own: scored as failed and counted; in a thread worker too."""
  for executor in ("process", "thread"):
    scores, stats = scoring.score_batch(
      ["a", "b"], ["r", "r"], terms={"mine": _interrupts}, executor=executor, timeout_s=30
    )
    assert stats["verifier/errors/mine"] == 2 and list(scores["mine"]) == [0.0, 0.0], executor
  assert "KeyboardInterrupt('from the term')" in caplog.text


def test_a_huge_error_message_is_cut(caplog):
  """A term failing with a 10-million-character message: each call carried it back, the warning
  printed it whole (one line of 10 MB on the terminal and in log.txt) and the run crawled."""
  _, stats = scoring.score_batch(["a"] * 4, ["r"] * 4, terms={"mine": _huge_error})
  assert stats["verifier/errors/mine"] == 4
  (line,) = [r.getMessage() for r in caplog.records if "failed on item" in r.getMessage()]
  assert len(line) < 1000 and line.endswith("... (10000014 characters)"), line[:300]


def test_a_timed_out_call_is_said_once(tmp_path, caplog):
  """A hung call was killed and counted without a word: a run whose tool hung every call
  printed nothing for minutes. The line also says how long hung calls hold a batch (a host
  tool whose every call hangs stalled an evaluation for minutes under a 2 s limit)."""
  flag = tmp_path / "pid"
  _, stats = scoring.score_batch(
    ["hang", "ok"], [str(flag), "x"], terms={"spin": _spins_on_hang}, timeout_s=1.0
  )
  assert stats["verifier/timeouts/spin"] == 1
  said = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
  workers = min(scoring._default_workers("process"), 2)  # never more than the calls
  assert said == [
    "reward term 'spin' timed out on item 0 (it ran past 1 s: scored as failed, and counted in "
    f"verifier/timeouts/spin; calls that hang are waited for 1 s each, {workers} at a time, and "
    f"a term whose first {2 * workers} calls of a batch all hang is not waited for again in it)"
  ]


def test_a_term_hanging_on_every_call_is_not_waited_for_past_two_rounds(tmp_path, caplog):
  """A term that hangs on every call held a step for (calls / workers) time limits: 256
  completions under a 1 s limit on 2 workers took 150 s a step. Once its first 2 x workers
  calls of a batch have all hung, its other calls are not started: they score 0 and count
  as timeouts, with one warning. Each started call leaves a file: 4 to 8 of the 12."""
  refs = [str(tmp_path / f"pid{k}") for k in range(12)]
  scores, stats = V.score_batch(
    ["hang"] * 12, refs, terms={"spin": _spins_on_hang}, timeout_s=0.3, max_workers=2
  )
  assert stats["verifier/timeouts/spin"] == 12 and list(scores["spin"]) == [0.0] * 12
  # A kill may take a hung call that had not yet run its time along: it runs again, later.
  assert 4 <= len(list(tmp_path.iterdir())) <= 8
  said = [r.getMessage() for r in caplog.records if "hung on its first" in r.getMessage()]
  assert said == [
    "reward term 'spin' hung on its first 4 calls of this batch: its other calls are not "
    "waited for (scored as failed, counted in verifier/timeouts/spin)"
  ]


def test_a_term_that_returns_once_is_waited_for_on_every_call(tmp_path):
  """A term that came back once in the batch is not given up, however many of its calls hang
  after it: every call is started (each hung one leaves its file) and each returned one
  keeps its score."""
  completions = ["ok"] + ["hang"] * 5 + ["ok"] * 2
  refs = [str(tmp_path / f"pid{k}") for k in range(8)]
  scores, stats = V.score_batch(
    completions, refs, terms={"spin": _spins_on_hang}, timeout_s=0.3, max_workers=1
  )
  np.testing.assert_array_equal(scores["spin"], [1, 0, 0, 0, 0, 0, 1, 1])
  assert stats["verifier/timeouts/spin"] == 5 and len(list(tmp_path.iterdir())) == 5


def test_a_failing_term_is_said_once_for_all_the_batches_sharing_said(caplog):
  """A term failing on every call was warned about once per batch: once a step, and twice an
  evaluation, for the whole run. The batches of a run share one `said` set: one warning in
  all, every failure still counted in each batch's stats."""
  said: set[str] = set()
  for _ in range(3):
    _, stats = V.score_batch(["a"] * 3, ["r"] * 3, terms={"mine": _huge_error}, said=said)
    assert stats["verifier/errors/mine"] == 3
  lines = [r.getMessage() for r in caplog.records if "failed on item" in r.getMessage()]
  assert len(lines) == 1 and said == {"mine"}
  assert "its first failure; all are counted in verifier/errors/mine" in lines[0]
  V.score_batch(["a"], ["r"], terms={"mine": _huge_error})  # a batch of its own says it again
  assert sum("failed on item" in r.getMessage() for r in caplog.records) == 2


LEAVING = """
import os, sys
from jaxrl_llm import launch
from jaxrl_llm.data.verifiers import scoring
from dying import dies

if __name__ == "__main__":
  for _ in range(3):  # each batch's pool breaks (a worker exits) and is replaced
    scoring.score_batch(["a", "b", "c"], ["r"] * 3, terms={"d": dies})
  print("the stop's line", file=sys.stderr, flush=True)
  launch.leave_job(143)
"""


def test_a_run_leaving_after_broken_pools_prints_nothing_after_its_line(tmp_path):
  """Pools broken by a worker that exits (a host tool calling os._exit) left semaphores that
  Python's resource tracker warned of after the run's stop line, which was then not the last."""
  import subprocess
  import sys

  from conftest import REPO, cli_env

  (tmp_path / "dying.py").write_text("import os\n\ndef dies(c, r):\n  os._exit(1)\n")
  (tmp_path / "leaving.py").write_text(LEAVING)
  env = {**cli_env(), "PYTHONPATH": f"{tmp_path}:{cli_env().get('PYTHONPATH', '')}"}
  proc = subprocess.run(
    [sys.executable, str(tmp_path / "leaving.py")], cwd=REPO, env=env, capture_output=True,
    text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 143, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == "the stop's line", proc.stderr[-2000:]


def test_a_killed_pool_is_gone_with_its_manager_thread_when_closing_returns():
  """The executor's manager thread holds a pool's queues; a broken or stopped pool's thread
  could outlive the close, so a run leaving just after kept the queues' semaphores registered
  and Python's resource tracker warned of them after the run's last line (CI, under load)."""
  import concurrent.futures.process as cfp

  def managers():  # the live manager threads of this process's process pools
    return {t for t in threading.enumerate() if isinstance(t, cfp._ExecutorManagerThread)}

  others = managers()  # another library's pools, if any: not ours to judge
  for _ in range(10):  # the thread outlived the close about once in five before
    _, stats = scoring.score_batch(["die", "die"], ["r"] * 2, terms={"d": _dies_on_die}, said={"d"})
    assert stats["verifier/errors/d"] == 2
    scoring.shutdown_workers()
    assert not managers() - others


REPLACED = """
import sys
import jaxrl_llm.launch  # the trainer's imports: jax among them
from jaxrl_llm.data.verifiers import scoring
from dying import dies

if __name__ == "__main__":
  scoring.score_batch(["a"], ["r"], terms={"d": dies})  # starts the fork server; a worker dies
  print("REPLACED", file=sys.stderr, flush=True)
  for _ in range(2):  # two more pools, each replacing a broken one
    _, stats = scoring.score_batch(["a", "b"], ["r"] * 2, terms={"d": dies}, max_workers=2)
    assert stats["verifier/errors"] == 2, stats
"""


def test_a_replaced_pools_workers_do_not_import_the_trainer_again(tmp_path):
  """A worker runs the parent's main module again before its first call. Under
  `python -m <module>` that imported jax anew in every worker (the fork server's `__main__`
  preload never applies), 1.2 s per replaced pool: 43 s a step for a host tool that ends its
  worker. The package's loaded modules are now preloaded: after the first pool, workers import
  nothing of jax (Python's import-time report, which workers inherit, says what each imports)."""
  import subprocess
  import sys

  from conftest import cli_env

  (tmp_path / "dying.py").write_text("import os\n\ndef dies(c, r):\n  os._exit(1)\n")
  (tmp_path / "replaced.py").write_text(REPLACED)
  env = {**cli_env(), "PYTHONPATH": f"{tmp_path}:{cli_env().get('PYTHONPATH', '')}"}
  env["PYTHONPROFILEIMPORTTIME"] = "1"
  proc = subprocess.run(
    [sys.executable, "-m", "replaced"], cwd=tmp_path, env=env, capture_output=True, text=True,
    timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  before, after = (
    [line.rsplit("|", 1)[-1].strip() for line in part.splitlines() if "|" in line]
    for part in proc.stderr.split("REPLACED\n")
  )
  assert "jax" in before  # the report is on: the parent imported jax before the marker
  imported = after
  assert imported, proc.stderr[-2000:]  # the workers re-ran the main module (its own imports)
  assert not [m for m in imported if m == "jax" or m.startswith(("jax.", "jaxrl_llm"))], imported


ORPHANED = """
import os, pathlib, sys, time
from jaxrl_llm.data.verifiers import scoring

def sleeps(completion, reference):
  pathlib.Path(reference).write_text(str(os.getpid()))
  time.sleep(600)
  return 1.0

if __name__ == "__main__":
  scoring.score_batch(["a"], [sys.argv[1]], terms={"s": sleeps}, timeout_s=None)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux: a worker dies with its parent")
def test_a_hung_worker_ends_with_a_trainer_killed_by_sigkill(tmp_path):
  """A worker inherited the fork server's keep-alive pipe: while its call hung, the server
  outlived the killed trainer, and the worker (which dies with the server) lived on for the
  call's whole 600 s, holding the trainer's stderr open."""
  import signal
  import subprocess
  import sys

  from conftest import cli_env

  (tmp_path / "orphaned.py").write_text(ORPHANED)
  pid_file = tmp_path / "worker.pid"
  proc = subprocess.Popen(
    [sys.executable, str(tmp_path / "orphaned.py"), str(pid_file)], env=cli_env(),
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
  )  # fmt: skip
  try:
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
      assert proc.poll() is None and time.monotonic() < deadline, "the call never started"
      time.sleep(0.02)
    worker = int(pid_file.read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert _gone(worker), "the hung worker outlived the killed trainer"
  finally:
    proc.kill()
    if pid_file.exists() and pid_file.read_text():
      with contextlib.suppress(ProcessLookupError):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
