"""Ahead-of-time compilation from abstract state (`plan`, `--dry_run`, tools/memory_table.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, cli_env, tiny_config

from jaxrl_llm.config import parse
from jaxrl_llm.rl import init_reference

sys.path.insert(0, str(REPO / "tools"))
import memory_table
import parsed
from parsed import build


def test_abstract_state_matches_the_real_one_and_allocates_nothing():
  config = tiny_config(**{"kl.beta": 0.04})
  real = build(config)
  abstract = build(config, abstract=True)
  leaves = jax.tree.leaves(abstract.state)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  real_state = init_reference(real.state, config.kl.beta)
  shape = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), t)  # noqa: E731
  assert shape(abstract.state) == shape(real_state)


@pytest.mark.slow
def test_the_fused_step_compiles_from_abstract_state_and_reports_memory():
  p = parsed.plan(tiny_config())
  assert p.temp_bytes > 0 and p.argument_bytes > 0
  assert p.peak_bytes >= p.temp_bytes
  assert p.capacity_bytes and p.capacity_bytes > 2**30  # the host's memory on a CPU
  assert p.fits is True
  assert "fits in" in p.summary() and "1 x cpu (one device)" in p.summary()


def test_the_evaluation_plan_is_the_evaluation_a_run_compiles(capsys):
  """`--dry_run` plans the held-out evaluation beside the step (an evaluation too large for
  memory passed the dry run, then ran out of memory in the run): from shapes alone, the same
  program and bytes as the evaluation compiled from a built run's arrays, growing with
  train.pass_k while the step's plan stays; a line each, exit 3 when only it does not fit."""
  from jaxrl_llm import plan as plan_lib
  from jaxrl_llm import sharding
  from jaxrl_llm.run.assemble import to_global_batch

  config = tiny_config(**{"train.pass_k": 8})
  few = parsed.plan(config, jax.devices()[:1], evaluation=True)
  exp = build(config)
  rows, _ = exp.task.eval_set(multiple_of=sharding.batch_size_divisor(exp.mesh))
  batch = to_global_batch(rows, exp.batch_sharding)
  real = exp.eval_fn.lower(exp.state.params, batch, jax.random.PRNGKey(0)).compile()
  m, planned = real.memory_analysis(), few.evaluation
  assert (planned.temp_bytes, planned.argument_bytes) == (
    m.temp_size_in_bytes,
    m.argument_size_in_bytes,
  )
  state = init_reference(exp.state, config.kl.beta)
  assert planned.resident_bytes == plan_lib.shard_bytes(state) - plan_lib.shard_bytes(state.params)
  assert planned.summary().startswith(
    f"the held-out evaluation ({len(rows['tokens'])} prompts: greedy, and 8 samples each) needs "
  )
  many = parsed.plan(tiny_config(**{"train.pass_k": 64}), jax.devices()[:1], evaluation=True)
  assert many.evaluation.temp_bytes > 4 * planned.temp_bytes
  assert many.temp_bytes == few.temp_bytes  # pass_k leaves the step as it was
  between = planned.peak_bytes + (many.evaluation.peak_bytes - planned.peak_bytes) // 2
  tight = dataclasses.replace(many, capacity_bytes=between)
  tight = dataclasses.replace(
    tight, evaluation=dataclasses.replace(many.evaluation, capacity_bytes=between)
  )
  assert plan_lib.print_dry_run(tight) == 3 and plan_lib.print_dry_run(few) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [line.split(" needs ")[0] for line in lines[:2]] == [
    "dry run: the fused step",
    f"dry run: the held-out evaluation ({len(rows['tokens'])} prompts: greedy, and 64 samples each)",
  ]
  assert "fits in" in lines[0] and "does NOT fit in" in lines[1], lines


@pytest.mark.slow
def test_a_host_verifier_task_plans_its_sample_and_learn_programs(tmp_path):
  """Prompt files score on the host between two programs: the plan (`--dry_run`,
  `rl.microbatch_tokens=auto`) compiles both, the learner's inputs the sampler's outputs with
  the task's reward terms, and reports the larger peak, for one run and a pack."""
  from text_fixtures import math_file_run

  from jaxrl_llm.data import file_task

  overrides, _ = math_file_run(tmp_path)
  config = tiny_config(**overrides)
  task = file_task.build_file_task(parse(config), "")
  terms, _ = task.host_reward_terms(np.zeros((2, 4), np.int32), ["1", "2"])
  assert set(task.host_term_names) == set(terms) and "correct" in terms
  one = parsed.plan(config)
  assert one.host_rewards and one.temp_bytes > 0 and one.fits is True
  assert one.summary().startswith("the larger of the sample and learn programs needs ")
  two = parsed.plan(config, runs=2, varied=["objective.clip_high"])
  assert two.argument_bytes > one.argument_bytes and "of a pack of 2 runs" in two.summary()


