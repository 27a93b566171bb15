"""Import and export of Hugging Face checkpoints of the families in `families.FAMILIES`.

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
Each family's tensor names and shapes come from its row's tensor map (`families.Tensor`).
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
import math
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
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models import scan as scan_lib
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import BY_MODEL_TYPE, Family, Tensor
from jaxrl_llm.models.hf_config import (
  CARRIED_FIELDS,
  EXTRA_KEY,
  MODEL_TYPES,
  CheckpointFormatError,
  MissingCheckpointFileError,
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


def _shape_values(cfg: ModelConfig, fam: Family) -> dict[str, int]:
  """The config.json fields that tensor shapes are made of, as `cfg` sets them for `fam`."""
  vals = {
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "intermediate_size": cfg.mlp_dim,
  }
  if fam.experts is not None:  # Mixtral's expert width is its intermediate_size
    vals.update({fam.experts.count_key: cfg.moe_num_experts})
    vals.update({fam.experts.dim_key: cfg.moe_expert_mlp_dim})
  return vals


def _holds(cfg: ModelConfig, t: Tensor, layer: int | None) -> bool:
  """Whether the model of `cfg` has tensor `t` (in `layer`, for a per-layer tensor)."""
  return {
    "always": True,
    "untied": not cfg.tie_embeddings,
    "attention_bias": cfg.attention_bias,
    "qk_norm": cfg.qk_norm,
    "dense": layer not in cfg.moe_layers,
    "moe": layer in cfg.moe_layers,
  }[t.when]


def _param(t: Tensor, vals: Mapping[str, int], layer: int | None, num_experts: int) -> _Param:
  """Tensor `t` (of `layer`, for a per-layer tensor) as a `_Param` with concrete names and shape."""
  stacked = "{e}" in t.hf
  names = tuple(t.hf.format(i=layer, e=e) for e in range(num_experts if stacked else 1))
  shape = tuple(math.prod(vals[f] for f in dim.split("*")) for dim in t.shape)
  described = ", ".join(f"{n}={vals[n]}" for n in t.fields)
  path = tuple(t.ours.format(i=layer).split("/"))
  return _Param(path, names, shape, described, t.linear, stacked)


def _param_map(cfg: ModelConfig, fam: Family) -> list[_Param]:
  """Every parameter of `cfg` (value head excepted) with its HF tensor names and shapes, in the
  order of the family's tensor map: the model's own tensors, then layer by layer."""
  vals, e = _shape_values(cfg, fam), cfg.moe_num_experts
  per_layer = [t for t in fam.tensors if "{i}" in t.hf]
  out = [
    _param(t, vals, None, e) for t in fam.tensors if "{i}" not in t.hf and _holds(cfg, t, None)
  ]
  for i in range(cfg.num_layers):
    out += [_param(t, vals, i, e) for t in per_layer if _holds(cfg, t, i)]
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
    raise MissingCheckpointFileError(
      f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found (directory holds "
      f"{sorted(os.listdir(path))}); only safetensors weights can be loaded"
    )
  infos: dict[str, _TensorInfo] = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.exists(file):
      raise MissingCheckpointFileError(
        f"{index} lists weight file {name}, which does not exist in {path}"
      )
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


def _config_json(path: str, no_dir: str) -> tuple[str, Any]:
  """(path, JSON value) of the config.json of directory `path`; FileNotFoundError `no_dir` when
  there is no such directory, or naming config.json when it lacks one."""
  if not os.path.isdir(path):
    raise MissingCheckpointFileError(no_dir)
  cfg_file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(cfg_file):
    raise MissingCheckpointFileError(
      f"{cfg_file} not found: a Hugging Face checkpoint needs config.json"
    )
  return cfg_file, _read_json(cfg_file)


def _load_config(path: str, overrides: Mapping[str, Any]) -> tuple[ModelConfig, Family, str]:
  """(ModelConfig with `overrides`, family, config.json path) of checkpoint directory `path`."""
  cfg_file, hf = _config_json(path, f"{path}: no such checkpoint directory")
  cfg = config_from_hf(hf, source=cfg_file)
  if overrides:
    try:
      cfg = dataclasses.replace(cfg, **overrides)
    except ValueError as e:
      raise CheckpointFormatError(f"{cfg_file}: {e}") from None
  return cfg, BY_MODEL_TYPE[hf["model_type"]], cfg_file


def _placements(cfg: ModelConfig, mesh, rules) -> tuple[dict, dict]:
  """(shape, sharding) of every parameter of `cfg`, by path: on `mesh` under the logical-axis
  `rules`, or without a mesh on the first local device."""
  abstract = abstract_params(cfg)
  shapes = {k: v.shape for k, v in _flatten(nn.unbox(abstract)).items()}
  if mesh is None:
    return shapes, dict.fromkeys(shapes, SingleDeviceSharding(jax.local_devices()[0]))
  rules = sharding_lib.rules_from_config(rules)
  return shapes, _flatten(sharding_lib.param_shardings(abstract, mesh, rules))


def _read_entry(reader: _Reader, entry: _Entry, shape, target, sharding) -> jax.Array:
  """One parameter of our layout; a layered one read a layer at a time, stacked on device."""
  if not entry.layered:
    return _read_param(reader, entry.parts[0], shape, target, sharding)
  layer = scan_lib.layer_sharding(sharding)
  pieces = [_read_param(reader, p, shape[1:], target, layer) for p in entry.parts]
  return jax.jit(jnp.stack, out_shardings=sharding)(pieces)


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
  given = (("param_dtype", param_dtype), ("dtype", dtype), ("scan_layers", scan_layers))
  cfg, fam, cfg_file = _load_config(path, {k: v for k, v in given if v is not None})
  params_map = _param_map(cfg, fam)
  infos, listing = _tensor_infos(path)
  _check_tensors(params_map, infos, listing, cfg_file, cfg.tie_embeddings)

  shapes, shardings = _placements(cfg, mesh, rules)
  target = np.dtype(cfg.weight_dtype)
  out: dict[tuple[str, ...], jax.Array] = {}
  with _Reader(infos) as reader:
    for e in _entries(cfg, params_map):
      out[e.path] = _read_entry(reader, e, shapes[e.path], target, shardings[e.path])
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
  cfg_file, hf = _config_json(path, f"{path}: no such Hugging Face checkpoint directory")
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
    raise MissingCheckpointFileError(f"{tokenizer}: no such tokenizer directory or file")
  names = _tokenizer_files(tokenizer)
  if not names:
    raise MissingCheckpointFileError(
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


def _check_save_args(dtype: str, max_position_embeddings: Any) -> None:
  """Raises ValueError for a storage dtype or context length that `save_checkpoint` refuses."""
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype={dtype!r} must be one of {list(_SAVE_DTYPES)}")
  if max_position_embeddings is not None and not (
    isinstance(max_position_embeddings, int)
    and not isinstance(max_position_embeddings, bool)
    and max_position_embeddings >= 1
  ):
    raise ValueError(f"max_position_embeddings={max_position_embeddings!r} must be an int >= 1")


def _export_config(
  cfg: ModelConfig,
  mt: str,
  source: HFSource | None,
  dtype: str,
  max_position_embeddings: int | None,
  hf_overrides: Mapping[str, Any] | None,
) -> dict[str, Any]:
  """The config.json of an export: `cfg` as `mt`, the source's carried fields, the overrides."""
  fields = dict(source.fields) if source is not None else {}
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
  return hf


