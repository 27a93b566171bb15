"""Hugging Face import/export against reference outputs of the transformers implementation.

The fixtures under tests/fixtures/hf/ were written by tools/make_hf_fixtures.py (which needs
torch and transformers; these tests need neither): tiny random checkpoints of every supported
architecture with the transformers model's logits and greedy continuation on a left-padded batch;
the llama one also holds a tokenizer and a generation_config.json, which an export must keep.
`tools/hf_convert.py` is run as a subprocess on broken copies of them: each failure must be one
`error:` line naming the file and the field or tensor, with exit code 2 and no traceback.
"""

import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, cli_env, save_trainer_checkpoint
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from jaxrl_llm import sharding
from jaxrl_llm.models import families, hf, hf_config, hf_export, hf_layout, hf_shards
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
  assert types == set(hf_config.MODEL_TYPES)
  assert MANIFEST["transformers_version"]
  size = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
  assert size < 1_000_000  # the README: under 1 MB


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
  cfg, params = _load(name)
  ref = _reference(name)
  # rtol: float32 sums in another order (jax 0.11 against 0.10) moved one logit of 7.8 by 1.05e-5
  np.testing.assert_allclose(_logits(cfg, params, ref), ref["logits"], rtol=2e-6, atol=1e-5)


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
  mistral = cfgs["mistral"]
  assert (mistral.head_dim, mistral.rope_theta, mistral.tie_embeddings) == (16, 1e4, False)
  assert not (mistral.attention_bias or mistral.qk_norm or mistral.moe_num_experts)


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
  hf_export.save_checkpoint(
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
  assert (out / hf_layout.INDEX_FILE).exists() == (len(list(out.glob("*.safetensors"))) > 1)


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
  hf_export.save_checkpoint(tmp_path, cfg, params, dtype="bfloat16", max_shard_bytes=4096)
  assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"
  assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
  cfg2, params2 = hf.load_checkpoint(tmp_path)
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    hf_export.save_checkpoint(tmp_path, cfg, params, dtype="bfloat16")
  hf_export.save_checkpoint(tmp_path, cfg, params, dtype="bfloat16", overwrite=True)
  assert not list(tmp_path.glob("model-*-of-*.safetensors"))
  _assert_trees_equal(hf.load_checkpoint(tmp_path)[1], params)


def test_an_interrupted_overwrite_leaves_the_export_there_whole(tmp_path, monkeypatch):
  """An export over another one writes beside it and moves in at the end: a Ctrl-C after some
  shards leaves the old export loadable with no stray file; a finished one replaces it whole,
  its weights readable as the umask allows (safetensors writes them owner-only)."""
  name = NAMES[0]
  cfg, params = _load(name)
  hf_export.save_checkpoint(tmp_path, cfg, params, max_shard_bytes=4096)
  before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  assert len([n for n in before if n.startswith("model-")]) > 2
  bumped = jax.tree.map(lambda x: x + 1, params)
  added = []
  add = hf_shards.ShardWriter.add

  def interrupted(self, tensor, t):  # Ctrl-C once three shards are on disk
    if len(self.shards) == 3:
      raise KeyboardInterrupt
    added.append(tensor)
    add(self, tensor, t)

  monkeypatch.setattr(hf_shards.ShardWriter, "add", interrupted)
  with pytest.raises(KeyboardInterrupt):
    hf_export.save_checkpoint(tmp_path, cfg, bumped, max_shard_bytes=4096, overwrite=True)
  assert added and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
  monkeypatch.setattr(hf_shards.ShardWriter, "add", add)
  umask = os.umask(0o027)
  try:
    hf_export.save_checkpoint(tmp_path, cfg, bumped, overwrite=True)
  finally:
    os.umask(umask)
  assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
  assert not (tmp_path / hf_layout.INDEX_FILE).exists()
  assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o640
  _assert_trees_equal(hf.load_checkpoint(tmp_path)[1], bumped)


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
    np.where(ref["mask"][..., None], logits, 0.0), ref["logits"], rtol=0, atol=1e-5
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
  with pytest.raises(hf_config.CheckpointFormatError) as e:
    hf.load_checkpoint(path)
  assert "model.safetensors: missing tensor 'model.layers.1.mlp.up_proj.weight'" in str(e.value)


def test_non_float_tensor_is_named_with_its_file(tmp_path):
  path = _copy("qwen2", tmp_path)
  tensors = load_file(path / "model.safetensors")
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(
    hf_config.CheckpointFormatError, match=r"model\.safetensors: tensor 'model\.norm\."
  ):
    hf.load_checkpoint(path)
  with pytest.raises(
    hf_config.CheckpointFormatError, match="has dtype I32; expected a floating-point"
  ):
    hf.load_checkpoint(path)


def test_unexpected_tensor_is_named(tmp_path):
  path = _copy("qwen2", tmp_path)
  tensors = load_file(path / "model.safetensors")
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(
    hf_config.CheckpointFormatError,
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
  with pytest.raises(hf_config.CheckpointFormatError) as e:
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
    hf_config.CheckpointFormatError, match=re.escape("unexpected tensor 'model.layers.1.")
  ):
    hf.load_checkpoint(path)


def test_bad_model_type_lists_the_supported_ones(tmp_path):
  path = _copy("qwen2", tmp_path)
  _edit_config(path, model_type="gpt2")
  with pytest.raises(hf_config.CheckpointFormatError) as e:
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
  (path / hf_layout.INDEX_FILE).unlink()
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
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"num_hidden_layers": 4, "mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
  ],
)
def test_unsupported_features_name_the_field(changes, field):
  with pytest.raises(hf_config.CheckpointFormatError, match="unsupported") as e:
    hf_config.config_from_hf(_hf_config(**changes), source="x/config.json")
  assert field in str(e.value) and str(e.value).startswith("x/config.json")


