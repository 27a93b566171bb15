"""RL starting from an imported Hugging Face checkpoint (`model.checkpoint`), then export."""

import dataclasses
import json
import shutil
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, tiny_config
from flax import traverse_util
from parsed import build, train_and_evaluate
from safetensors.numpy import load_file, save_file

from jaxrl_llm import checkpoint, metrics
from jaxrl_llm.models import hf, hf_export, lora

FIXTURE = REPO / "tests" / "fixtures" / "hf" / "qwen2"


def test_rl_starts_from_imported_checkpoint_and_exports(tmp_path):
  config = tiny_config(
    **{"model.checkpoint": str(FIXTURE), "train.num_steps": 2, "sft.steps": 3, "sft.batch_size": 8}
  )
  exp = build(config)
  cfg, params = hf.load_checkpoint(FIXTURE)
  assert exp.model.cfg == cfg  # the checkpoint's architecture, not config.model's
  jax.tree.map(
    np.testing.assert_array_equal, jax.device_get(exp.state.params), jax.device_get(params)
  )

  workdir = tmp_path / "run"
  train_and_evaluate(config, str(workdir))
  assert metrics.read_scalars(str(workdir))["policy/loss"][-1][0] == 2
  meta = checkpoint.Checkpointer(str(workdir), save_every=1).read_meta(2)
  assert meta["hf_model_type"] == "qwen2" and meta["model"]["attention_bias"] is True

  # The trained policy exports back to the Hugging Face format and re-imports exactly.
  ckpt = checkpoint.Checkpointer(str(workdir), save_every=1)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), exp.state)
  state, _ = ckpt.restore(2, abstract)
  out = tmp_path / "hf_out"
  hf_export.save_checkpoint(out, exp.model.cfg, state.params, model_type="qwen2")
  assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
  cfg2, params2 = hf.load_checkpoint(out)
  assert cfg2 == exp.model.cfg
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params2), jax.device_get(state.params))
  assert not all(
    np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(jax.device_get(params2)), jax.tree.leaves(jax.device_get(params))
    )
  )  # the warm start and RL changed the weights


@pytest.mark.extended
def test_adapters_train_on_an_imported_checkpoint_that_stays_as_it_was(tmp_path):
  """`model.lora_rank` on a Hugging Face base: the run starts from the checkpoint's weights
  with fresh adapters (the adapted model is the checkpoint's at step 0), trains the adapters
  alone through the warm start and RL, and the checkpoint's weights come out bit-identical.
  Its checkpoints hold the adapters alone and name the base (path and digest); a resume onto
  changed base weights is refused, and the export merges the adapters into the base."""
  source = tmp_path / "qwen2"
  shutil.copytree(FIXTURE, source)
  overrides = {"model.checkpoint": str(source), "train.num_steps": 2, "sft.steps": 3}
  overrides |= {"sft.batch_size": 8, "model.lora_rank": 4, "rl.entropy_coef": 0.01}
  config = tiny_config(**overrides)
  exp = build(config)
  cfg, params = hf.load_checkpoint(source)
  assert exp.model.cfg.lora_rank == 4 and exp.model.cfg == dataclasses.replace(cfg, lora_rank=4)
  base, adapters = lora.split_adapters(jax.device_get(exp.state.params))
  jax.tree.map(np.testing.assert_array_equal, base, jax.device_get(params))
  flat = traverse_util.flatten_dict(adapters)
  assert all(not np.any(v) for k, v in flat.items() if k[-1] == "lora_b")  # B = 0: the base

  workdir = tmp_path / "run"
  train_and_evaluate(config, str(workdir))
  ckpt = checkpoint.Checkpointer(str(workdir), save_every=1)
  meta = ckpt.read_meta(2)
  assert meta["base"] == {"checkpoint": str(source), "digest": hf.weights_digest(source)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), exp.stored(exp.state))
  stored, _ = ckpt.restore(2, abstract)
  ckpt.close()
  assert not lora.split_adapters(stored.params)[0]  # the adapters alone: no base in the checkpoint
  state = exp.from_stored(stored)
  trained_base, trained = lora.split_adapters(jax.device_get(state.params))
  jax.tree.map(np.testing.assert_array_equal, trained_base, jax.device_get(params))
  changed = [
    not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(adapters))
  ]
  assert all(changed), "every adapter matrix trained"

  sys.path.insert(0, str(REPO / "tools"))
  import hf_convert

  hf_convert.main(["export", f"--workdir={workdir}", f"--out={tmp_path / 'merged'}"])
  merged = lora.merged(jax.device_get(state.params), cfg.lora_alpha / 4)
  jax.tree.map(np.testing.assert_allclose, hf.load_checkpoint(tmp_path / "merged")[1], merged)

  weights = source / "model.safetensors"  # the base changes under the run
  tensors = load_file(weights)
  name = sorted(tensors)[0]
  tensors[name] = tensors[name] + 1
  save_file(tensors, weights)
  longer = tiny_config(**overrides | {"train.num_steps": 3})
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"base\.digest"):
    train_and_evaluate(longer, str(workdir))


