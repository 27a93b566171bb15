"""Hugging Face import/export against reference outputs of the transformers implementation.

The fixtures under tests/fixtures/hf/ were written by tools/make_hf_fixtures.py (which needs
torch and transformers; these tests need neither): tiny random checkpoints of every supported
architecture with the transformers model's logits and greedy continuation on a left-padded batch.
"""

import dataclasses
import functools
import json
import pathlib
import re
import shutil
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxrl_llm import sharding
from jaxrl_llm.models import hf
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import Transformer, positions_from_mask
from jaxrl_llm.sampling import SamplingConfig, sample

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
NAMES = sorted(MANIFEST["fixtures"])
TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


@functools.cache
def _load(name: str, param_dtype: str | None = None):
  return hf.load_checkpoint(FIXTURES / name, param_dtype=param_dtype)


@functools.cache
def _reference(name: str):
  return dict(np.load(FIXTURES / name / "reference.npz"))


def _logits(cfg, params, ref):
  tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask"])
  out = Transformer(cfg).apply({"params": params}, tokens, positions_from_mask(mask), mask)
  return np.where(ref["mask"][..., None], np.asarray(out.logits), 0.0)


def _copy(name: str, tmp_path) -> pathlib.Path:
  dst = tmp_path / name
  shutil.copytree(FIXTURES / name, dst)
  return dst


def _edit_config(path: pathlib.Path, **changes) -> None:
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(changes)
  (path / "config.json").write_text(json.dumps(cfg))


