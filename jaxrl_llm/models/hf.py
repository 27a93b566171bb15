"""Import and export of Hugging Face checkpoints: Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` listed in `model.safetensors.index.json`. Loading validates
every tensor's presence, dtype and shape from the file headers first, then reads one tensor at a
time and places it straight into its target sharding (no host copy of the whole model).

Tensor layouts (Hugging Face linear weights are [out, in]; ours are [in, out] split by head):
  q_proj [H·Dh, D]  -> attn/q/kernel [D, H, Dh]     (k_proj, v_proj: J heads)
  o_proj [D, H·Dh]  -> attn/o/kernel [H, Dh, D]
  gate/up_proj [F, D] -> mlp/{gate,up}/kernel [D, F];  down_proj [D, F] -> mlp/down/kernel [F, D]
  experts.{e}.*     -> moe/{gate,up} [E, D, F], moe/down [E, F, D] (stacked over experts)
  router [E, D]     -> moe/router/kernel [D, E];  lm_head [V, D] -> lm_head/kernel [D, V]
RoPE is the half-split (rotate_half) convention of both code bases, so q/k need no permutation.
With scanned layers (`ModelConfig.scan_layers`), layer i's `layer_{i}/X` is slice i // p of
`layers/block_{i % p}/X` (p = `scan_period`, see `models.scan`): loading stacks the layers on
device, one parameter at a time; saving takes them off one layer at a time.

The config.json mapping lives in `hf_config`; `save_checkpoint` followed by `load_checkpoint`
gives back the same ModelConfig and bit-identical parameters. What a directory holds beside the
architecture (context length and special token ids in config.json, generation_config.json, the
tokenizer files) is read by `read_source`; `save_checkpoint(..., source=...)` writes it back, so
a model imported from a directory exports with the same metadata and tokenizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import struct
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging
from jax.sharding import SingleDeviceSharding

from jaxrl_llm import sharding as sharding_lib
from jaxrl_llm.models import scan as scan_lib
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf_config import (
  CARRIED_FIELDS,
  EXTRA_KEY,
  MODEL_TYPES,
  CheckpointFormatError,
  carried_fields,
  config_from_hf,
  config_to_hf,
  default_model_type,
)
from jaxrl_llm.models.transformer import Transformer

__all__ = [
  "CARRIED_FIELDS",
  "EXTRA_KEY",
  "MODEL_TYPES",
  "TOKENIZER_FILES",
  "CheckpointFormatError",
  "HFSource",
  "abstract_params",
  "carried_fields",
  "config_from_hf",
  "config_to_hf",
  "default_model_type",
  "load_checkpoint",
  "read_source",
  "save_checkpoint",
]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Tokenizer files of a model directory (fast and slow tokenizers, chat templates): an export
# copies those the source directory holds.
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "tokenizer.model",
  "vocab.json",
  "merges.txt",
  "chat_template.jinja",
  "chat_template.json",
)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


# --------------------------------------------------------------------------- tensor map


@dataclasses.dataclass(frozen=True)
class _Param:
  """One of our parameters and the HF tensor(s) it is made of."""

  path: tuple[str, ...]  # our parameter path
  names: tuple[str, ...]  # HF tensor names; several are stacked on a new leading (expert) axis
  hf_shape: tuple[int, ...]  # shape of each HF tensor
  fields: str  # the config.json fields that fix hf_shape, with their values
  linear: bool = False  # HF [out, in] weight: transposed to [in, out], then reshaped
  stacked: bool = False  # `names` are the experts of one [E, ...] parameter

  def to_ours(self, t: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One HF tensor in our layout `shape` (per expert for stacked params)."""
    return (t.T if self.linear else t).reshape(shape)

  def to_hf(self, p: np.ndarray) -> np.ndarray:
    """One of our arrays (one expert's slice for stacked params) in HF layout."""
    if self.linear:
      return np.ascontiguousarray(p.reshape(self.hf_shape[1], self.hf_shape[0]).T)
    return np.ascontiguousarray(p.reshape(self.hf_shape))