def test_the_configs_expert_settings_apply_to_a_moe_checkpoint():
  """With `model.checkpoint`, the architecture is the checkpoint's, but how experts are
  computed (`model.moe_impl`) and the §8 weights the config sets are the run's (they were
  silently replaced by the checkpoint's); unset weights keep the checkpoint's own."""
  moe = REPO / "tests" / "fixtures" / "hf" / "qwen3_moe"
  imported = hf.load_checkpoint(moe)[0]
  base = {"model.checkpoint": str(moe)}
  run = {"model.moe_impl": "dense", "model.moe_aux_loss_coef": 0.3, "model.moe_z_loss_coef": 0.5}
  mc = build(tiny_config(**base, **run), abstract=True).model.cfg
  assert (mc.moe_impl, mc.moe_aux_loss_coef, mc.moe_z_loss_coef) == ("dense", 0.3, 0.5)
  assert mc.moe_num_experts == imported.moe_num_experts == 4  # the architecture stays
  mc = build(tiny_config(**base), abstract=True).model.cfg
  assert mc.moe_impl == "auto" and mc.moe_aux_loss_coef == imported.moe_aux_loss_coef
  assert mc.moe_z_loss_coef == imported.moe_z_loss_coef


def test_a_lora_rank_is_bounded_by_the_checkpoints_projections_not_the_placeholders():
  """With `model.checkpoint`, the config's own architecture is a placeholder: a rank over its
  narrow projections but within the checkpoint's (k: 16 wide) builds, and a rank over the
  checkpoint's is one error naming the checkpoint's width and the checkpoint."""
  from jaxrl_llm.config import ConfigError, parse

  narrow = {"model.d_model": 8, "model.mlp_dim": 16}  # the placeholder's k: 8 wide
  with pytest.raises(ConfigError, match=r"narrower side is 8; allowed: 1\.\.8"):
    parse(tiny_config(**narrow, **{"model.lora_rank": 12}))  # no checkpoint: its own widths
  base = {"model.checkpoint": str(FIXTURE), "kl.reference": "frozen", **narrow}
  mc = build(tiny_config(**base, **{"model.lora_rank": 12}), abstract=True).model.cfg
  assert mc.lora_rank == 12 and mc.d_model == 32
  with pytest.raises(ConfigError) as e:
    build(tiny_config(**base, **{"model.lora_rank": 17}), abstract=True)
  line = str(e.value)
  assert "model.lora_rank=17 is larger than projection 'k', whose narrower side is 16" in line
  assert "allowed: 1..16" in line and str(FIXTURE) in line and "\n" not in line


def test_a_mesh_rule_the_checkpoints_shapes_refuse_is_one_line_before_its_weights_load():
  """`model.checkpoint` with a mesh rule that splits the checkpoint's 2 key-value heads over 4
  devices: the config check's one line (the weights were loaded first, into that sharding,
  and JAX's IndivisibleError came out of the load)."""
  from jaxrl_llm.config import ConfigError

  config = tiny_config(
    **{"model.checkpoint": str(FIXTURE), "mesh.model": 4, "mesh.rules": (("kv_heads", "model"),)}
  )
  with pytest.raises(ConfigError) as err:
    build(config)
  assert "\n" not in str(err.value)
  assert "mesh.rules maps kv_heads to mesh.model=4, which does not divide model.num_kv_heads=2" in (
    str(err.value)
  )