@pytest.mark.slow
def test_fsdp_plan_holds_an_eighth_of_the_state_per_device():
  one = parsed.plan(tiny_config(**{"rl.num_prompts": 8}), jax.devices()[:1])
  eight = parsed.plan(tiny_config(**{"rl.num_prompts": 8, "mesh.data": 1, "mesh.fsdp": 8}))
  assert eight.mesh == {"runs": 1, "data": 1, "fsdp": 8, "expert": 1, "model": 1}
  # Params and Adam moments dominate the arguments; only scalars stay replicated.
  assert eight.argument_bytes < one.argument_bytes / 6


@pytest.mark.extended
@pytest.mark.parametrize(
  "flags, code, says",
  [(["--device_memory_gib=0.001"], 3, "does NOT fit in 1.0 MiB per device"),
   (["--device_memory_gib=64"], 0, "fits in 64.0 GiB per device"),
   (["--device_memory_gib=1", "--config.train.pass_k=4096"], 3,
    "4096 samples each) needs 17.0 GiB per device"),
   (["--config.sampling.temperature=-1"], 2, "sampling.temperature=-1.0 must be >= 0.01")],
  ids=["does-not-fit", "fits", "evaluation-does-not-fit", "bad-config"],
)  # fmt: skip
def test_dry_run_says_in_one_line_whether_a_config_fits(flags, code, says):
  """`--dry_run`: a line for the step and one for the evaluation, exit 3 (one does not fit) or 0
  (both fit); or one line on stderr and exit 2 (a bad config)."""
  cmd = [sys.executable, "-m", "jaxrl_llm.main", "--config=configs/default.py", "--dry_run"]
  env = cli_env()
  proc = subprocess.run(
    [*cmd, *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == code, proc.stderr[-2000:]
  lines = (proc.stderr if code == 2 else proc.stdout).strip().splitlines()
  assert len(lines) == (1 if code == 2 else 2), lines
  if code != 2:
    assert lines[0].startswith("dry run: the fused step needs ")
    assert lines[1].startswith("dry run: the held-out evaluation (256 prompts: greedy, and ")
  assert says in " ".join(lines), lines


def test_memory_table_targets_parse_and_bad_ones_are_named():
  assert memory_table.parse_target("cpu:8:fsdp=4:model=2") == (
    "cpu",
    "8",
    {"data": 1, "fsdp": 4, "model": 2},
  )
  assert memory_table.parse_target("tpu:v5e-8") == ("tpu", "v5e-8", {"data": 1, "fsdp": -1})
  with pytest.raises(ValueError, match="'fsdp' is not AXIS=SIZE"):
    memory_table.parse_target("cpu:8:fsdp")
  assert memory_table.parse_target("gpu:1") == ("gpu", "1", {"data": 1, "fsdp": -1})
  with pytest.raises(ValueError, match="starts with cpu:, gpu: or tpu:"):
    memory_table.parse_target("tpx:8")


def test_a_gpu_target_without_a_gpu_is_a_skipped_row_naming_what_is_missing():
  if any(d.platform == "gpu" for d in jax.local_devices()):
    pytest.skip("this machine has a GPU: the row would be planned")
  row = memory_table.row("dense-e64-twin", "gpu:1", [], 0, 0, 80.0)
  assert row["skipped"] == "gpu:1 needs 1 GPUs; this process has 0"


@pytest.mark.slow
def test_memory_table_plans_each_form_of_the_guard_and_restores_the_platforms_own():
  """`--guard=held,twice`: a row per form, each naming it; the guard's choice by platform is as
  it was afterwards (a form is set only while its row compiles)."""
  from jaxrl_llm import optim

  own = optim.RECOMPUTE_ON
  small = ["model.num_layers=1", "model.vocab_size=1024", "sampling.max_new_tokens=16"]
  rows = [
    memory_table.row("dense-e64-twin", "cpu:1", small, 0, 0, 80.0, guard=g)
    for g in ("held", "twice")
  ]
  assert optim.RECOMPUTE_ON == own
  assert [r["guard"] for r in rows] == ["held", "twice"] and all(r["temp_gib"] > 0 for r in rows)
  assert "update twice" in memory_table.markdown(rows).splitlines()[-1]


def test_memory_table_help_lists_the_shapes_and_the_target_syntax(capsys):
  with pytest.raises(SystemExit):
    memory_table.main(["--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert all(name in out for name in memory_table.SHAPES)
  assert "cpu:N[:AXIS=K...]" in out and "tpu:SLICE[:AXIS=K...]" in out
