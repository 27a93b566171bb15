"""The fast-path checks (`jaxrl_llm.kernels.verify`, `tools/device_check.py`): what runs on
CPU passes against its reference, and `auto` falls back where a check fails or raises."""

from __future__ import annotations

import functools
import json
import logging
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm import fast_paths
from jaxrl_llm.kernels import verify
from jaxrl_llm.models import moe


def _always(value):
  return lambda: value


def _checks(**cases) -> dict[str, verify.Check]:
  """A check table of the given cases (all runnable here), tolerance 1e-5."""
  return {name: verify.Check(case, _always(None), 1e-5, name) for name, case in cases.items()}


@pytest.mark.extended
def test_every_check_that_runs_on_cpu_passes_and_the_others_say_why():
  results = {r.name: r for r in verify.run_all(interpret=True)}
  assert set(results) == set(verify.CHECKS)
  for name in ("grouped_forward", "sampler_bfloat16", "sampler_int8", "chunked_logprobs"):
    assert results[name].status == "pass", results[name]
    assert 0 <= results[name].error <= results[name].tolerance
  for name in ("grouped_input_grad", "grouped_weight_grad"):
    assert results[name].status == "skip" and "interpreter" in results[name].note
  assert results["cudnn_attention"].status == "skip" and "GPU" in results["cudnn_attention"].note
  table = verify.table(list(results.values()))
  assert table.count("\n") == len(results) + 1 and "| grouped_forward | pass |" in table


def test_without_the_interpreter_the_kernels_do_not_run_on_cpu():
  result = verify.run_check("grouped_forward")
  assert result.status == "skip" and "Hopper" in result.note


def test_a_failing_check_is_not_chosen_and_says_so_once(caplog):
  # chunked log-probs at τ = 0.7 against the reference at τ = 1.0: a real mismatch.
  wrong = functools.partial(fast_paths._chunked_case, 0.7, 1.0)
  checks = _checks(wrong_temperature=wrong)
  result = verify.run_check("wrong_temperature", checks)
  assert result.status == "fail" and result.error > 1e-2
  with caplog.at_level(logging.WARNING):
    assert verify.choose("wrong_temperature", "fast", "slow", checks) == "slow"
    assert verify.choose("wrong_temperature", "fast", "slow", checks) == "slow"  # cached
  lines = [r.getMessage() for r in caplog.records if "not verified" in r.getMessage()]
  assert len(lines) == 1 and "wrong_temperature: fail" in lines[0], lines


def test_a_check_that_raises_is_not_chosen():
  def broken():
    raise RuntimeError("kernel failed to compile")

  checks = _checks(broken=broken)
  result = verify.run_check("broken", checks)
  assert result.status == "error" and "kernel failed to compile" in result.note
  assert verify.choose("broken", "fast", "slow", checks) == "slow"


def test_a_passing_check_runs_once_and_eagerly_while_a_program_is_traced():
  calls = []

  def counted():
    calls.append(1)
    return fast_paths._chunked_case()

  checks = _checks(counted=counted)

  @jax.jit
  def program(x):  # `auto` settings are resolved while the model is traced
    return x * (verify.choose("counted", "fast", "slow", checks) == "fast")

  assert float(program(jnp.ones(()))) == 1.0
  assert verify.choose("counted", "fast", "slow", checks) == "fast"
  assert len(calls) == 1


def test_auto_never_chooses_an_unverified_path_here():
  assert moe.resolve_impl("auto", jax.devices()[0]) == "portable"
  assert not verify.verified("a_path_with_no_registered_check")
  assert all(path in verify.FAST_PATHS for path, _, _ in verify.VERIFIED)
  assert all(kind != jax.devices()[0].device_kind for _, kind, _ in verify.VERIFIED)


@pytest.mark.extended
def test_the_device_check_tool_prints_the_table_and_writes_json(tmp_path, capsys):
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools"))
  import device_check

  path = tmp_path / "checks.json"
  assert device_check.main(["--interpret", f"--json={path}"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("device: ") and f"jax {jax.__version__}" in out
  record = json.loads(path.read_text())
  assert record["jax"] == jax.__version__
  assert {r["name"]: r["status"] for r in record["results"]}["chunked_logprobs"] == "pass"


@pytest.mark.gpu
def test_every_fast_path_that_runs_on_this_accelerator_passes():
  results = verify.run_all()
  assert not [r for r in results if r.status in ("fail", "error")], verify.table(results)
  assert any(r.status == "pass" for r in results), verify.table(results)  # not all skipped