def _param_map(cfg: ModelConfig, model_type: str) -> list[_Param]:
  """Every parameter of `cfg` (value head excepted) with its HF tensor names and shapes."""
  d, v, h, j, dh = cfg.d_model, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  mixtral = model_type == "mixtral"
  vals = {
    "vocab_size": v,
    "hidden_size": d,
    "num_attention_heads": h,
    "num_key_value_heads": j,
    "head_dim": dh,
    "intermediate_size": cfg.moe_expert_mlp_dim if mixtral else cfg.mlp_dim,
    "moe_intermediate_size": cfg.moe_expert_mlp_dim,
    "num_experts": cfg.moe_num_experts,
    "num_local_experts": cfg.moe_num_experts,
  }
  out: list[_Param] = []

  def add(path, names, shape, fields, linear=False):
    names = (names,) if isinstance(names, str) else tuple(names)
    described = ", ".join(f"{n}={vals[n]}" for n in fields)
    stacked = path.split("/")[-2] == "moe" and "router" not in path
    out.append(_Param(tuple(path.split("/")), names, shape, described, linear, stacked))

  add("embed/embedding", "model.embed_tokens.weight", (v, d), ("vocab_size", "hidden_size"))
  add("final_norm/scale", "model.norm.weight", (d,), ("hidden_size",))
  if not cfg.tie_embeddings:
    add("lm_head/kernel", "lm_head.weight", (v, d), ("vocab_size", "hidden_size"), True)
  q_fields = ("num_attention_heads", "head_dim", "hidden_size")
  kv_fields = ("num_key_value_heads", "head_dim", "hidden_size")
  e, fx = cfg.moe_num_experts, cfg.moe_expert_mlp_dim
  num_e = "num_local_experts" if mixtral else "num_experts"
  expert_fields = (
    num_e,
    "intermediate_size" if mixtral else "moe_intermediate_size",
    "hidden_size",
  )
  router_fields = (num_e, "hidden_size")
  dense_fields = ("intermediate_size", "hidden_size")
  expert_names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else None
  for i in range(cfg.num_layers):
    hf, us = f"model.layers.{i}.", f"layer_{i}/"
    att = hf + "self_attn."
    add(us + "attn_norm/scale", hf + "input_layernorm.weight", (d,), ("hidden_size",))
    add(us + "mlp_norm/scale", hf + "post_attention_layernorm.weight", (d,), ("hidden_size",))
    for w, heads, fields in (("q", h, q_fields), ("k", j, kv_fields), ("v", j, kv_fields)):
      add(f"{us}attn/{w}/kernel", f"{att}{w}_proj.weight", (heads * dh, d), fields, True)
      if cfg.attention_bias:
        add(f"{us}attn/{w}/bias", f"{att}{w}_proj.bias", (heads * dh,), fields)
    add(us + "attn/o/kernel", att + "o_proj.weight", (d, h * dh), q_fields, True)
    if cfg.qk_norm:
      for w in ("q", "k"):
        add(f"{us}attn/{w}_norm/scale", f"{att}{w}_norm.weight", (dh,), ("head_dim",))
    if i in cfg.moe_layers:
      moe = hf + ("block_sparse_moe." if mixtral else "mlp.")
      add(
        us + "moe/router/kernel",
        moe + "gate.weight",
        (e, d),
        router_fields,
        True,
      )
      for w, shape in (("gate", (fx, d)), ("up", (fx, d)), ("down", (d, fx))):
        name = expert_names[w] if mixtral else f"{w}_proj"
        experts = [f"{moe}experts.{x}.{name}.weight" for x in range(e)]
        add(f"{us}moe/{w}", experts, shape, expert_fields, True)
    else:
      f = cfg.mlp_dim
      for w, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
        add(
          f"{us}mlp/{w}/kernel",
          f"{hf}mlp.{w}_proj.weight",
          shape,
          dense_fields,
          True,
        )
  return out


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One parameter of the model and the `_Param`s it is made of: one, or with scanned layers
  (`ModelConfig.scan_layers`) one per step of the scan, stacked on a leading layer axis."""

  path: tuple[str, ...]  # our parameter path
  parts: tuple[_Param, ...]  # in the order of the leading layer axis when `layered`
  layered: bool = False


def _entries(cfg: ModelConfig, params: list[_Param]) -> list[_Entry]:
  """The parameters of `cfg`'s layout (unrolled or scanned) built from the per-layer map."""
  if not cfg.scan_layers:
    return [_Entry(p.path, (p,)) for p in params]
  out: dict[tuple[str, ...], dict[int, _Param]] = {}
  plain: list[_Entry] = []
  for p in params:
    target = scan_lib.scanned_path(cfg, p.path)
    if target is None:
      plain.append(_Entry(p.path, (p,)))
    else:
      out.setdefault(target[0], {})[target[1]] = p
  layered = [_Entry(k, tuple(v[g] for g in sorted(v)), True) for k, v in out.items()]
  return plain + layered


