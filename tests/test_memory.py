"""Ahead-of-time compilation from abstract state (tools/memory_table.py)."""

from __future__ import annotations

import sys

import jax
from conftest import REPO, tiny_config

from jaxrl_llm import train
from jaxrl_llm.rl import init_reference

sys.path.insert(0, str(REPO / "tools"))
import memory_table


def test_abstract_state_matches_the_real_one_and_allocates_nothing():
  config = tiny_config(**{"kl.beta": 0.04})
  real = train.build(config)
  abstract = train.build(config, abstract=True)
  leaves = jax.tree.leaves(abstract.state)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  real_state = init_reference(real.state, config.kl.beta)
  shape = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), t)  # noqa: E731
  assert shape(abstract.state) == shape(real_state)


def test_the_fused_step_compiles_from_abstract_state_and_reports_memory():
  result = memory_table.compiled_memory(tiny_config())
  assert result["temp_gib"] > 0 and result["argument_gib"] > 0
  assert result["peak_estimate_gib"] >= result["temp_gib"]