def test_fixtures_cover_every_model_type_and_stay_small():
  types = {f["model_type"] for f in MANIFEST["fixtures"].values()}
  assert types == set(hf.MODEL_TYPES)
  assert MANIFEST["transformers_version"]
  size = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
  assert size < 2_000_000


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
  cfg, params = _load(name)
  ref = _reference(name)
  np.testing.assert_allclose(_logits(cfg, params, ref), ref["logits"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decode_with_cache_matches_generate(name):
  cfg, params = _load(name)
  ref = _reference(name)
  greedy = SamplingConfig(max_new_tokens=ref["greedy"].shape[1], greedy=True, eos_id=-1)
  tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask"])
  rollout = jax.jit(lambda p: sample(Transformer(cfg), p, tokens, mask, jax.random.key(0), greedy))(
    params
  )
  np.testing.assert_array_equal(np.asarray(rollout.tokens), ref["greedy"])


def test_configs_map_every_feature():
  cfgs = {name: _load(name)[0] for name in NAMES}
  assert cfgs["llama"].rope_theta == 5e5 and not cfgs["llama"].tie_embeddings
  llama3 = cfgs["llama3_rope_bf16"]
  assert (llama3.rope_scaling, llama3.rope_scaling_factor, llama3.rope_original_max_len) == (
    "llama3",
    8.0,
    256,
  )
  assert llama3.tie_embeddings and llama3.param_dtype == "float32"
  assert cfgs["qwen2"].attention_bias and not cfgs["qwen2"].qk_norm
  assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 16 != cfgs["qwen3"].d_model // 4
  moe = cfgs["qwen3_moe"]
  assert (moe.moe_num_experts, moe.moe_top_k, moe.moe_expert_mlp_dim, moe.moe_every) == (
    4,
    2,
    16,
    1,
  )
  assert moe.moe_normalize_gates and moe.moe_aux_loss_coef == pytest.approx(0.002)
  mixed = cfgs["qwen3_moe_mixed"]
  assert mixed.moe_layers == (1,) and not mixed.moe_normalize_gates and mixed.mlp_dim == 64
  mixtral = cfgs["mixtral"]
  assert (mixtral.rope_theta, mixtral.norm_eps, mixtral.moe_expert_mlp_dim) == (1e6, 1e-5, 64)
  assert mixtral.moe_normalize_gates and mixtral.moe_layers == (0, 1)


def _assert_trees_equal(a, b):
  fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
  assert [p for p, _ in fa] == [p for p, _ in fb]
  for (path, x), (_, y) in zip(fa, fb):
    assert x.dtype == y.dtype and x.shape == y.shape, path
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.mark.parametrize("name", NAMES)
def test_export_import_round_trip_is_bit_exact(name, tmp_path):
  bf16 = MANIFEST["fixtures"][name]["dtype"] == "bfloat16"
  cfg, params = _load(name, "bfloat16" if bf16 else None)
  model_type = MANIFEST["fixtures"][name]["model_type"]
  out = tmp_path / "export"
  hf.save_checkpoint(
    out, cfg, params, model_type=model_type, dtype=cfg.param_dtype, max_shard_bytes=50_000
  )
  cfg2, params2 = hf.load_checkpoint(out)
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)
  # The exported tensors are the original ones, bit for bit, under the same names.
  original, exported = {}, {}
  for src, dst in ((FIXTURES / name, original), (out, exported)):
    for f in sorted(src.glob("*.safetensors")):
      dst.update(load_file(f) if not bf16 else _raw_u16(f))
  assert sorted(original) == sorted(exported)
  for key, value in original.items():
    assert value.dtype == exported[key].dtype, key
    np.testing.assert_array_equal(value, exported[key], err_msg=key)
  hf_cfg = json.loads((out / "config.json").read_text())
  src_cfg = json.loads((FIXTURES / name / "config.json").read_text())
  for key in ("model_type", "hidden_size", "num_key_value_heads", "tie_word_embeddings"):
    assert hf_cfg[key] == src_cfg[key], key
  assert (out / hf.INDEX_FILE).exists() == (len(list(out.glob("*.safetensors"))) > 1)


def _raw_u16(path) -> dict[str, np.ndarray]:
  """bfloat16 tensors of a safetensors file as their raw uint16 bits."""
  import struct

  data = path.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  header = json.loads(data[8 : 8 + n])
  out = {}
  for key, info in header.items():
    if key != "__metadata__":
      begin, end = info["data_offsets"]
      out[key] = np.frombuffer(data[8 + n + begin : 8 + n + end], "<u2").reshape(info["shape"])
  return out


def test_round_trip_keeps_fields_hf_cannot_name(tmp_path):
  cfg = ModelConfig(
    vocab_size=48,
    d_model=24,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=6,
    mlp_dim=40,
    qk_norm=True,
    tie_embeddings=False,
    moe_num_experts=5,
    moe_top_k=3,
    moe_expert_mlp_dim=12,
    moe_every=3,
    moe_normalize_gates=False,
    moe_impl="dense",
    moe_aux_loss_coef=0.07,
    moe_z_loss_coef=0.3,
    dtype="bfloat16",
    param_dtype="bfloat16",
    rope_scaling="linear",
    rope_scaling_factor=2.5,
  )
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), nn.unbox(hf.abstract_params(cfg))
  )
  hf.save_checkpoint(tmp_path, cfg, params, dtype="bfloat16", max_shard_bytes=4096)
  assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"
  assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
  cfg2, params2 = hf.load_checkpoint(tmp_path)
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    hf.save_checkpoint(tmp_path, cfg, params, dtype="bfloat16")
  hf.save_checkpoint(tmp_path, cfg, params, dtype="bfloat16", overwrite=True)
  assert not list(tmp_path.glob("model-*-of-*.safetensors"))
  _assert_trees_equal(hf.load_checkpoint(tmp_path)[1], params)