# --------------------------------------------------------------------------- loading


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
  file: str  # path of the safetensors file holding the tensor
  shape: tuple[int, ...]
  dtype: str  # safetensors dtype name: F32, BF16, I32, ...


def _read_json(path: str) -> Any:
  """The JSON value of `path`; CheckpointFormatError naming the file if it is not JSON."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None


def _tensor_infos(path: str) -> tuple[dict[str, _TensorInfo], str]:
  """File, shape and dtype of every tensor (from the headers only), and the listing file."""
  from safetensors import safe_open

  index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
  weight_map = None
  if os.path.exists(index):
    listed = _read_json(index)
    weight_map = listed.get("weight_map") if isinstance(listed, dict) else None
    if not isinstance(weight_map, dict):
      raise CheckpointFormatError(f"{index}: has no 'weight_map' dict")
    files, listing = sorted(set(weight_map.values())), index
  elif os.path.exists(single):
    files, listing = [SINGLE_FILE], single
  else:
    raise FileNotFoundError(
      f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found (directory holds "
      f"{sorted(os.listdir(path))}); only safetensors weights can be loaded"
    )
  infos: dict[str, _TensorInfo] = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.exists(file):
      raise FileNotFoundError(f"{index} lists weight file {name}, which does not exist in {path}")
    try:
      with safe_open(file, framework="numpy") as f:
        for key in f.keys():
          if key in infos:
            raise CheckpointFormatError(f"tensor {key!r} is in both {infos[key].file} and {file}")
          sl = f.get_slice(key)
          infos[key] = _TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype())
    except CheckpointFormatError:
      raise
    except Exception as e:  # the safetensors reader raises its own error types
      raise CheckpointFormatError(f"{file}: cannot read the safetensors header ({e})") from None
  if weight_map is not None:
    for key, name in weight_map.items():
      if key not in infos or infos[key].file != os.path.join(path, name):
        raise CheckpointFormatError(f"{index} lists tensor {key!r} in {name}, which lacks it")
    for key in sorted(set(infos) - set(weight_map)):
      raise CheckpointFormatError(f"{infos[key].file}: tensor {key!r} is not listed in {index}")
  return infos, listing


def _check_tensors(
  params: list[_Param], infos: dict[str, _TensorInfo], listing: str, cfg_file: str, tied: bool
) -> None:
  """Raises CheckpointFormatError listing every missing, unexpected, non-float or misshaped tensor."""
  expected = {n: p for p in params for n in p.names}
  problems = [f"{listing}: missing tensor {n!r}" for n in expected if n not in infos]
  for name, info in sorted(infos.items()):
    if name in expected:
      continue
    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
      logging.warning("%s: ignoring tensor %s", info.file, name)
    else:
      problems.append(f"{info.file}: unexpected tensor {name!r}")
  mismatched = False
  for name, p in expected.items():
    info = infos.get(name)
    if info is None:
      continue
    if info.dtype not in _FLOAT_DTYPES:
      problems.append(
        f"{info.file}: tensor {name!r} has dtype {info.dtype}; expected a floating-point dtype "
        f"({', '.join(_FLOAT_DTYPES)})"
      )
    if info.shape != p.hf_shape:
      mismatched = True
      problems.append(
        f"{info.file}: tensor {name!r} has shape {list(info.shape)}, but {cfg_file} "
        f"({p.fields}) implies {list(p.hf_shape)}"
      )
  if not problems:
    return
  head = f"{len(problems)} problem(s) with the weights of {os.path.dirname(cfg_file)}"
  if mismatched:
    head += f" ({cfg_file} does not match the weights' shapes)"
  shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
  raise CheckpointFormatError(head + ":\n  " + "\n  ".join(shown))


class _Reader:
  """Reads single tensors as numpy arrays (bfloat16 through ml_dtypes)."""

  def __init__(self, infos: dict[str, _TensorInfo]):
    self._infos = infos
    self._files: dict[str, Any] = {}
    self._headers: dict[str, tuple[dict[str, Any], int]] = {}
    self._stack = contextlib.ExitStack()

  def __enter__(self) -> _Reader:
    return self

  def __exit__(self, *exc) -> None:
    self._stack.close()

  def _raw_bf16(self, name: str, info: _TensorInfo) -> np.ndarray:
    if info.file not in self._headers:
      with open(info.file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        self._headers[info.file] = (json.loads(f.read(n)), 8 + n)
    header, start = self._headers[info.file]
    begin, end = header[name]["data_offsets"]
    with open(info.file, "rb") as f:
      f.seek(start + begin)
      buf = f.read(end - begin)
    return np.frombuffer(buf, dtype="<u2").view(ml_dtypes.bfloat16).reshape(info.shape)

  def read(self, name: str) -> np.ndarray:
    """The tensor `name` as a host array of its stored dtype."""
    info = self._infos[name]
    if info.dtype == "BF16":  # numpy has no bfloat16, so the numpy reader refuses it
      return self._raw_bf16(name, info)
    if info.file not in self._files:
      from safetensors import safe_open

      self._files[info.file] = self._stack.enter_context(safe_open(info.file, framework="numpy"))
    return self._files[info.file].get_tensor(name)


def abstract_params(cfg: ModelConfig) -> Any:
  """The boxed (logically annotated) abstract parameter tree of `Transformer(cfg)`."""
  model = Transformer(cfg)
  tokens = jnp.zeros((1, 1), jnp.int32)
  init = lambda r: model.init(r, tokens, tokens, tokens >= 0)["params"]  # noqa: E731
  return jax.eval_shape(init, jax.random.PRNGKey(0))


def _flatten(tree: Any) -> dict[tuple[str, ...], Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(k.key for k in path): leaf for path, leaf in leaves}


def _unflatten(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for path, leaf in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = leaf
  return out


def _read_param(reader: _Reader, p: _Param, shape, target, sharding) -> jax.Array:
  """One parameter of our layout `shape`, read from its HF tensor(s) into `sharding`."""
  if p.stacked:
    host = np.stack([p.to_ours(reader.read(n), shape[1:]).astype(target) for n in p.names])
  else:
    host = p.to_ours(reader.read(p.names[0]), shape).astype(target)
  return jax.make_array_from_callback(shape, sharding, lambda i: host[i])


def load_checkpoint(
  path: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: Any = None,
  param_dtype: str | None = None,
  dtype: str | None = None,
  scan_layers: bool | None = None,
) -> tuple[ModelConfig, dict[str, Any]]:
  """Loads a Hugging Face checkpoint directory as (ModelConfig, params).

  Every tensor is checked against config.json (presence, float dtype, shape) before any is read;
  then each is read alone and placed into its sharding on `mesh` under the logical-axis `rules`
  (default `sharding.DEFAULT_RULES`), or on the first local device without a mesh.
  `param_dtype` / `dtype` override the storage / compute dtype (default: float32, or the values
  saved by `save_checkpoint`); `scan_layers` the parameter layout (default: unrolled, or the
  one saved). Scanned, each layer's tensors are placed one layer at a time and stacked on device.
  """
  path = os.fspath(path)
  cfg_file = os.path.join(path, CONFIG_FILE)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: no such checkpoint directory")
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face checkpoint needs config.json")
  hf = _read_json(cfg_file)
  cfg = config_from_hf(hf, source=cfg_file)
  given = (("param_dtype", param_dtype), ("dtype", dtype), ("scan_layers", scan_layers))
  overrides = {k: v for k, v in given if v is not None}
  if overrides:
    try:
      cfg = dataclasses.replace(cfg, **overrides)
    except ValueError as e:
      raise CheckpointFormatError(f"{cfg_file}: {e}") from None
  params_map = _param_map(cfg, hf["model_type"])
  infos, listing = _tensor_infos(path)
  _check_tensors(params_map, infos, listing, cfg_file, cfg.tie_embeddings)

  abstract = abstract_params(cfg)
  if mesh is not None:
    rules = sharding_lib.rules_from_config(rules)
    shardings = _flatten(sharding_lib.param_shardings(abstract, mesh, rules))
  else:
    device = SingleDeviceSharding(jax.local_devices()[0])
    shardings = {k: device for k in _flatten(nn.unbox(abstract))}
  shapes = {k: v.shape for k, v in _flatten(nn.unbox(abstract)).items()}
  target = np.dtype(cfg.weight_dtype)
  out: dict[tuple[str, ...], jax.Array] = {}
  with _Reader(infos) as reader:
    for entry in _entries(cfg, params_map):
      shape, sharding = shapes[entry.path], shardings[entry.path]
      if entry.layered:  # one layer at a time onto the device, stacked there
        pieces = [
          _read_param(reader, p, shape[1:], target, scan_lib.layer_sharding(sharding))
          for p in entry.parts
        ]
        out[entry.path] = jax.jit(jnp.stack, out_shardings=sharding)(pieces)
        del pieces
      else:
        out[entry.path] = _read_param(reader, entry.parts[0], shape, target, sharding)
  if set(out) != set(shapes):  # the tensor map covers the model exactly
    raise AssertionError(f"parameters not mapped: {sorted(set(shapes) ^ set(out))}")
  return cfg, _unflatten(out)


# --------------------------------------------------------------------------- source metadata


@dataclasses.dataclass(frozen=True)
class HFSource:
  """What an export carries over from the Hugging Face directory a model was imported from."""

  path: str  # the directory
  model_type: Any  # its config.json's model_type (as written there)
  fields: dict[str, Any]  # the `CARRIED_FIELDS` its config.json holds
  generation_config: dict[str, Any] | None  # its generation_config.json, if it has one
  tokenizer_files: tuple[str, ...]  # the `TOKENIZER_FILES` it holds


def _tokenizer_files(path: str) -> tuple[str, ...]:
  return tuple(n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n)))


def read_source(path: str | os.PathLike) -> HFSource:
  """Reads the metadata of a Hugging Face directory that `save_checkpoint` carries over.

  Only config.json is required (its weights are not read). Raises FileNotFoundError or
  CheckpointFormatError naming the file (and field) that is missing or malformed.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: no such Hugging Face checkpoint directory")
  cfg_file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face checkpoint needs config.json")
  hf = _read_json(cfg_file)
  fields = carried_fields(hf, source=cfg_file)
  gen_file = os.path.join(path, GENERATION_CONFIG_FILE)
  generation = None
  if os.path.exists(gen_file):
    generation = _read_json(gen_file)
    if not isinstance(generation, dict):
      raise CheckpointFormatError(
        f"{gen_file}: holds a JSON {type(generation).__name__}, not an object"
      )
    carried_fields(
      {k: v for k, v in generation.items() if k != "max_position_embeddings"}, source=gen_file
    )
  return HFSource(path, hf.get("model_type"), fields, generation, _tokenizer_files(path))


