"""Where our parameters live in a Hugging Face checkpoint directory, for `hf` (import),
`hf_export` and `hf_adapters`: the directory's file names, the map between its tensors and our
parameter paths, and the small tree, JSON and host-copy helpers the three share.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` listed in `model.safetensors.index.json`.

Tensor layouts (Hugging Face linear weights are [out, in]; ours are [in, out] split by head):
  q_proj [H·Dh, D]  -> attn/q/kernel [D, H, Dh]     (k_proj, v_proj: J heads)
  o_proj [D, H·Dh]  -> attn/o/kernel [H, Dh, D]
  gate/up_proj [F, D] -> mlp/{gate,up}/kernel [D, F];  down_proj [D, F] -> mlp/down/kernel [F, D]
  experts.{e}.*     -> moe/{gate,up} [E, D, F], moe/down [E, F, D] (stacked over experts)
  router [E, D]     -> moe/router/kernel [D, E];  lm_head [V, D] -> lm_head/kernel [D, V]
RoPE is the half-split (rotate_half) convention of both code bases, so q/k need no permutation.
Each family's tensor names and shapes come from its row's tensor map (`families.Tensor`).
With scanned layers (`ModelConfig.scan_layers`), layer i's `layer_{i}/X` is slice i // p of
`layers/block_{i % p}/X` (p = `scan_period`, see `models.scan`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxrl_llm import paths
from jaxrl_llm.models import scan as scan_lib
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, Tensor
from jaxrl_llm.models.hf_config import CheckpointFormatError

__all__ = [
  "CONFIG_FILE",
  "GENERATION_CONFIG_FILE",
  "INDEX_FILE",
  "SINGLE_FILE",
  "TOKENIZER_FILES",
  "Entry",
  "Param",
  "flatten",
  "param_entries",
  "param_map",
  "read_json",
  "scanned_at",
  "to_host",
  "tokenizer_files",
  "unflatten",
  "write_json",
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


def tokenizer_files(path: str) -> tuple[str, ...]:
  """The `TOKENIZER_FILES` that directory `path` holds."""
  return tuple(n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n)))


def trainer_workdir(path: str) -> str | None:
  """Why directory `path` is a trainer workdir (a checkpoints/ directory, a run record
  config.json: one holding a 'config' object), or None when it is not one."""
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return "it holds checkpoints/"
  if has_run_record(path):
    return "its config.json is a run record"
  return None


def file_given(path: str, then: str = "") -> str:
  """The words refusing the file `path` where a checkpoint directory is wanted: a GGUF file's
  `import-gguf` command (followed by `then`), else the folder holding config.json beside it."""
  import gguf

  try:
    with open(path, "rb") as f:
      is_gguf = f.read(4) == gguf.GGUF_MAGIC.to_bytes(4, "little")
  except OSError:  # unreadable: refused as a file all the same
    is_gguf = False
  if is_gguf:
    return (
      "is a GGUF file, not a checkpoint directory; make one with: python tools/hf_convert.py "
      f"import-gguf {shlex.quote(path)} OUT_DIR{', then ' + then if then else ''}"
    )
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isfile(os.path.join(folder, "config.json")):
    return f"is a file, not a checkpoint directory; its folder holds config.json: {folder!r}"
  return "is a file, not a checkpoint directory (config.json + *.safetensors)"


def adapters_given(path: str) -> str | None:
  """The words refusing directory `path` (no config.json) when it holds PEFT adapters
  (adapter_config.json): their base model and what to point it at, as RL cannot start
  from adapters; None when it holds none."""
  try:
    with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
      base = json.load(f).get("base_model_name_or_path")
    named = f"its base model: {base!r}" if isinstance(base, str) and base else ""
  except FileNotFoundError:
    return None
  except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
    named = "its base model is unknown (adapter_config.json is not readable JSON)"
  named = named or "its adapter_config.json names no base model (base_model_name_or_path)"
  return (
    "is a PEFT adapter folder (adapter_config.json, no config.json), not a Hugging Face "
    f"checkpoint; {named}; RL cannot start from adapters: point it at the base model "
    "(new adapters train with model.lora_rank > 0), or at a checkpoint with the adapters "
    "merged (peft's merge_and_unload(), then save_pretrained); "
    "jaxrl_llm.models.hf_adapters.load_adapters reads adapters from Python"
  )


def has_run_record(path: str) -> bool:
  """Whether directory `path` holds a run record config.json (one with a 'config' object)."""
  try:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError):  # absent, or not JSON: no run record
    return False
  return isinstance(record, dict) and isinstance(record.get("config"), dict)


# --------------------------------------------------------------------------- tensor map


@dataclasses.dataclass(frozen=True)
class Param:
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


def _param(t: Tensor, vals: Mapping[str, int], layer: int | None, num_experts: int) -> Param:
  """Tensor `t` (of `layer`, for a per-layer tensor) as a `Param` with concrete names and shape."""
  stacked = "{e}" in t.hf
  names = tuple(t.hf.format(i=layer, e=e) for e in range(num_experts if stacked else 1))
  shape = tuple(math.prod(vals[f] for f in dim.split("*")) for dim in t.shape)
  described = ", ".join(f"{n}={vals[n]}" for n in t.fields)
  path = tuple(t.ours.format(i=layer).split("/"))
  return Param(path, names, shape, described, t.linear, stacked)


def param_map(cfg: ModelConfig, fam: Family) -> list[Param]:
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
class Entry:
  """One parameter of the model and the `Param`s it is made of: one, or with scanned layers
  (`ModelConfig.scan_layers`) one per step of the scan, stacked on a leading layer axis."""

  path: tuple[str, ...]  # our parameter path
  parts: tuple[Param, ...]  # in the order of the leading layer axis when `layered`
  layered: bool = False


def param_entries(cfg: ModelConfig, params: list[Param]) -> list[Entry]:
  """The parameters of `cfg`'s layout (unrolled or scanned) built from the per-layer map."""
  if not cfg.scan_layers:
    return [Entry(p.path, (p,)) for p in params]
  out: dict[tuple[str, ...], dict[int, Param]] = {}
  plain: list[Entry] = []
  for p in params:
    target = scan_lib.scanned_path(cfg, p.path)
    if target is None:
      plain.append(Entry(p.path, (p,)))
    else:
      out.setdefault(target[0], {})[target[1]] = p
  layered = [Entry(k, tuple(v[g] for g in sorted(v)), True) for k, v in out.items()]
  return plain + layered