def test_load_onto_mesh_places_each_param_in_its_sharding():
  mesh = sharding.make_mesh(data=2, model=2, expert=2)
  cfg, params = hf.load_checkpoint(FIXTURES / "qwen3_moe", mesh=mesh)
  expected = sharding.param_shardings(hf.abstract_params(cfg), mesh, sharding.DEFAULT_RULES)
  for (path, x), s in zip(
    jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(expected)
  ):
    assert x.sharding.is_equivalent_to(s, x.ndim), path
  layer = params["layer_0"]
  assert layer["attn"]["q"]["kernel"].sharding.spec == P(("fsdp", "expert"), "model", None)
  assert layer["moe"]["gate"].sharding.spec == P("expert", "fsdp", "model")
  assert layer["moe"]["router"]["kernel"].sharding.spec == P(("fsdp", "expert"), None)
  assert params["embed"]["embedding"].sharding.spec == P("model", ("fsdp", "expert"))
  shard = layer["moe"]["down"].addressable_shards[0].data
  assert shard.shape == (4 // 2, 16 // 2, 32)  # [E/expert, F/model, D]
  _assert_trees_equal(jax.device_get(params), jax.device_get(_load("qwen3_moe")[1]))
  ref = _reference("qwen3_moe")
  logits = jax.jit(lambda p: _logits_jax(cfg, p, ref))(params)
  np.testing.assert_allclose(
    np.where(ref["mask"][..., None], logits, 0.0), ref["logits"], rtol=0, atol=1e-4
  )


def _logits_jax(cfg, params, ref):
  tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask"])
  return Transformer(cfg).apply({"params": params}, tokens, positions_from_mask(mask), mask).logits


# ----------------------------------------------------------------------------- malformed input


def test_missing_tensor_is_named_with_its_file(tmp_path):
  path = _copy("qwen2", tmp_path)
  tensors = load_file(path / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointFormatError) as e:
    hf.load_checkpoint(path)
  assert "model.safetensors: missing tensor 'model.layers.1.mlp.up_proj.weight'" in str(e.value)


def test_non_float_tensor_is_named_with_its_file(tmp_path):
  path = _copy("qwen2", tmp_path)
  tensors = load_file(path / "model.safetensors")
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.CheckpointFormatError, match=r"model\.safetensors: tensor 'model\.norm\."):
    hf.load_checkpoint(path)
  with pytest.raises(hf.CheckpointFormatError, match="has dtype I32; expected a floating-point"):
    hf.load_checkpoint(path)


def test_unexpected_tensor_is_named(tmp_path):
  path = _copy("qwen2", tmp_path)
  tensors = load_file(path / "model.safetensors")
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(
    hf.CheckpointFormatError,
    match=re.escape("unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"),
  ):
    hf.load_checkpoint(path)


def test_tied_lm_head_copy_and_rope_buffers_are_ignored(tmp_path):
  path = _copy("qwen2", tmp_path)
  tensors = load_file(path / "model.safetensors")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  _assert_trees_equal(hf.load_checkpoint(path)[1], _load("qwen2")[1])


def test_config_that_does_not_match_the_weights(tmp_path):
  path = _copy("llama", tmp_path)
  _edit_config(path, hidden_size=48)
  with pytest.raises(hf.CheckpointFormatError) as e:
    hf.load_checkpoint(path)
  msg = str(e.value)
  assert "config.json does not match the weights' shapes" in msg
  assert (
    "model-00001-of-00003.safetensors: tensor 'model.embed_tokens.weight' has shape [64, 32]" in msg
  )
  assert "(vocab_size=64, hidden_size=48) implies [64, 48]" in msg


def test_too_few_layers_in_config_reports_unexpected_tensors(tmp_path):
  path = _copy("qwen3", tmp_path)
  _edit_config(path, num_hidden_layers=1)
  with pytest.raises(
    hf.CheckpointFormatError, match=re.escape("unexpected tensor 'model.layers.1.")
  ):
    hf.load_checkpoint(path)


def test_bad_model_type_lists_the_supported_ones(tmp_path):
  path = _copy("qwen2", tmp_path)
  _edit_config(path, model_type="gpt2")
  with pytest.raises(hf.CheckpointFormatError) as e:
    hf.load_checkpoint(path)
  assert "config.json: model_type='gpt2' is not supported" in str(e.value)
  assert "'qwen3_moe'" in str(e.value) and "'mixtral'" in str(e.value)


def test_missing_config_and_weights(tmp_path):
  path = _copy("qwen2", tmp_path)
  (path / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match=r"config\.json"):
    hf.load_checkpoint(path)
  path = _copy("llama", tmp_path / "b")
  (path / "model-00002-of-00003.safetensors").unlink()
  with pytest.raises(
    FileNotFoundError, match=r"index\.json lists weight file model-00002-of-00003"
  ):
    hf.load_checkpoint(path)
  (path / hf.INDEX_FILE).unlink()
  with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor"):
    hf.load_checkpoint(path)


def _hf_config(**changes):
  base = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
  base.update(changes)
  return base