def _generation_config(hf: Mapping[str, Any], source: HFSource | None) -> dict[str, Any]:
  """The source's generation_config.json (or an empty one) with the token ids it lacks taken
  from the exported config.json."""
  out = dict(source.generation_config or {}) if source is not None else {}
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    if out.get(key) is None and hf.get(key) is not None:
      out[key] = hf[key]
  return out


def _tokenizer_sources(
  tokenizer: str | os.PathLike | None, source: HFSource | None
) -> list[tuple[str, str]]:
  """(file to copy, name in the export) of each tokenizer file an export writes."""
  if tokenizer is None:
    if source is None:
      return []
    return [(os.path.join(source.path, n), n) for n in source.tokenizer_files]
  tokenizer = os.fspath(tokenizer)
  if os.path.isfile(tokenizer):
    return [(tokenizer, TOKENIZER_FILES[0])]
  if not os.path.isdir(tokenizer):
    raise FileNotFoundError(f"{tokenizer}: no such tokenizer directory or file")
  names = _tokenizer_files(tokenizer)
  if not names:
    raise FileNotFoundError(
      f"{tokenizer}: holds none of the tokenizer files {list(TOKENIZER_FILES)}"
    )
  return [(os.path.join(tokenizer, n), n) for n in names]


def _write_json(path: str, content: Mapping[str, Any]) -> None:
  """Writes `content` as indented JSON with sorted keys and a final newline."""
  with open(path, "w") as f:
    json.dump(content, f, indent=2, sort_keys=True)
    f.write("\n")