def _check_params(cfg: ModelConfig, flat: Mapping, entries: list[_Entry], mt: str) -> None:
  """Raises ValueError naming a parameter of the wrong shape, a missing one or one that `mt`
  cannot store (a value head is only warned about: it is not exported)."""
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


def _clear_weights(path: str, overwrite: bool, writer: bool) -> None:
  """Refuses a directory holding weights unless `overwrite`; then (`writer` only) creates it and
  removes the old weights."""
  old = glob.glob(os.path.join(path, "model*.safetensors")) + glob.glob(
    os.path.join(path, INDEX_FILE)
  )
  if old and not overwrite:
    raise FileExistsError(f"{path} already holds weights ({sorted(old)}); pass overwrite=True")
  if writer:
    os.makedirs(path, exist_ok=True)
    for f in old:
      os.remove(f)


class _ShardWriter:
  """Collects tensors into safetensors shards of at most `max_bytes` (written by the `writer`
  process only); `close` gives them Hugging Face's names and writes the index if there are several."""

  def __init__(self, path: str, max_bytes: int, writer: bool):
    self.path, self.max_bytes, self.writer = path, max_bytes, writer
    self.shards: list[list[str]] = []
    self.current: dict[str, np.ndarray] = {}
    self.size = self.total = 0

  def add(self, name: str, t: np.ndarray) -> None:
    """Adds tensor `name`, starting a new shard first if it would overflow the current one."""
    if self.current and self.size + t.nbytes > self.max_bytes:
      self._flush()
    self.current[name] = t
    self.size += t.nbytes
    self.total += t.nbytes

  def _flush(self) -> None:
    from safetensors.numpy import save_file

    if not self.current:
      return
    if self.writer:
      tmp = os.path.join(self.path, f"shard-{len(self.shards)}.tmp")
      save_file(self.current, tmp, metadata={"format": "pt"})
    self.shards.append(list(self.current))
    self.current, self.size = {}, 0

  def close(self) -> None:
    """Writes the last shard, renames them all and writes the index."""
    self._flush()
    if not self.writer:
      return
    n = len(self.shards)
    names = (
      [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for i, name in enumerate(names):
      os.replace(os.path.join(self.path, f"shard-{i}.tmp"), os.path.join(self.path, name))
    if n > 1:
      weight_map = {t: names[i] for i, shard in enumerate(self.shards) for t in shard}
      with open(os.path.join(self.path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)


def _write_params(
  shards: _ShardWriter, cfg: ModelConfig, params_map: list[_Param], flat: Mapping, dtype: str
) -> None:
  """Adds every HF tensor to `shards` in HF order, a scanned parameter one layer at a time off
  the device."""
  np_dtype = _SAVE_DTYPES[dtype]
  for p in params_map:
    at = scan_lib.scanned_path(cfg, p.path) if cfg.scan_layers else None
    host = _to_host(flat[p.path] if at is None else flat[at[0]][at[1]])
    for e, name in enumerate(p.names):
      shards.add(name, p.to_hf(host[e] if p.stacked else host).astype(np_dtype))
    del host


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
  _check_save_args(dtype, max_position_embeddings)
  if source is not None and not isinstance(source, HFSource):
    source = read_source(source)
  mt = model_type or default_model_type(cfg)
  hf = _export_config(cfg, mt, source, dtype, max_position_embeddings, hf_overrides)
  generation = _generation_config(hf, source)
  tokenizer_files = _tokenizer_sources(tokenizer, source)
  params_map = _param_map(cfg, BY_MODEL_TYPE[mt])
  flat = _flatten(params)
  _check_params(cfg, flat, _entries(cfg, params_map), mt)

  writer = jax.process_index() == 0
  _clear_weights(path, overwrite, writer)
  shards = _ShardWriter(path, max_shard_bytes, writer)
  _write_params(shards, cfg, params_map, flat, dtype)
  shards.close()
  if writer:
    _write_json(os.path.join(path, GENERATION_CONFIG_FILE), generation)
    for src, name in tokenizer_files:
      _copy(src, os.path.join(path, name))
    _write_json(os.path.join(path, CONFIG_FILE), hf)
  return mt


# --------------------------------------------------------------------------- adapters (PEFT)

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def _adapter_tensors(cfg: ModelConfig, mt: str, flat: Mapping) -> dict[str, np.ndarray]:
  """PEFT's tensors of the adapters in `flat`: for each adapted HF module `M`,
  `base_model.model.M.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], float32."""
  out: dict[str, np.ndarray] = {}
  for p in _param_map(cfg, BY_MODEL_TYPE[mt]):
    if not p.linear or p.stacked or p.path[-1] != "kernel":
      continue
    at = scan_lib.scanned_path(cfg, p.path) if cfg.scan_layers else None
    owner = p.path[:-1] if at is None else at[0][:-1]
    if (*owner, "lora_a") not in flat:
      continue
    a, b = (_to_host(flat[(*owner, n)]) for n in ("lora_a", "lora_b"))
    if at is not None:
      a, b = a[at[1]], b[at[1]]
    module = p.names[0].removesuffix(".weight")
    out_dim, in_dim = p.hf_shape
    out[f"base_model.model.{module}.lora_A.weight"] = a.reshape(in_dim, -1).T.astype(np.float32)
    out[f"base_model.model.{module}.lora_B.weight"] = b.reshape(-1, out_dim).T.astype(np.float32)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_adapters(
  path: str | os.PathLike,
  cfg: ModelConfig,
  params: Any,
  *,
  model_type: str | None = None,
  base_model: str | None = None,
  overwrite: bool = False,
) -> list[str]:
  """Writes the adapters of `params` (a model with `cfg.lora_rank` > 0) in PEFT's LoRA format:
  `adapter_model.safetensors` and `adapter_config.json` (r, lora_alpha, the adapted modules as
  `target_modules`, `base_model` as `base_model_name_or_path`), loadable with
  `peft.PeftModel.from_pretrained` on the Hugging Face export of the base. Returns the
  target modules."""
  from safetensors.numpy import save_file

  if not cfg.lora_rank:
    raise ValueError("save_adapters: the model has no adapters (model.lora_rank=0)")
  path, mt = os.fspath(path), model_type or default_model_type(cfg)
  tensors = _adapter_tensors(cfg, mt, _flatten(params))
  if not tensors:
    raise ValueError(f"save_adapters: no adapter of these params maps to a {mt} module")
  if os.path.exists(os.path.join(path, ADAPTER_WEIGHTS_FILE)) and not overwrite:
    raise FileExistsError(f"{path} already holds {ADAPTER_WEIGHTS_FILE}; pass overwrite=True")
  # Two trailing name parts (`self_attn.q_proj`, `mlp.gate_proj`): PEFT matches a module whose
  # name ends in one, so routed experts (`mlp.experts.0.gate_proj`) get none.
  targets = sorted({".".join(k.split(".")[-4:-2]) for k in tensors})
  if jax.process_index() == 0:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model,
      "r": cfg.lora_rank,
      "lora_alpha": cfg.lora_alpha,
      "lora_dropout": cfg.lora_dropout,
      "target_modules": targets,
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "modules_to_save": None,
      "init_lora_weights": True,
      "inference_mode": True,
    }
    _write_json(os.path.join(path, ADAPTER_CONFIG_FILE), adapter_config)
  return targets


def _adapter_config(path: str) -> dict[str, Any]:
  """`adapter_config.json` of a PEFT LoRA directory, refused where this model cannot run it."""
  config = _read_json(os.path.join(path, ADAPTER_CONFIG_FILE))
  unsupported = {
    "peft_type": ("LORA", config.get("peft_type")),
    "bias": ("none", config.get("bias", "none")),
    "use_dora": (False, bool(config.get("use_dora"))),
    "use_rslora": (False, bool(config.get("use_rslora"))),
    "fan_in_fan_out": (False, bool(config.get("fan_in_fan_out"))),
    "rank_pattern": ({}, config.get("rank_pattern") or {}),
    "alpha_pattern": ({}, config.get("alpha_pattern") or {}),
  }
  for key, (want, got) in unsupported.items():
    if got != want:
      raise CheckpointFormatError(
        f"{path}/{ADAPTER_CONFIG_FILE}: {key}={got!r}; only plain LoRA ({key}={want!r}) runs here"
      )
  return config


def load_adapters(path: str | os.PathLike, cfg: ModelConfig, params: Any, *, model_type=None):
  """PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) put on `params`
  of `cfg` (the base's model, without adapters). Returns (the ModelConfig with the adapters'
  rank, alpha and targets, the parameters with adapters); a targeted projection that PEFT did
  not adapt (e.g. outside `layers_to_transform`) gets a zero adapter."""
  from safetensors.numpy import load_file

  path, mt = os.fspath(path), model_type or default_model_type(cfg)
  config = _adapter_config(path)
  tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS_FILE))
  modules = sorted({k.split(".")[-3] for k in tensors if k.endswith(".lora_A.weight")})
  names = [lora_lib.HF_NAMES.get(m, m) for m in modules]
  adapted = dataclasses.replace(
    cfg,
    lora_rank=int(config["r"]),
    lora_alpha=float(config["lora_alpha"]),
    lora_dropout=float(config.get("lora_dropout") or 0.0),
    lora_targets=",".join(names),
  )
  flat = _flatten(params)
  shapes = {k: v.shape for k, v in _flatten(nn.unbox(abstract_params(adapted))).items()}
  out = {k: np.zeros(v, np.float32) for k, v in shapes.items() if lora_lib.is_adapter(k)}
  for p in _param_map(adapted, BY_MODEL_TYPE[mt]):
    module = p.names[0].removesuffix(".weight")
    a, b = (tensors.get(f"base_model.model.{module}.lora_{n}.weight") for n in "AB")
    if a is None or b is None or p.stacked:
      continue
    at = scan_lib.scanned_path(adapted, p.path) if adapted.scan_layers else None
    owner = p.path[:-1] if at is None else at[0][:-1]
    for name, value in (("lora_a", a.T), ("lora_b", b.T)):  # ours: [in..., r] and [r, out...]
      target = out[(*owner, name)]
      (target if at is None else target[at[1]])[...] = value.reshape(target.shape[at is not None :])
  flat.update({k: jnp.asarray(v) for k, v in out.items()})
  return adapted, _unflatten(flat)


def weights_digest(path: str | os.PathLike) -> str:
  """A BLAKE2b digest of a checkpoint directory's weight files (names and bytes, in name
  order): two checkpoints of the same shapes but other weights differ in it."""
  import hashlib

  digest = hashlib.blake2b(digest_size=16)
  for file in sorted(glob.glob(os.path.join(os.fspath(path), "*.safetensors"))):
    digest.update(os.path.basename(file).encode())
    with open(file, "rb") as f:
      while chunk := f.read(1 << 24):
        digest.update(chunk)
  return digest.hexdigest()