@pytest.mark.parametrize(
  "changes, field",
  [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type='yarn'"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"model_type": "mixtral", "sliding_window": 4096}, "sliding_window=4096"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"num_hidden_layers": 4, "mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
  ],
)
def test_unsupported_features_name_the_field(changes, field):
  with pytest.raises(hf.CheckpointFormatError, match="unsupported") as e:
    hf.config_from_hf(_hf_config(**changes), source="x/config.json")
  assert field in str(e.value) and str(e.value).startswith("x/config.json")


def test_older_config_spellings_and_sparse_step():
  v4 = _hf_config(decoder_sparse_step=2, num_hidden_layers=4, rope_theta=1e6, num_experts=8)
  del v4["rope_parameters"], v4["num_local_experts"]
  cfg = hf.config_from_hf(v4)
  assert (cfg.moe_layers, cfg.moe_num_experts, cfg.rope_theta) == ((1, 3), 8, 1e6)
  assert cfg.mlp_dim == 64 and cfg.moe_expert_mlp_dim == 16
  llama = json.loads((FIXTURES / "llama" / "config.json").read_text())
  del llama["rope_parameters"]
  llama["rope_scaling"] = {"type": "linear", "factor": 2.0}
  cfg = hf.config_from_hf(llama)
  assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_theta) == ("linear", 2.0, 1e4)
  dense = hf.config_from_hf(_hf_config(mlp_only_layers=[0, 1]))
  assert dense.moe_num_experts == 0 and dense.mlp_dim == 64


def test_export_refuses_what_the_model_type_cannot_express(tmp_path):
  cfg, params = _load("qwen3")
  with pytest.raises(ValueError, match="qwen2 needs attention_bias; qwen2 cannot have qk_norm"):
    hf.save_checkpoint(tmp_path, cfg, params, model_type="qwen2")
  moe = dataclasses.replace(_load("qwen3_moe")[0], qk_norm=False, moe_every=2)
  with pytest.raises(ValueError, match="mixtral needs moe_every=1"):
    hf.config_to_hf(moe, "mixtral")
  with pytest.raises(ValueError, match=r"params\[layer_0/attn/q/kernel\]: expected shape"):
    bad = jax.tree.map(lambda x: x, params)
    bad["layer_0"]["attn"]["q"]["kernel"] = jnp.zeros((3, 3))
    hf.save_checkpoint(tmp_path, cfg, bad)


# ----------------------------------------------------------------------------- command line


def test_convert_cli_import_and_export(tmp_path, capsys):
  import optax

  from jaxrl_llm.checkpoint import Checkpointer
  from jaxrl_llm.types import TrainState

  sys.path.insert(0, str(TOOLS))
  import hf_convert

  summary = hf_convert.main(
    ["import", f"--hf_dir={FIXTURES / 'mixtral'}", f"--out={tmp_path / 'o'}"]
  )
  assert summary["hf_model_type"] == "mixtral" and summary["num_params"] > 0
  assert '"num_params"' in capsys.readouterr().out
  assert (tmp_path / "o" / "params").is_dir()
  meta = json.loads((tmp_path / "o" / "meta.json").read_text())
  assert ModelConfig.from_dict(meta["model"]) == _load("mixtral")[0]

  # A trainer-style checkpoint (TrainState + meta), exported back to HF format.
  cfg, params = _load("mixtral")
  tx = optax.adamw(1e-3)
  state = TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    ref_params=None,
    rng=jax.random.PRNGKey(0),
  )
  workdir = tmp_path / "run"
  with Checkpointer(str(workdir), save_every=1, async_save=False) as ckpt:
    ckpt.save(3, state, meta={"model": cfg.to_dict()}, force=True)
  out = tmp_path / "hf_out"
  summary = hf_convert.main(["export", f"--workdir={workdir}", f"--out={out}"])
  assert summary["step"] == 3 and summary["hf_model_type"] == "mixtral"
  cfg2, params2 = hf.load_checkpoint(out)
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)
  with pytest.raises(SystemExit, match="no step 7"):
    hf_convert.main(["export", f"--workdir={workdir}", "--step=7", f"--out={out}"])
