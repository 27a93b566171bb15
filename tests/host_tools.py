"""Host tools that misbehave, for tests/test_multi_turn.py (top-level, so worker processes
can import them)."""

import time


def hang(call: str, prompt: str) -> int:
  """Never answers in time."""
  time.sleep(600)
  return 0


def fail(call: str, prompt: str) -> int:
  """Raises on every call."""
  raise RuntimeError(f"no answer to {call!r}")


def length(call: str, prompt: str) -> int:
  """The call's length: a tool that always answers."""
  return len(call)
