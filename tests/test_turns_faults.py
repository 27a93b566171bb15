"""Multi-turn settings that trained without a word while the tool could never act as asked: a
turn budget too short for any call, a completion budget too short for one call and its answer,
and warm-start tool traces that no tool answers (or that the task never writes). Each is one
`error:` line, exit 2, before the workdir is made."""

import subprocess
import sys

from conftest import REPO, cli_env, config_problems

CONFIG = f"--config={REPO / 'configs' / 'default.py'}"
CHEAP = ("--config.train.num_steps=1", "--config.sft.steps=0", "--config.task.eval_size=8")


def _refused(tmp_path, *args) -> str:
  """The one line the trainer's command line refuses `args` with (exit 2, no workdir made)."""
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "jaxrl_llm.main", CONFIG, f"--workdir={workdir}", *CHEAP, *args]
  proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and not workdir.exists()
  return lines[0]


def test_a_turn_budget_shorter_than_any_call_is_refused(tmp_path):
  """turn_tokens=1 ended every segment after one token: no call could close, the tool never
  answered, and the run trained single-turn (rc 0)."""
  got = _refused(tmp_path, "--config.sampling.tool=calculator", "--config.sampling.turn_tokens=1")
  assert got == (
    "error: invalid config: sampling.turn_tokens=1 ends every segment before a call can close: "
    "a call takes at least 2 tokens here (a number and the close '=', 1 token); allowed: 0 "
    "(off) or at least 2"
  )
  assert config_problems(**{"sampling.tool": "calculator", "sampling.turn_tokens": 2}) == ""


def test_a_completion_budget_too_short_for_one_call_is_refused(tmp_path):
  """max_new_tokens=4 with the calculator left no room for a call, its answer and a token
  after it: the tool was silently never used (rc 0)."""
  got = _refused(
    tmp_path, "--config.sampling.tool=calculator", "--config.sampling.max_new_tokens=4"
  )
  assert got == (
    "error: invalid config: sampling.max_new_tokens=4 leaves no room for a tool call: a call, "
    "the tool's answer and a token after it take at least 5 tokens here (the call, a number "
    "and the close '=': 2; the shortest answer: 2; one after); allowed: "
    "sampling.max_new_tokens at least 5, or sampling.tool='none'"
  )
  assert config_problems(**{"sampling.tool": "calculator", "sampling.max_new_tokens": 5}) == ""


def test_tool_traces_without_a_tool_are_refused(tmp_path):
  """addition with task.tool_traces=0.5 and no tool warm-started on `12+35=47,47` and then
  sampled with no one to answer the calls (rc 0)."""
  got = _refused(tmp_path, "--config.task.name=addition", "--config.task.tool_traces=0.5")
  assert got == (
    "error: invalid config: task.tool_traces=0.5 warm-starts on traces that call a tool, but "
    "sampling.tool='none' answers no call; allowed: task.tool_traces=0 without a tool, or "
    "sampling.tool in calculator, arithmetic"
  )
  tool = {"task.name": "addition", "task.tool_traces": 0.5, "sampling.tool": "calculator"}
  assert config_problems(**tool) == ""


def test_tool_traces_on_a_task_that_writes_none_are_refused(tmp_path):
  """reverse has no tool traces: task.tool_traces=0.5 was taken and did nothing (rc 0)."""
  got = _refused(tmp_path, "--config.sampling.tool=calculator", "--config.task.tool_traces=0.5")
  assert got == (
    "error: invalid config: task.tool_traces=0.5 has no effect: task.name='reverse' writes no "
    "tool traces (addition, countdown do); drop it or set what it acts with"
  )


def test_tool_traces_a_tool_answers_otherwise_are_refused(tmp_path):
  """countdown's traces are worked left to right (`5*3+8=23,5*3+8`, as its own tool and the
  calculator answer); with sampling.tool=arithmetic (the usual precedence: `2+3*4` is 14) the
  warm start taught answers that the tool then contradicted, without a word (rc 0)."""
  got = _refused(
    tmp_path,
    "--config.task.name=countdown",
    "--config.task.tool_traces=1",
    "--config.sampling.tool=arithmetic",
  )
  assert got == (
    "error: invalid config: task.tool_traces=1.0: countdown's traces show the answers of "
    "countdown or calculator, which sampling.tool='arithmetic' does not give alike; allowed: "
    "sampling.tool in countdown, calculator, or task.tool_traces=0"
  )
  for tool in ("countdown", "calculator"):
    trace = {"task.name": "countdown", "task.tool_traces": 1.0, "sampling.tool": tool}
    assert config_problems(**trace) == "", tool
  sums = {"task.name": "addition", "task.tool_traces": 0.5, "sampling.tool": "arithmetic"}
  assert config_problems(**sums) == ""  # a sum is the same with or without precedence
