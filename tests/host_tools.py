"""Host tools that misbehave, for tests/test_multi_turn.py (top-level, so worker processes
can import them)."""

import os
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


def hang_when_told(call: str, prompt: str) -> int:
  """The call's length until the file named by $HANG_WHEN exists; then it writes that name +
  '.hung' and never answers in time."""
  told = os.environ.get("HANG_WHEN", "")
  if told and os.path.exists(told):
    open(told + ".hung", "a").close()
    time.sleep(600)
  return len(call)
