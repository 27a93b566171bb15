"""The whole fused step compiled ahead of time for a TPU slice (v5e 2x2) on a CPU machine.

Needs libtpu (`pip install -e '.[tpu]'`), which gives TPU devices to compile for through
`jax.experimental.topologies`; nothing runs on a TPU and nothing is allocated.
"""

import os

import jax
import pytest
from conftest import tiny_config

# pytest-xdist workers may each load libtpu for a topology; none claims a chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

pytest.importorskip(
  "libtpu", reason="compiling for a TPU topology needs libtpu: pip install -e '.[tpu]'"
)

import parsed
from parsed import build

from jaxrl_llm import hlo, plan, sampling
from jaxrl_llm.run import abstract_batch

CONFIG = {"rl.num_prompts": 8, "mesh.data": 1, "mesh.fsdp": -1}


@pytest.fixture(scope="module")
def v5e_2x2():
  return plan.tpu_slice_devices("v5e:2x2")


@pytest.mark.extended
def test_fused_step_fits_a_v5e_chip(v5e_2x2):
  assert len(v5e_2x2) == 4 and v5e_2x2[0].platform == "tpu"
  p = parsed.plan(tiny_config(**CONFIG), v5e_2x2)
  assert p.mesh["fsdp"] == 4 and p.num_devices == 4
  assert p.device_kind.startswith("TPU v5")
  assert p.capacity_bytes == 16 * plan.GIB  # the chip's HBM, from the spec table
  # (A program this small may need no temp buffer at all on a TPU.)
  assert p.argument_bytes > 0 and 0 < p.peak_bytes <= p.capacity_bytes and p.fits


@pytest.mark.extended
def test_tpu_decode_loop_gathers_no_weights(v5e_2x2):
  exp = build(tiny_config(**CONFIG), abstract=True, devices=v5e_2x2)
  text = (
    exp.program.step.lower(exp.state, abstract_batch(exp), jax.random.PRNGKey(0))
    .compile()
    .as_text()
  )
  loop = hlo.loop_instructions(text, sampling.DECODE_SCOPE)
  assert len(loop) > 50
  assert hlo.collectives(loop, "all-gather") == []


MOE = {
  "model.moe_num_experts": 8,
  "model.moe_top_k": 2,
  "model.moe_expert_mlp_dim": 32,
  "replay.name": "r3",
  "model.moe_impl": "auto",
}


@pytest.mark.parametrize(
  "mesh",
  [pytest.param(m, marks=pytest.mark.extended) for m in ({"mesh.expert": 4, "mesh.fsdp": 1}, {})],
  ids=["expert4", "fsdp4"],
)
def test_moe_step_compiles_for_a_v5e_slice(v5e_2x2, mesh):
  """The MoE fused step (R3) for v5e 2x2: `auto` takes `jax.lax.ragged_dot` (a grouped kernel
  on TPU) and, with experts over 4 chips, dispatches tokens by all-to-all."""
  config = tiny_config(**{**CONFIG, **MOE, **mesh})
  exp = build(config, abstract=True, devices=v5e_2x2)
  lowered = exp.program.step.lower(exp.state, abstract_batch(exp), jax.random.PRNGKey(0))
  assert "ragged_dot" in lowered.as_text()  # the TPU grouped matmul, not the portable tiles
  compiled = lowered.compile()
  everything = [i for insts in hlo.computations(compiled.as_text()).values() for i in insts]
  dispatch = [i for i in hlo.collectives(everything, "all-to-all") if "moe" in i.op_name]
  assert bool(dispatch) == ("mesh.expert" in mesh)
  p = parsed.plan(config, v5e_2x2)
  assert p.fits and p.argument_bytes > 0


def test_a_program_past_the_hbm_is_refused_by_the_tpu_compiler_and_reported(v5e_2x2):
  """A step whose temporaries exceed a v5e chip's HBM (a 262,144-token untied vocabulary,
  replicated on 4 chips): the TPU compiler refuses it, and the plan reports that as does not
  fit, with the compiler's own message and its temporaries figure as the temp (README: the
  memory table's refused rows)."""
  big = {"model.d_model": 2048, "model.num_heads": 16, "model.num_kv_heads": 8}
  big |= {"model.vocab_size": 262144, "model.tie_embeddings": False, "model.num_layers": 1}
  p = parsed.plan(tiny_config(**{**CONFIG, **big, "mesh.data": 4, "mesh.fsdp": 1}), v5e_2x2)
  assert p.refused.startswith("Ran out of memory on HBM") and "exceeds available HBM" in p.refused
  figure = float(p.refused.split("temporaries (")[1].split("G)")[0])
  assert p.temp_bytes == int(figure * plan.GIB) and p.temp_bytes > p.capacity_bytes
  assert p.fits is False and p.argument_bytes > 0
  assert "does NOT fit (the compiler: Ran out of memory on HBM" in p.summary()
