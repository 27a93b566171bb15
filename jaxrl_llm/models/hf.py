"""Import of Hugging Face checkpoint directories of the families in `families.FAMILIES`.

`load_checkpoint` validates every tensor's presence, dtype and shape from the safetensors
headers first, then reads one tensor at a time and places it straight into its target sharding
(no host copy of the whole model); with scanned layers it stacks the layers on device, one
parameter at a time. Where each tensor goes is `hf_layout`'s tensor map; the config.json mapping
lives in `hf_config`. What a directory holds beside the architecture (context length and special
token ids in config.json, generation_config.json, the tokenizer files) is read by `read_source`,
for `hf_export.save_checkpoint(..., source=...)` to write back. `weights_digest` identifies a
directory's weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
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
from jaxrl_llm.models.families import BY_MODEL_TYPE, Family
from jaxrl_llm.models.hf_config import (
  CheckpointFormatError,
  MissingCheckpointFileError,
  carried_fields,
  config_from_hf,
)
from jaxrl_llm.models.hf_layout import (
  CONFIG_FILE,
  GENERATION_CONFIG_FILE,
  INDEX_FILE,
  SINGLE_FILE,
  Entry,
  Param,
  adapters_given,
  file_given,
  flatten,
  param_entries,
  param_map,
  read_json,
  tokenizer_files,
  unflatten,
)
from jaxrl_llm.models.transformer import Transformer

__all__ = [
  "HFSource",
  "abstract_params",
  "load_checkpoint",
  "read_source",
  "read_tensors",
  "weights_digest",
]

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


# --------------------------------------------------------------------------- tensor files


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
  file: str  # path of the safetensors file holding the tensor
  shape: tuple[int, ...]
  dtype: str  # safetensors dtype name: F32, BF16, I32, ...


def _file_infos(file: str) -> dict[str, _TensorInfo]:
  """Shape and dtype of every tensor of the safetensors file `file`, from its header."""
  from safetensors import safe_open

  with safe_open(file, framework="numpy") as f:
    slices = {key: f.get_slice(key) for key in f.keys()}
    return {k: _TensorInfo(file, tuple(s.get_shape()), s.get_dtype()) for k, s in slices.items()}


def _tensor_infos(path: str) -> tuple[dict[str, _TensorInfo], str]:
  """File, shape and dtype of every tensor (from the headers only), and the listing file."""
  index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
  weight_map = None
  if os.path.exists(index):
    listed = read_json(index)
    weight_map = listed.get("weight_map") if isinstance(listed, dict) else None
    if not isinstance(weight_map, dict):
      raise CheckpointFormatError(f"{index}: has no 'weight_map' dict")
    for key, name in weight_map.items():
      if not isinstance(name, str):
        raise CheckpointFormatError(
          f"{index}: weight_map[{key!r}]={name!r} must be the name of a safetensors file (a string)"
        )
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
      for key, info in _file_infos(file).items():
        if key in infos:
          raise CheckpointFormatError(f"tensor {key!r} is in both {infos[key].file} and {file}")
        infos[key] = info
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
  params: list[Param], infos: dict[str, _TensorInfo], listing: str, cfg_file: str, tied: bool
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
  more = f"; and {len(problems) - 1} more like it" if len(problems) > 1 else ""
  raise CheckpointFormatError(f"{head}: {problems[0]}{more}")  # one line: the first names it


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
    """The tensor `name` as a host array of its stored dtype; CheckpointFormatError naming the
    file and tensor if it holds a NaN or inf (which would only surface as a diverged run)."""
    info = self._infos[name]
    if info.dtype == "BF16":  # numpy has no bfloat16, so the numpy reader refuses it
      host = self._raw_bf16(name, info)
    else:
      if info.file not in self._files:
        from safetensors import safe_open

        self._files[info.file] = self._stack.enter_context(safe_open(info.file, framework="numpy"))
      host = self._files[info.file].get_tensor(name)
    if not np.isfinite(host).all():
      raise CheckpointFormatError(
        f"{info.file}: tensor {name} holds non-finite values (NaN or inf)"
      )
    return host


def read_tensors(file: str) -> dict[str, np.ndarray]:
  """Every tensor of the safetensors file `file` as a host array of its stored dtype (bfloat16
  through ml_dtypes, which safetensors' numpy reader refuses); CheckpointFormatError naming the
  file when it is unreadable or a tensor holds a NaN or inf."""
  try:
    infos = _file_infos(file)
  except Exception as e:  # the safetensors reader raises its own error types
    raise CheckpointFormatError(f"{file}: not a readable safetensors file ({e})") from None
  with _Reader(infos) as reader:
    return {name: reader.read(name) for name in infos}


def abstract_params(cfg: ModelConfig) -> Any:
  """The boxed (logically annotated) abstract parameter tree of `Transformer(cfg)`."""
  model = Transformer(cfg)
  tokens = jnp.zeros((1, 1), jnp.int32)
  init = lambda r: model.init(r, tokens, tokens, tokens >= 0)["params"]  # noqa: E731
  return jax.eval_shape(init, jax.random.PRNGKey(0))


def _read_param(reader: _Reader, p: Param, shape, target, sharding) -> jax.Array:
  """One parameter of our layout `shape`, read from its HF tensor(s) into `sharding`;
  CheckpointFormatError naming the tensor whose values the parameter's dtype cannot hold (a
  float64 1e300, a float32 1e6 read as float16)."""
  parts = []
  for name in p.names if p.stacked else p.names[:1]:
    with np.errstate(over="ignore"):  # said below, in one line
      part = p.to_ours(reader.read(name), shape[1:] if p.stacked else shape).astype(target)
    if not np.isfinite(part).all():
      raise CheckpointFormatError(
        f"{reader._infos[name].file}: tensor {name} holds values beyond the range of "
        f"{np.dtype(target).name}, the parameter dtype it is read as; allowed: a wider "
        "parameter dtype, or weights within its range"
      )
    parts.append(part)
  host = np.stack(parts) if p.stacked else parts[0]
  return jax.make_array_from_callback(shape, sharding, lambda i: host[i])


def _config_json(path: str, no_dir: str) -> tuple[str, Any]:
  """(path, JSON value) of the config.json of directory `path`; FileNotFoundError `no_dir` when
  there is no such directory, or naming config.json when it lacks one."""
  if os.path.isfile(path):  # a GGUF file, a file inside a checkpoint
    raise MissingCheckpointFileError(f"{path} {file_given(path)}")
  if not os.path.isdir(path):
    raise MissingCheckpointFileError(no_dir)
  cfg_file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(cfg_file) and (said := adapters_given(path)):
    raise MissingCheckpointFileError(f"{path} {said}")
  if not os.path.exists(cfg_file):
    raise MissingCheckpointFileError(
      f"{cfg_file} not found: a Hugging Face checkpoint needs config.json"
    )
  return cfg_file, read_json(cfg_file)


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
  shapes = {k: v.shape for k, v in flatten(nn.unbox(abstract)).items()}
  if mesh is None:
    return shapes, dict.fromkeys(shapes, SingleDeviceSharding(jax.local_devices()[0]))
  rules = sharding_lib.rules_from_config(rules)
  return shapes, flatten(sharding_lib.param_shardings(abstract, mesh, rules))


def _read_entry(reader: _Reader, entry: Entry, shape, target, sharding) -> jax.Array:
  """One parameter of our layout; a layered one read a layer at a time, stacked on device."""
  if not entry.layered:
    return _read_param(reader, entry.parts[0], shape, target, sharding)
  layer = scan_lib.layer_sharding(sharding)
  pieces = [_read_param(reader, p, shape[1:], target, layer) for p in entry.parts]
  return jax.jit(jnp.stack, out_shardings=sharding)(pieces)


def _check_layer_count(num_layers: int, infos: Mapping[str, Any], cfg_file: str) -> None:
  """CheckpointFormatError when config.json counts more layers than the weights hold (found
  before the tensor map is built layer by layer: 10**8 layers took longer than any wait)."""
  held = {int(m.group(1)) for n in infos if (m := re.match(r"model\.layers\.(\d+)\.", n))}
  if num_layers > len(held):
    raise CheckpointFormatError(
      f"{cfg_file}: num_hidden_layers={num_layers}, but the weights hold {len(held)} layers; "
      "allowed: the number of model.layers.<i> the weight files hold"
    )


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
  infos, listing = _tensor_infos(path)
  _check_layer_count(cfg.num_layers, infos, cfg_file)
  params_map = param_map(cfg, fam)
  _check_tensors(params_map, infos, listing, cfg_file, cfg.tie_embeddings)

  shapes, shardings = _placements(cfg, mesh, rules)
  target = np.dtype(cfg.weight_dtype)
  out: dict[tuple[str, ...], jax.Array] = {}
  with _Reader(infos) as reader:
    for e in param_entries(cfg, params_map):
      out[e.path] = _read_entry(reader, e, shapes[e.path], target, shardings[e.path])
  if set(out) != set(shapes):  # the tensor map covers the model exactly
    raise AssertionError(f"parameters not mapped: {sorted(set(shapes) ^ set(out))}")
  return cfg, unflatten(out)


# --------------------------------------------------------------------------- source metadata


@dataclasses.dataclass(frozen=True)
class HFSource:
  """What an export carries over from the Hugging Face directory a model was imported from."""

  path: str  # the directory
  model_type: Any  # its config.json's model_type (as written there)
  fields: dict[str, Any]  # the `CARRIED_FIELDS` its config.json holds
  generation_config: dict[str, Any] | None  # its generation_config.json, if it has one
  tokenizer_files: tuple[str, ...]  # the `TOKENIZER_FILES` it holds
  vocab_size: Any = None  # its config.json's vocab_size (as written there)


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
    generation = read_json(gen_file)
    if not isinstance(generation, dict):
      raise CheckpointFormatError(
        f"{gen_file}: holds a JSON {type(generation).__name__}, not an object"
      )
    carried_fields(
      {k: v for k, v in generation.items() if k != "max_position_embeddings"},
      source=gen_file,
      vocab=hf.get("vocab_size"),
    )
  return HFSource(
    path, hf.get("model_type"), fields, generation, tokenizer_files(path), hf.get("vocab_size")
  )


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
