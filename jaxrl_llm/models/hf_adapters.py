"""LoRA adapters in PEFT's format, beside a Hugging Face checkpoint of their base.

`save_adapters` writes `adapter_model.safetensors` and `adapter_config.json`, which
`peft.PeftModel.from_pretrained` loads on the `hf_export` of the base; `load_adapters` puts such
adapters on a base model loaded by `hf.load_checkpoint`. For every adapted HF module `M`, PEFT
stores `base_model.model.M.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]; ours are
`lora_a` [in..., r] and `lora_b` [r, out...] beside the kernel they adapt (`models.lora`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxrl_llm import paths
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import BY_MODEL_TYPE, default_model_type
from jaxrl_llm.models.hf import abstract_params, read_tensors
from jaxrl_llm.models.hf_config import CheckpointFormatError
from jaxrl_llm.models.hf_layout import (
  Param,
  flatten,
  param_map,
  read_json,
  scanned_at,
  to_host,
  unflatten,
  write_json,
)

__all__ = [
  "ADAPTER_CONFIG_FILE",
  "ADAPTER_WEIGHTS_FILE",
  "check_adapters",
  "load_adapters",
  "save_adapters",
]

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def _adapter_owner(cfg: ModelConfig, p: Param) -> tuple[tuple[str, ...], int | None]:
  """(path of the module holding `p`'s adapters, layer index in a scanned parameter or None)."""
  at = scanned_at(cfg, p.path)
  return (p.path[:-1], None) if at is None else (at[0][:-1], at[1])


def _adapter_tensors(cfg: ModelConfig, mt: str, flat: Mapping) -> dict[str, np.ndarray]:
  """PEFT's tensors of the adapters in `flat`: for each adapted HF module `M`,
  `base_model.model.M.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], float32."""
  out: dict[str, np.ndarray] = {}
  for p in param_map(cfg, BY_MODEL_TYPE[mt]):
    if not p.linear or p.stacked or p.path[-1] != "kernel":
      continue
    owner, layer = _adapter_owner(cfg, p)
    if (*owner, "lora_a") not in flat:
      continue
    a, b = (to_host(flat[(*owner, n)]) for n in ("lora_a", "lora_b"))
    if layer is not None:
      a, b = a[layer], b[layer]
    module = p.names[0].removesuffix(".weight")
    out_dim, in_dim = p.hf_shape
    out[f"base_model.model.{module}.lora_A.weight"] = a.reshape(in_dim, -1).T.astype(np.float32)
    out[f"base_model.model.{module}.lora_B.weight"] = b.reshape(-1, out_dim).T.astype(np.float32)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _peft_config(cfg: ModelConfig, base_model: str | None, targets: list[str]) -> dict[str, Any]:
  """The `adapter_config.json` of plain LoRA adapters of `cfg` on the `targets` modules."""
  return {
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

  path = os.fspath(path)
  tensors, targets = _prepare(path, cfg, params, model_type, overwrite)
  if jax.process_index() == 0:
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f".{ADAPTER_WEIGHTS_FILE}.tmp")
    try:  # written beside, then moved in: an interrupted export leaves the adapters there before
      save_file(tensors, tmp, metadata={"format": "pt"})
      paths.publish(tmp, os.path.join(path, ADAPTER_WEIGHTS_FILE))
    except BaseException:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise
    write_json(os.path.join(path, ADAPTER_CONFIG_FILE), _peft_config(cfg, base_model, targets))
  return targets


def _prepare(path: str, cfg: ModelConfig, params: Any, model_type: str | None, overwrite: bool):
  """Every check of `save_adapters`, writing nothing; returns (PEFT's tensors, the target
  modules)."""
  if not cfg.lora_rank:
    raise ValueError("save_adapters: the model has no adapters (model.lora_rank=0)")
  mt = model_type or default_model_type(cfg)
  tensors = _adapter_tensors(cfg, mt, flatten(params))
  if not tensors:
    raise ValueError(f"save_adapters: no adapter of these params maps to a {mt} module")
  if os.path.lexists(path) and not os.path.isdir(path):
    raise NotADirectoryError(f"{path}: is a file, not a directory")
  for name in (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE):  # either would be replaced
    if os.path.lexists(os.path.join(path, name)) and not overwrite:
      raise FileExistsError(f"{path} already holds {name}; pass overwrite=True")
  # Two trailing name parts (`self_attn.q_proj`, `mlp.gate_proj`): PEFT matches a module whose
  # name ends in one, so routed experts (`mlp.experts.0.gate_proj`) get none.
  return tensors, sorted({".".join(k.split(".")[-4:-2]) for k in tensors})


def check_adapters(
  path: str | os.PathLike,
  cfg: ModelConfig,
  params: Any,
  *,
  model_type: str | None = None,
  overwrite: bool = False,
) -> list[str]:
  """Raises what `save_adapters` with the same arguments would, writing nothing; returns the
  target modules."""
  return _prepare(os.fspath(path), cfg, params, model_type, overwrite)[1]


def _adapter_config(path: str) -> dict[str, Any]:
  """`adapter_config.json` of a PEFT LoRA directory, refused where this model cannot run it."""
  where = os.path.join(path, ADAPTER_CONFIG_FILE)
  if not os.path.isfile(where):
    raise CheckpointFormatError(f"{where}: no such file; a PEFT LoRA directory holds one")
  config = read_json(where)
  if not isinstance(config, dict):
    raise CheckpointFormatError(f"{where}: not a JSON object (PEFT's adapter config)")
  r, alpha = config.get("r"), config.get("lora_alpha")
  if type(r) is not int or r < 1:
    raise CheckpointFormatError(f"{where}: r={r!r}; the rank is a whole number >= 1")
  if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not np.isfinite(alpha):
    raise CheckpointFormatError(f"{where}: lora_alpha={alpha!r}; it is a finite number")
  unsupported = {
    "peft_type": ("LORA", config.get("peft_type")),
    "bias": ("none", config.get("bias", "none")),
    "use_dora": (False, bool(config.get("use_dora"))),
    "use_rslora": (False, bool(config.get("use_rslora"))),
    "lora_bias": (False, bool(config.get("lora_bias"))),  # lora_B.bias tensors
    "fan_in_fan_out": (False, bool(config.get("fan_in_fan_out"))),
    "rank_pattern": ({}, config.get("rank_pattern") or {}),
    "alpha_pattern": ({}, config.get("alpha_pattern") or {}),
  }
  for key, (want, got) in unsupported.items():
    if got != want:
      raise CheckpointFormatError(
        f"{path}/{ADAPTER_CONFIG_FILE}: {key}={got!r}; only plain LoRA ({key}={want!r}) runs here"
      )
  dropout = config.get("lora_dropout") or 0.0
  if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
    raise CheckpointFormatError(f"{where}: lora_dropout={dropout!r}; it is a number in [0, 1)")
  return config


def _check_scope(where: str, config: Mapping, tensors: Mapping, num_layers: int) -> None:
  """CheckpointFormatError for an adapter_config.json whose target_modules (a list; PEFT skips
  an entry no module matches while another does) or layers_to_transform do not cover the saved
  tensors, or whose layers_to_transform names a layer this model lacks: PEFT applies no tensor
  outside them."""
  modules = {m.group(1) for key in tensors if (m := _PEFT_KEY.fullmatch(key))}
  targets = config.get("target_modules")
  if isinstance(targets, list):  # PEFT matches an entry as a module name's end
    targets = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
    if outside := sorted(m for m in modules if m.rsplit(".", 1)[-1] not in targets):
      raise CheckpointFormatError(
        f"{where}: the weights adapt {outside[0]}, outside target_modules={targets}"
      )
  layers = config.get("layers_to_transform")
  if layers is None:
    return
  layers = [layers] if isinstance(layers, int) else layers
  if not (isinstance(layers, list) and all(type(i) is int and 0 <= i < num_layers for i in layers)):
    raise CheckpointFormatError(
      f"{where}: layers_to_transform={config['layers_to_transform']!r}; allowed: layer indices "
      f"in [0, {num_layers})"
    )
  held = {int(m.group(1)) for x in modules if (m := re.search(r"\.layers\.(\d+)\.", x))}
  if outside := sorted(held - set(layers)):
    raise CheckpointFormatError(
      f"{where}: the weights adapt layer {outside[0]}, outside layers_to_transform={layers}"
    )


def _read_adapter_tensors(path: str) -> dict[str, np.ndarray]:
  """The tensors of `adapter_model.safetensors`: each a finite floating-point array (bfloat16
  ones through ml_dtypes, as the base's weights are read)."""
  if not os.path.isfile(path):
    raise CheckpointFormatError(f"{path}: no such file; a PEFT LoRA directory holds one")
  tensors = read_tensors(path)
  for name, value in tensors.items():
    if value.dtype.kind != "f" and value.dtype != ml_dtypes.bfloat16:
      raise CheckpointFormatError(
        f"{path}: tensor {name} holds dtype {value.dtype}; LoRA weights are floating-point "
        "(float64, float32, float16 or bfloat16)"
      )
  return tensors


_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # `mlp.experts.3.gate_proj`, `experts.0.w1`


def _refuse_expert_adapters(weights: str, tensors: Mapping) -> None:
  """Raises CheckpointFormatError when `tensors` adapt a routed expert (PEFT adapts every
  expert whose module name a target ends; this model adapts none)."""
  if keys := sorted(k for k in tensors if _ROUTED_EXPERT.search(k)):
    raise CheckpointFormatError(
      f"{weights}: tensor {keys[0]} adapts a routed expert; this model's adapters are on "
      "attention, dense MLP and shared-expert projections only (train the adapters without "
      "the experts' modules in target_modules)"
    )


_PEFT_KEY = re.compile(r"base_model\.model\.(.+)\.lora_[AB]\.weight")  # as PEFT saves them


def _adapted_projections(weights: str, tensors: Mapping) -> list[str]:
  """The projections (`q`, `gate`...) `tensors` adapt; a CheckpointFormatError naming the first
  tensor that is no saved PEFT LoRA weight (an adapter name left in, an embedding's) or that
  adapts a module other than those projections (`lm_head`, `embed_tokens`)."""
  allowed = ", ".join(f"{p}_proj" for p in lora_lib.PROJECTIONS)
  names = set()
  for key in sorted(tensors):
    if not (match := _PEFT_KEY.fullmatch(key)):
      named = re.search(r"\.lora_[AB]\.([^.]+)\.weight$", key)
      why = (
        f"keeps the adapter name {named.group(1)!r} of a model's state dict (PEFT's "
        "save_pretrained writes base_model.model.<module>.lora_A.weight)"
        if named
        else f"adapts an embedding; this model's adapters are on the projections {allowed} only"
        if ".lora_embedding_" in key
        else "is no LoRA weight PEFT saves (base_model.model.<module>.lora_A/lora_B.weight)"
      )
      raise CheckpointFormatError(f"{weights}: tensor {key} {why}")
    module = match.group(1).rsplit(".", 1)[-1]
    if module not in lora_lib.HF_NAMES:
      raise CheckpointFormatError(
        f"{weights}: tensor {key} adapts {module}; this model's adapters are on the "
        f"projections {allowed} only (train them without {module} in target_modules)"
      )
    names.add(lora_lib.HF_NAMES[module])
  return sorted(names)


def _adapted(where: str, cfg: ModelConfig, config: Mapping, tensors: Mapping, names: list) -> Any:
  """`cfg` with the adapters' rank, alpha, dropout and targets (`names`), once their scope is
  checked; CheckpointFormatError naming `where` (adapter_config.json) when they do not fit."""
  _check_scope(where, config, tensors, cfg.num_layers)
  try:
    return dataclasses.replace(
      cfg,
      lora_rank=int(config["r"]),
      lora_alpha=float(config["lora_alpha"]),
      lora_dropout=float(config.get("lora_dropout") or 0.0),
      lora_targets=",".join(names),
    )
  except ValueError as e:  # a rank past a projection's width, say: said as the file's fields
    said = str(e).removeprefix("invalid model config: ")
    for ours, theirs in (("lora_rank", "r"), ("lora_alpha", "lora_alpha")):
      said = said.replace(f"model.{ours}=", f"{theirs}=")
    raise CheckpointFormatError(f"{where}: does not fit this model: {said}") from None


def load_adapters(path: str | os.PathLike, cfg: ModelConfig, params: Any, *, model_type=None):
  """PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) put on `params`
  of `cfg` (the base's model, without adapters). Returns (the ModelConfig with the adapters'
  rank, alpha and targets, the parameters with adapters); a targeted projection that PEFT did
  not adapt (e.g. outside `layers_to_transform`) gets a zero adapter."""
  path, mt = os.fspath(path), model_type or default_model_type(cfg)
  config = _adapter_config(path)
  tensors = _read_adapter_tensors(os.path.join(path, ADAPTER_WEIGHTS_FILE))
  _refuse_expert_adapters(os.path.join(path, ADAPTER_WEIGHTS_FILE), tensors)
  names = _adapted_projections(os.path.join(path, ADAPTER_WEIGHTS_FILE), tensors)
  adapted = _adapted(os.path.join(path, ADAPTER_CONFIG_FILE), cfg, config, tensors, names)
  flat = flatten(params)
  shapes = {k: v.shape for k, v in flatten(nn.unbox(abstract_params(adapted))).items()}
  out = {k: np.zeros(v, np.float32) for k, v in shapes.items() if lora_lib.is_adapter(k)}
  weights, used = os.path.join(path, ADAPTER_WEIGHTS_FILE), set()
  for p in param_map(adapted, BY_MODEL_TYPE[mt]):
    if p.stacked:  # routed experts: their adapters were refused above
      continue
    module = p.names[0].removesuffix(".weight")
    keys = [f"base_model.model.{module}.lora_{n}.weight" for n in "AB"]
    a, b = (tensors.get(k) for k in keys)
    if (a is None) != (b is None):
      raise CheckpointFormatError(f"{weights}: {keys[a is not None]} is missing beside its pair")
    used.update(keys)
    if a is None:
      continue
    owner, layer = _adapter_owner(adapted, p)
    (out_dim, in_dim), r = p.hf_shape, adapted.lora_rank  # PEFT's: A [r, in], B [out, r]
    for key, name, value, want in (
      (keys[0], "lora_a", a.T, (r, in_dim)),
      (keys[1], "lora_b", b.T, (out_dim, r)),
    ):
      target = out[(*owner, name)]  # ours: [in..., r] and [r, out...]
      slot = target if layer is None else target[layer]
      if tuple(value.T.shape) != want or value.size != slot.size:  # a transposed one too
        raise CheckpointFormatError(
          f"{weights}: tensor {key} has shape {list(value.T.shape)}, which does not fit this "
          f"model's {module} at r={r} (want {list(want)})"
        )
      slot[...] = value.reshape(slot.shape)
  if unused := sorted(set(tensors) - used):
    raise CheckpointFormatError(
      f"{weights}: tensor {unused[0]} ({len(unused)} in all) matches no projection of this "
      f"model ({cfg.num_layers} layers)"
    )
  flat.update({k: jnp.asarray(v) for k, v in out.items()})
  return adapted, unflatten(flat)