def test_mistral_sliding_window_defaults_as_its_reference_class():
  mistral = _json(FIXTURES / "mistral" / "config.json")
  del mistral["sliding_window"]  # MistralConfig's default is 4096: a window, refused
  with pytest.raises(hf_config.CheckpointFormatError) as e:
    hf_config.config_from_hf(mistral, source="x/config.json")
  assert "unsupported mistral config: sliding_window omitted (mistral's default is 4096)" in str(
    e.value
  )
  cfg = _load("mistral")[0]
  exported = hf_export.config_to_hf(cfg, "mistral")
  assert exported["sliding_window"] is None and exported["architectures"] == ["MistralForCausalLM"]
  assert hf_config.config_from_hf(exported) == cfg


_OPTIONAL = (
  ("num_key_value_heads",),
  ("head_dim",),
  ("rms_norm_eps",),
  ("rope_parameters", "rope_theta"),
  ("tie_word_embeddings",),
  ("num_experts_per_tok",),
  ("num_experts", "num_local_experts"),
  ("norm_topk_prob",),
)


@pytest.mark.parametrize("model_type", hf_config.MODEL_TYPES)
def test_omitted_fields_read_as_the_reference_config_class_reads_them(model_type):
  transformers = pytest.importorskip("transformers")
  name = next(n for n in NAMES if MANIFEST["fixtures"][n]["model_type"] == model_type)
  # 32 heads and 16 experts, so that every family's default number of key/value heads divides
  # them and its default top-k fits.
  base = {**_json(FIXTURES / name / "config.json"), "hidden_size": 512, "num_attention_heads": 32}
  if "num_local_experts" in base:
    base["num_local_experts"] = 16
  for omitted in _OPTIONAL:
    fields = {k: v for k, v in base.items() if k not in omitted}
    ours = hf_config.config_from_hf(fields)
    ref = transformers.AutoConfig.for_model(**fields)
    head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    assert (ours.num_kv_heads, ours.head_dim) == (ref.num_key_value_heads, head_dim), omitted
    assert ours.norm_eps == ref.rms_norm_eps, omitted
    assert ours.rope_theta == ref.rope_parameters["rope_theta"], omitted
    assert ours.tie_embeddings == ref.tie_word_embeddings, omitted
    if ours.moe_num_experts:
      experts = getattr(ref, "num_experts", None) or ref.num_local_experts
      assert (ours.moe_num_experts, ours.moe_top_k) == (experts, ref.num_experts_per_tok), omitted
      assert ours.moe_normalize_gates == getattr(ref, "norm_topk_prob", True), omitted
  # An export without a known context length gets the reference class's default.
  exported = hf_export.config_to_hf(hf_config.config_from_hf(base), model_type)
  default = transformers.AutoConfig.for_model(model_type).max_position_embeddings
  assert exported["max_position_embeddings"] == default