def scanned_at(cfg: ModelConfig, path: tuple[str, ...]) -> tuple[tuple[str, ...], int] | None:
  """(scanned path, layer index) holding the unrolled parameter `path` when `cfg` scans its
  layers and `path` is in a block; None otherwise (the parameter is stored under `path`)."""
  return scan_lib.scanned_path(cfg, path) if cfg.scan_layers else None


# --------------------------------------------------------------------------- shared helpers


def flatten(tree: Any) -> dict[tuple[str, ...], Any]:
  """The leaves of a nested dict tree by their key paths."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(k.key for k in path): leaf for path, leaf in leaves}


def unflatten(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
  """The nested dict tree of leaves keyed by their paths (the inverse of `flatten`)."""
  out: dict[str, Any] = {}
  for path, leaf in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = leaf
  return out


def read_json(path: str) -> Any:
  """The JSON value of `path`; CheckpointFormatError naming the file if it is not JSON."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None


def write_json(path: str, content: Mapping[str, Any]) -> None:
  """Writes `content` as indented JSON with sorted keys and a final newline, whole or not at all
  (`paths.write_text`)."""
  paths.write_text(path, json.dumps(content, indent=2, sort_keys=True) + "\n")


def to_host(x: Any) -> np.ndarray:
  """A full host copy of one (possibly multi-host sharded) array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)