def _copy(src: str, dst: str) -> None:
  """Copies file `src` to `dst` (nothing to do when both are the same file)."""
  if os.path.exists(dst) and os.path.samefile(src, dst):
    return
  shutil.copyfile(src, dst)


# --------------------------------------------------------------------------- saving

_SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _to_host(x: Any) -> np.ndarray:
  """A full host copy of one (possibly multi-host sharded) array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def save_checkpoint(
  path: str | os.PathLike,
  cfg: ModelConfig,
  params: Any,
  *,
  model_type: str | None = None,
  dtype: str = "float32",
  max_shard_bytes: int = 5 * 2**30,
  hf_overrides: Mapping[str, Any] | None = None,
  overwrite: bool = False,
  source: str | os.PathLike | HFSource | None = None,
  tokenizer: str | os.PathLike | None = None,
  max_position_embeddings: int | None = None,
) -> str:
  """Writes `params` of `cfg` as a Hugging Face checkpoint directory; returns its model type.

  `model_type` defaults to `default_model_type(cfg)`. Tensors are stored as `dtype`, in shards of
  at most `max_shard_bytes` (with an index file when there are several). A value head is not
  exported. Refuses a directory that already holds weights unless `overwrite`.

  `source` is the Hugging Face directory the model was imported from (or its `read_source`):
  its max_position_embeddings and bos / eos / pad token ids go into config.json, its
  generation_config.json is kept (token ids it lacks are filled in from config.json) and its
  tokenizer files are copied. `tokenizer` (a directory, or a tokenizer.json file) replaces the
  source's tokenizer files. Without a source the token ids are null and max_position_embeddings
  is the model type's default, unless `max_position_embeddings` is given (it also overrides the
  source's). `hf_overrides` are merged into config.json last. generation_config.json is always
  written, with the token ids config.json holds.
  """
  path = os.fspath(path)
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype={dtype!r} must be one of {list(_SAVE_DTYPES)}")
  if max_position_embeddings is not None and not (
    isinstance(max_position_embeddings, int)
    and not isinstance(max_position_embeddings, bool)
    and max_position_embeddings >= 1
  ):
    raise ValueError(f"max_position_embeddings={max_position_embeddings!r} must be an int >= 1")
  if source is not None and not isinstance(source, HFSource):
    source = read_source(source)
  fields = dict(source.fields) if source is not None else {}
  mt = model_type or default_model_type(cfg)
  max_pos = max_position_embeddings or fields.get("max_position_embeddings")
  if max_pos is None:
    logging.warning(
      "no context length known for this model: config.json gets %s's default "
      "max_position_embeddings (pass max_position_embeddings or the source checkpoint)",
      mt,
    )
  hf = config_to_hf(cfg, mt, dtype=dtype, max_position_embeddings=max_pos)
  hf.update({k: fields.get(k) for k in CARRIED_FIELDS if k != "max_position_embeddings"})
  hf.update(hf_overrides or {})
  generation = _generation_config(hf, source)
  tokenizer_files = _tokenizer_sources(tokenizer, source)
  params_map = _param_map(cfg, mt)
  entries = _entries(cfg, params_map)
  flat = _flatten(params)
  shapes = {k: v.shape for k, v in _flatten(nn.unbox(abstract_params(cfg))).items()}
  for e in entries:
    if e.path not in flat or tuple(flat[e.path].shape) != tuple(shapes[e.path]):
      found = tuple(flat[e.path].shape) if e.path in flat else "absent"
      raise ValueError(f"params[{'/'.join(e.path)}]: expected shape {shapes[e.path]}, got {found}")
  extra = sorted("/".join(k) for k in set(flat) - {e.path for e in entries})
  if any(not k.startswith("value_head/") for k in extra):
    raise ValueError(f"params hold entries that {mt} cannot store: {extra}")
  if extra:
    logging.warning("not exporting the value head (%s)", ", ".join(extra))

  writer = jax.process_index() == 0
  old = glob.glob(os.path.join(path, "model*.safetensors")) + glob.glob(
    os.path.join(path, INDEX_FILE)
  )
  if old and not overwrite:
    raise FileExistsError(f"{path} already holds weights ({sorted(old)}); pass overwrite=True")
  if writer:
    os.makedirs(path, exist_ok=True)
    for f in old:
      os.remove(f)

  from safetensors.numpy import save_file

  np_dtype = _SAVE_DTYPES[dtype]
  shards: list[list[str]] = []
  current: dict[str, np.ndarray] = {}
  size = total = 0

  def flush():
    nonlocal current, size
    if not current:
      return
    if writer:
      save_file(current, os.path.join(path, f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
    shards.append(list(current))
    current, size = {}, 0

  for p in params_map:  # in HF order; a scanned parameter one layer at a time off the device
    at = scan_lib.scanned_path(cfg, p.path) if cfg.scan_layers else None
    host = _to_host(flat[p.path] if at is None else flat[at[0]][at[1]])
    for e, name in enumerate(p.names):
      t = p.to_hf(host[e] if p.stacked else host).astype(np_dtype)
      if current and size + t.nbytes > max_shard_bytes:
        flush()
      current[name] = t
      size += t.nbytes
      total += t.nbytes
    del host
  flush()
  if writer:
    n = len(shards)
    names = (
      [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for i, name in enumerate(names):
      os.replace(os.path.join(path, f"shard-{i}.tmp"), os.path.join(path, name))
    if n > 1:
      weight_map = {t: names[i] for i, shard in enumerate(shards) for t in shard}
      with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    _write_json(os.path.join(path, GENERATION_CONFIG_FILE), generation)
    for src, name in tokenizer_files:
      _copy(src, os.path.join(path, name))
    _write_json(os.path.join(path, CONFIG_FILE), hf)
  return mt