def test_default_model_type_follows_the_features():
  base = ModelConfig(moe_num_experts=0)
  for changes, want in (
    ({}, "llama"),  # not mistral: llama comes first in the table
    ({"attention_bias": True}, "qwen2"),
    ({"qk_norm": True}, "qwen3"),
    ({"qk_norm": True, "attention_bias": True}, "qwen3"),  # no family has both
    ({"moe_num_experts": 4}, "mixtral"),
    ({"moe_num_experts": 4, "qk_norm": True}, "qwen3_moe"),
  ):
    assert families.default_model_type(dataclasses.replace(base, **changes)) == want, changes


def test_older_config_spellings_and_sparse_step():
  v4 = _hf_config(decoder_sparse_step=2, num_hidden_layers=4, rope_theta=1e6, num_experts=8)
  del v4["rope_parameters"], v4["num_local_experts"]
  cfg = hf_config.config_from_hf(v4)
  assert (cfg.moe_layers, cfg.moe_num_experts, cfg.rope_theta) == ((1, 3), 8, 1e6)
  assert cfg.mlp_dim == 64 and cfg.moe_expert_mlp_dim == 16
  llama = json.loads((FIXTURES / "llama" / "config.json").read_text())
  del llama["rope_parameters"]
  llama["rope_scaling"] = {"type": "linear", "factor": 2.0}
  cfg = hf_config.config_from_hf(llama)
  assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_theta) == ("linear", 2.0, 1e4)
  dense = hf_config.config_from_hf(_hf_config(mlp_only_layers=[0, 1]))
  assert dense.moe_num_experts == 0 and dense.mlp_dim == 64


def test_export_refuses_what_the_model_type_cannot_express(tmp_path):
  cfg, params = _load("qwen3")
  with pytest.raises(ValueError, match="qwen2 needs attention_bias; qwen2 cannot have qk_norm"):
    hf_export.save_checkpoint(tmp_path, cfg, params, model_type="qwen2")
  moe = dataclasses.replace(_load("qwen3_moe")[0], qk_norm=False, moe_every=2)
  with pytest.raises(ValueError, match="mixtral needs moe_every=1"):
    hf_export.config_to_hf(moe, "mixtral")
  shared = dataclasses.replace(moe, moe_every=1, moe_num_shared_experts=1)
  for model_type in ("mixtral", "qwen3_moe"):  # no family the export writes has shared experts
    with pytest.raises(ValueError, match="and no model_type the export writes has them"):
      hf_export.config_to_hf(shared, model_type)
  with pytest.raises(ValueError, match=r"params\[layer_0/attn/q/kernel\]: expected shape"):
    bad = jax.tree.map(lambda x: x, params)
    bad["layer_0"]["attn"]["q"]["kernel"] = jnp.zeros((3, 3))
    hf_export.save_checkpoint(tmp_path, cfg, bad)


# ----------------------------------------------------------------------------- command line


