"""How a process of a multi-process job reads its peers' stop notices (`distributed.peer_stopped`);
the real job is exercised in `tests/test_multihost.py` (slow tier)."""

from jaxrl_llm import distributed

KEY = "jaxrl_llm/stopped/"


def test_a_peers_unexpected_stop_ends_this_process_at_once_naming_it_and_why():
  seen = {}
  entries = [(f"{KEY}1", "1 ValueError: bad reward"), (f"{KEY}0", "130 stopped by SIGINT")]
  line = distributed.peer_stopped(entries, 0, 4, seen, now=5.0)  # its own notice is skipped
  assert line.startswith("error: process 1 of 4 stopped (ValueError: bad reward); this process")
  assert distributed.peer_stopped([(f"{KEY}0", "130 x")], 0, 4, seen, now=5.0) is None


def test_an_error_every_process_may_meet_itself_waits_so_each_prints_its_own_line_first():
  seen, grace = {}, distributed.OWN_ERROR_GRACE_S
  entries = [(f"{KEY}0", "2 error: mesh.data=3 does not divide the 8 devices")]
  assert distributed.peer_stopped(entries, 1, 2, seen, now=100.0) is None
  assert distributed.peer_stopped(entries, 1, 2, seen, now=100.0 + grace / 2) is None
  line = distributed.peer_stopped(entries, 1, 2, seen, now=100.0 + grace)
  assert "process 0 of 2 stopped (error: mesh.data=3 does not divide" in line