def test_convert_cli_import_and_export(tmp_path, capsys):
  import optax

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
  workdir = tmp_path / "run"
  save_trainer_checkpoint(
    workdir, params, {"model": cfg.to_dict()}, opt_state=optax.adamw(1e-3).init(params)
  )
  out = tmp_path / "hf_out"
  summary = hf_convert.main(["export", f"--workdir={workdir}", f"--out={out}"])
  assert summary["step"] == 3 and summary["hf_model_type"] == "mixtral"
  cfg2, params2 = hf.load_checkpoint(out)
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)
  with pytest.raises(hf_convert.ConvertError, match="no step 7"):
    hf_convert.main(["export", f"--workdir={workdir}", "--step=7", f"--out={out}"])
  # The command line says nothing alarming about a good export (libraries' notes stay off).
  proc = subprocess.run(
    [sys.executable, str(TOOLS / "hf_convert.py"), "export", f"--workdir={workdir}",
     f"--out={tmp_path / 'cli_out'}", "--max_position_embeddings=64"],
    cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "Metadata file does not exist" not in proc.stderr and "TPU_WORKER" not in proc.stderr
  # Files changed since the save: refused (the step asked for, or the newest), not exported.
  step_dir = workdir / "checkpoints" / "3"
  blob = max(
    (p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
  )
  data = bytearray(blob.read_bytes())
  data[len(data) // 2] ^= 0xFF
  blob.write_bytes(bytes(data))
  with pytest.raises(
    hf_convert.ConvertError, match=r"checkpoints/3: .* does not match its checksum"
  ):
    hf_convert.main(["export", f"--workdir={workdir}", "--step=3", f"--out={tmp_path / 'bad'}"])
  with pytest.raises(hf_convert.ConvertError, match="no step verifies against its checksums"):
    hf_convert.main(["export", f"--workdir={workdir}", f"--out={tmp_path / 'bad'}"])
  (step_dir / "checksums.json").unlink()
  with pytest.raises(hf_convert.ConvertError, match=r"no checksums\.json, so its files cannot be"):
    hf_convert.main(["export", f"--workdir={workdir}", "--step=3", f"--out={tmp_path / 'bad'}"])
  assert not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------- export metadata

_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _json(path) -> dict:
  return json.loads(pathlib.Path(path).read_text())


def _export(src: pathlib.Path, out: pathlib.Path, **kwargs) -> pathlib.Path:
  """Imports the HF directory `src` and exports it to `out` with `src` as the source."""
  cfg, params = hf.load_checkpoint(src)
  mt = _json(src / "config.json")["model_type"]
  hf_export.save_checkpoint(out, cfg, params, model_type=mt, source=src, **kwargs)
  return out


def _model_files(path: pathlib.Path) -> dict[str, bytes]:
  """The generation config and tokenizer files of a directory, by name."""
  names = (hf_layout.GENERATION_CONFIG_FILE, *hf_layout.TOKENIZER_FILES)
  return {n: (path / n).read_bytes() for n in names if (path / n).is_file()}


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_keeps_context_length_rope_token_ids_and_model_files(name, tmp_path):
  src = FIXTURES / name
  first = _export(src, tmp_path / "first")
  second = _export(first, tmp_path / "second")  # import -> export of the export
  want, got = _json(src / "config.json"), _json(first / "config.json")
  for key in hf_config.CARRIED_FIELDS:
    assert got[key] == want[key], key
  rope = want["rope_parameters"]
  assert got["rope_parameters"] == rope and got["rope_theta"] == rope["rope_theta"]
  scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
  assert got["rope_scaling"] == (None if rope["rope_type"] == "default" else scaling)
  gen = _json(first / hf_layout.GENERATION_CONFIG_FILE)
  if (src / hf_layout.GENERATION_CONFIG_FILE).exists():  # kept as it was, sampling fields included
    assert gen == _json(src / hf_layout.GENERATION_CONFIG_FILE)
  else:  # built from config.json's ids
    assert gen == {k: want[k] for k in _IDS if want[k] is not None}
  tokenizer = {n: b for n, b in _model_files(src).items() if n != hf_layout.GENERATION_CONFIG_FILE}
  assert {n: b for n, b in _model_files(first).items() if n in tokenizer} == tokenizer
  assert set(_model_files(first)) == {hf_layout.GENERATION_CONFIG_FILE, *tokenizer}
  # Re-importing the export gives the same model and the same metadata; a second export of it
  # writes the same files.
  assert hf.load_checkpoint(first)[0] == _load(name)[0]
  a, b = hf.read_source(src), hf.read_source(first)
  assert (b.model_type, b.tokenizer_files) == (a.model_type, a.tokenizer_files)
  assert b.fields == a.fields
  for f in ("config.json", *_model_files(first)):
    assert (second / f).read_bytes() == (first / f).read_bytes(), f
  assert set(_model_files(second)) == set(_model_files(first))


def test_exported_tokenizer_and_generation_config_read_back():
  from jaxrl_llm.data.tokenizers import HFTokenizer

  src = FIXTURES / "llama"
  gen = _json(src / hf_layout.GENERATION_CONFIG_FILE)
  assert gen["temperature"] == 0.6 and gen["top_p"] == 0.9 and gen["do_sample"] is True
  assert _json(src / "config.json")["pad_token_id"] == 0
  tok = HFTokenizer.from_dir(src)
  assert (tok.vocab_size, tok.bos_id, tok.eos_ids, tok.pad_id) == (64, 1, (2, 3), 0)


def test_llama_export_tokenizer_matches_the_source(tmp_path):
  from jaxrl_llm.data.tokenizers import HFTokenizer

  out = _export(FIXTURES / "llama", tmp_path / "out")
  a, b = HFTokenizer.from_dir(FIXTURES / "llama"), HFTokenizer.from_dir(out)
  assert repr(a) == repr(b)
  text = "the quick brown fox"
  assert a.encode(text) == b.encode(text) and b.decode(b.encode(text)) == text


def test_export_carries_edited_fields_and_builds_a_generation_config(tmp_path):
  src = _copy("qwen2", tmp_path)
  cfg = json.loads((src / "config.json").read_text())
  del cfg["rope_parameters"]  # the transformers 4 spelling
  cfg.update(
    max_position_embeddings=4096,
    bos_token_id=5,
    eos_token_id=[6, 7],
    pad_token_id=8,
    rope_theta=1e6,
    rope_scaling={"type": "linear", "factor": 2.0},
  )
  (src / "config.json").write_text(json.dumps(cfg))
  out = _export(src, tmp_path / "out")
  got = _json(out / "config.json")
  assert (got["max_position_embeddings"], got["rope_theta"]) == (4096, 1e6)
  assert [got[k] for k in _IDS] == [5, [6, 7], 8]
  assert got["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
  assert got["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
  assert _json(out / hf_layout.GENERATION_CONFIG_FILE) == {
    "bos_token_id": 5,
    "eos_token_id": [6, 7],
    "pad_token_id": 8,
  }
  assert not any((out / n).exists() for n in hf_layout.TOKENIZER_FILES)
  # An explicit context length and config.json overrides win; the generation config follows.
  _export(src, out, overwrite=True, max_position_embeddings=8192, hf_overrides={"eos_token_id": 9})
  assert _json(out / "config.json")["max_position_embeddings"] == 8192
  assert _json(out / hf_layout.GENERATION_CONFIG_FILE)["eos_token_id"] == 9


def test_export_without_a_source(tmp_path):
  cfg, params = _load("qwen2")
  hf_export.save_checkpoint(tmp_path / "a", cfg, params)
  got = _json(tmp_path / "a" / "config.json")
  assert got["max_position_embeddings"] == 32768  # Qwen2Config's default: nothing else known
  assert [got[k] for k in _IDS] == [None, None, None]
  assert _json(tmp_path / "a" / hf_layout.GENERATION_CONFIG_FILE) == {}
  hf_export.save_checkpoint(
    tmp_path / "b", cfg, params, max_position_embeddings=1000, tokenizer=FIXTURES / "llama"
  )
  assert _json(tmp_path / "b" / "config.json")["max_position_embeddings"] == 1000
  tokenizer = {
    n: b for n, b in _model_files(FIXTURES / "llama").items() if n in hf_layout.TOKENIZER_FILES
  }
  assert {n: b for n, b in _model_files(tmp_path / "b").items() if n in tokenizer} == tokenizer
  hf_export.save_checkpoint(
    tmp_path / "c", cfg, params, tokenizer=FIXTURES / "llama" / "tokenizer.json"
  )
  # tokenizer.json stands for its directory: the tokenizer files beside it come along
  assert {n: b for n, b in _model_files(tmp_path / "c").items() if n in tokenizer} == tokenizer
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="holds none of the tokenizer files"):
    hf_export.save_checkpoint(tmp_path / "d", cfg, params, tokenizer=tmp_path / "empty")
  with pytest.raises(ValueError, match="max_position_embeddings=0 must be an int >= 1"):
    hf_export.save_checkpoint(tmp_path / "d", cfg, params, max_position_embeddings=0)
  assert not (tmp_path / "d").exists()  # checked before anything is written


@pytest.mark.parametrize(
  "file, changes, message",
  [
    ("config.json", {"eos_token_id": "x"}, "config.json: eos_token_id='x' is not a token id"),
    ("config.json", {"pad_token_id": [0]}, "config.json: pad_token_id=[0] is not a token id"),
    (
      "config.json",
      {"max_position_embeddings": 0},
      "config.json: max_position_embeddings=0 is not a positive integer",
    ),
    ("generation_config.json", {"bos_token_id": -1}, "generation_config.json: bos_token_id=-1"),
    # an id past the vocabulary (64 rows) is refused at import too, not only at export
    ("config.json", {"eos_token_id": 64}, "config.json: eos_token_id=64 is not below the model's"),
    (
      "generation_config.json",
      {"eos_token_id": [2, 99]},
      "generation_config.json: eos_token_id=[2, 99] is not below the model's vocab_size=64",
    ),
  ],
)
def test_malformed_source_metadata_is_named(file, changes, message, tmp_path):
  src = _copy("llama", tmp_path)
  content = _json(src / file)
  content.update(changes)
  (src / file).write_text(json.dumps(content))
  with pytest.raises(hf_config.CheckpointFormatError, match=re.escape(message)):
    hf.read_source(src)


def test_transformers_reads_the_export(tmp_path):
  transformers = pytest.importorskip("transformers")
  src = FIXTURES / "llama"
  out = _export(src, tmp_path / "out")
  want, got = (
    transformers.AutoConfig.from_pretrained(src),
    transformers.AutoConfig.from_pretrained(out),
  )
  for key in hf_config.CARRIED_FIELDS:
    assert getattr(got, key) == getattr(want, key), key
  gen = transformers.GenerationConfig.from_pretrained(out)
  assert (gen.temperature, gen.top_p, gen.eos_token_id, gen.pad_token_id) == (0.6, 0.9, [2, 3], 0)
  text = "the lazy dog"
  ids = transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"]
  assert ids == transformers.AutoTokenizer.from_pretrained(src)(text)["input_ids"]


# ----------------------------------------------------------------------------- command-line errors


def _trainer_workdir(path: pathlib.Path, name: str, *, source="", model=None) -> pathlib.Path:
  """A trainer-style workdir: a checkpoint of fixture `name`'s params at step 3 with the meta
  the trainer writes, and the run record `config.json` naming `source` as model.checkpoint."""
  cfg, params = _load(name)
  meta = {
    "model": (model or cfg).to_dict(),
    "hf_model_type": MANIFEST["fixtures"][name]["model_type"],
  }
  record = {"config": {"model": {"checkpoint": str(source)}, "data": {"tokenizer": ""}}}
  save_trainer_checkpoint(path, params, meta, record)
  return path


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
  """(workdir of a run started from a copy of the llama fixture, that copy)."""
  root = tmp_path_factory.mktemp("llama_run")
  src = root / "llama"
  shutil.copytree(FIXTURES / "llama", src)
  return _trainer_workdir(root / "run", "llama", source=src), src


def test_convert_cli_export_keeps_the_run_s_source_metadata(llama_run, tmp_path):
  sys.path.insert(0, str(TOOLS))
  import hf_convert

  workdir, src = llama_run
  summary = hf_convert.main(["export", f"--workdir={workdir}", f"--out={tmp_path / 'a'}"])
  assert summary["hf_source"] == str(src) and summary["hf_model_type"] == "llama"
  assert _model_files(tmp_path / "a") == _model_files(src)
  for key in hf_config.CARRIED_FIELDS:
    assert _json(tmp_path / "a" / "config.json")[key] == _json(src / "config.json")[key], key
  _assert_trees_equal(hf.load_checkpoint(tmp_path / "a")[1], _load("llama")[1])
  args = ["export", f"--workdir={workdir}", "--hf_source=none", f"--out={tmp_path / 'b'}"]
  hf_convert.main(args)
  assert [_json(tmp_path / "b" / "config.json")[k] for k in _IDS] == [None, None, None]
  assert set(_model_files(tmp_path / "b")) == {hf_layout.GENERATION_CONFIG_FILE}
  hf_convert.main(["export", f"--workdir={workdir}", "--tokenizer=none", f"--out={tmp_path / 'c'}"])
  assert _model_files(tmp_path / "c") == {
    hf_layout.GENERATION_CONFIG_FILE: (src / hf_layout.GENERATION_CONFIG_FILE).read_bytes()
  }
  summary = hf_convert.main(["import", f"--hf_dir={src}", f"--out={tmp_path / 'o'}"])
  assert summary["carried"]["config"]["eos_token_id"] == 2
  assert summary["carried"]["tokenizer_files"][0] == "tokenizer.json"
  assert _json(tmp_path / "o" / "meta.json")["hf_source"] == str(src)


def _cli_error(*args: str) -> str:
  """Runs tools/hf_convert.py, which must fail with exit code 2 and exactly one `error:` line
  and no traceback; returns that line."""
  proc = subprocess.run(
    [sys.executable, str(TOOLS / "hf_convert.py"), *args],
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, proc.stderr
  return errors[0]


def _replace_tensor(path: pathlib.Path, name: str, value) -> None:
  tensors = load_file(path / "model.safetensors")
  if value is None:
    del tensors[name]
  else:
    tensors[name] = value
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _truncate(path: pathlib.Path) -> None:
  data = (path / "model.safetensors").read_bytes()
  (path / "model.safetensors").write_bytes(data[: len(data) - 1000])


@pytest.mark.parametrize(
  "breaks, expected",
  [
    pytest.param(
      lambda p: (p / "config.json").unlink(), "{p}/config.json not found", id="no_config"
    ),
    pytest.param(
      lambda p: (p / "config.json").write_text("{not json"),
      "{p}/config.json: not valid JSON (Expecting property name",
      id="config_not_json",
    ),
    pytest.param(
      lambda p: _edit_config(p, model_type="gpt2"),
      "{p}/config.json: model_type='gpt2' is not supported",
      id="unknown_model_type",
    ),
    pytest.param(
      lambda p: _edit_config(p, hidden_size="32"),
      "{p}/config.json: hidden_size='32' is not an integer",
      id="field_type",
    ),
    pytest.param(
      lambda p: _edit_config(p, num_attention_heads=0),
      "{p}/config.json: num_attention_heads=0 must be >= 1",
      id="zero_heads",
    ),
    pytest.param(
      lambda p: _replace_tensor(p, "model.layers.1.mlp.up_proj.weight", None),
      "{p}/model.safetensors: missing tensor 'model.layers.1.mlp.up_proj.weight'",
      id="missing_tensor",
    ),
    pytest.param(
      lambda p: _replace_tensor(p, "model.norm.weight", np.ones(31, np.float32)),
      "{p}/model.safetensors: tensor 'model.norm.weight' has shape [31], but {p}/config.json "
      "(hidden_size=32) implies [32]",
      id="wrong_shape",
    ),
    pytest.param(
      _truncate,
      "{p}/model.safetensors: cannot read the safetensors header (Error while deserializing "
      "header: incomplete metadata",
      id="truncated",
    ),
  ],
)
def test_convert_cli_import_errors_are_one_line(breaks, expected, tmp_path):
  path = _copy("qwen2", tmp_path)
  breaks(path)
  line = _cli_error("import", f"--hf_dir={path}")
  assert expected.format(p=path) in line, line


def _no_checkpoints(workdir, tmp):
  return [
    f"--workdir={tmp}"
  ], f"error: {tmp}: has no checkpoints/ directory (not a trainer workdir?)"


def _bad_model_type(workdir, tmp):
  return ["--model_type=gpt2"], "error: model_type='gpt2' is not supported"


def _out_under_a_file(workdir, tmp):
  (tmp / "file").write_text("")
  return [
    f"--out={tmp / 'file' / 'sub'}"
  ], f"cannot be made: {tmp / 'file'} is a file, not a directory"


def _bad_source_token_id(workdir, tmp):
  bad = _copy("llama", tmp)
  _edit_config(bad, eos_token_id="</s>")
  return [f"--hf_source={bad}"], f"error: {bad}/config.json: eos_token_id='</s>' is not a token id"


def _source_of_another_vocab(workdir, tmp):
  other = _copy("llama", tmp)
  _edit_config(other, vocab_size=32000)
  return [f"--hf_source={other}"], f"error: {other}: config.json has vocab_size=32000, the model 64"


def _source_id_past_the_vocab(workdir, tmp):
  bad = _copy("llama", tmp)
  _edit_config(bad, eos_token_id=[2, 64])
  return [f"--hf_source={bad}"], (
    f"error: {bad}/config.json: eos_token_id=[2, 64] is not below the model's vocab_size=64"
  )


def _tokenizer_of_another_vocab(workdir, tmp):
  from text_fixtures import build_bpe_tokenizer

  build_bpe_tokenizer(tmp / "big", vocab_size=400)
  size = Tokenizer.from_file(str(tmp / "big" / "tokenizer.json")).get_vocab_size(True)
  return [f"--tokenizer={tmp / 'big'}"], (
    f"error: {tmp / 'big' / 'tokenizer.json'}: a tokenizer of {size} tokens, more than the "
    "model's vocab_size=64"
  )


def _source_generation_config_not_json(workdir, tmp):
  bad = _copy("llama", tmp)
  (bad / "generation_config.json").write_text("[1, 2")
  return [f"--hf_source={bad}"], f"error: {bad}/generation_config.json: not valid JSON"


def _lost_source(workdir, tmp):
  record = _json(workdir / "config.json")
  record["config"]["model"]["checkpoint"] = str(tmp / "gone")
  shutil.copytree(workdir, tmp / "run")
  (tmp / "run" / "config.json").write_text(json.dumps(record))
  expected = f"error: {tmp / 'run'}/config.json: model.checkpoint='{tmp / 'gone'}'"
  return [f"--workdir={tmp / 'run'}"], expected


def _output_holds_weights(workdir, tmp):
  (tmp / "out").mkdir()
  (tmp / "out" / "model.safetensors").write_bytes(b"")
  return [f"--out={tmp / 'out'}"], f"error: {tmp / 'out'} already holds weights"


@pytest.mark.parametrize(
  "case",
  [
    _no_checkpoints,
    _bad_model_type,
    _out_under_a_file,
    _bad_source_token_id,
    _source_of_another_vocab,
    _source_id_past_the_vocab,
    _tokenizer_of_another_vocab,
    _source_generation_config_not_json,
    _lost_source,
    _output_holds_weights,
  ],
)
def test_convert_cli_export_errors_are_one_line(case, llama_run, tmp_path):
  workdir, _ = llama_run
  args, expected = case(workdir, tmp_path)
  defaults = {"--workdir": f"--workdir={workdir}", "--out": f"--out={tmp_path / 'new'}"}
  given = {a.split("=")[0] for a in args}
  line = _cli_error("export", *args, *(v for k, v in defaults.items() if k not in given))
  assert expected in line, line


def test_convert_cli_export_names_a_misshaped_parameter(tmp_path):
  cfg = _load("qwen2")[0]
  workdir = _trainer_workdir(tmp_path / "run", "qwen2", model=dataclasses.replace(cfg, mlp_dim=48))
  line = _cli_error("export", f"--workdir={workdir}", f"--out={tmp_path / 'out'}")
  assert line == (
    f"error: {workdir}/checkpoints/3/state: parameter params/layer_0/mlp/down/kernel has shape "
    f"[64, 32], but the 'model' field of {workdir}/checkpoints/3/meta implies [48, 32]"
  )


def test_convert_cli_debug_shows_the_traceback(tmp_path):
  proc = subprocess.run(
    [sys.executable, str(TOOLS / "hf_convert.py"), "import", f"--hf_dir={tmp_path}", "--debug"],
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 2 and "Traceback" in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
    f"error: {tmp_path}/config.json not found: a Hugging Face checkpoint needs config.json"
  )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_convert_cli_names_an_unwritable_output_directory(llama_run, tmp_path):
  workdir, _ = llama_run
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o555)
  line = _cli_error("export", f"--workdir={workdir}", f"--out={locked / 'out'}")
  assert f"--out={locked / 'out'}: cannot be made: {locked} cannot be written" in line
