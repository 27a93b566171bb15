"""A run that starts from a Hugging Face checkpoint (`model.checkpoint`): the checks made
before its weights load (a checkpoint directory, the context), its architecture with the
config's fields on it, its weights and its `model_type`."""

from __future__ import annotations

import json
import os
from typing import Any

from jax.sharding import Mesh

from jaxrl_llm.config import Config, ConfigError, checks
from jaxrl_llm.config.fields import invalid
from jaxrl_llm.models.config import ModelConfig


def check_dir(path: str) -> None:
  """`model.checkpoint` (when set) holds a config.json and is no trainer workdir (before the task)."""
  from jaxrl_llm.models import hf_layout, pretrained

  if path and (why := hf_layout.trainer_workdir(path)):
    raise ConfigError(
      f"model.checkpoint={path!r} is a trainer workdir ({why}), not a Hugging Face checkpoint; "
      f"export one with: python tools/hf_convert.py export --workdir={path} --out=HF_DIR"
    )
  if path and os.path.isfile(path):
    said = hf_layout.file_given(path, then="--config.model.checkpoint=OUT_DIR")
    raise ConfigError(f"model.checkpoint={path!r} {said}")
  if path and not os.path.isfile(os.path.join(path, "config.json")):
    if os.path.isdir(path) and (said := hf_layout.adapters_given(path)):
      raise ConfigError(f"model.checkpoint={path!r} {said}")
    what = "has no config.json" if os.path.isdir(path) else "is not a directory"
    fetched = {os.path.abspath(pretrained.model_dir(n)): n for n in pretrained.MODELS}
    hint = (  # a model `tools/get_smollm2.py` writes, not fetched yet
      "; fetch it first: python tools/get_smollm2.py" if os.path.abspath(path) in fetched else ""
    )
    raise ConfigError(
      f"model.checkpoint={path!r} {what}; point it at a local Hugging Face checkpoint "
      f"(config.json + *.safetensors){hint}"
    )


def check_context(cfg: Config, task, prompt_len: int) -> None:
  """With `model.checkpoint`: a ConfigError unless the prompt and the sampler's completion
  budget fit its context (config.json's max_position_embeddings; `checks.context`)."""
  if not cfg.model.checkpoint:
    return
  try:
    new_tokens = cfg.sampling.sampler(
      task, tool_timeout_s=cfg.data.verifier_timeout_s
    ).max_new_tokens
  except Exception:  # a sampler that cannot be built (a tool the task cannot take): `check`,
    return  # which runs with the checkpoint's architecture, names what is wrong in one line
  from jaxrl_llm.models import hf_config, hf_layout

  source = os.path.join(cfg.model.checkpoint, "config.json")
  hf = hf_layout.read_json(source)  # not JSON: one line naming the file, as the loader's
  limit = hf_config.carried_fields(hf, source=source).get("max_position_embeddings")
  errors = checks.context(cfg, prompt_len, new_tokens, limit, source)
  if errors:
    raise invalid(errors)


def architecture(cfg: Config) -> ModelConfig:
  """The ModelConfig of `model.checkpoint`'s config.json, with the config's dtypes and layout."""
  from jaxrl_llm.models import hf_config, hf_layout

  hf = hf_layout.read_json(os.path.join(cfg.model.checkpoint, "config.json"))  # not JSON: a line
  return _onto(cfg, hf_config.config_from_hf(hf, source=cfg.model.checkpoint))


def _onto(cfg: Config, mc: ModelConfig) -> ModelConfig:
  """The checkpoint's architecture with the config's fields on it (`ModelConfig.onto`); a field
  the checkpoint's sizes refuse (a LoRA rank over a projection's width) is a ConfigError."""
  try:
    return cfg.model.arch.onto(mc)
  except ValueError as e:
    raise ConfigError(f"{e} (model.checkpoint={cfg.model.checkpoint!r})") from None


def load(cfg: Config, mesh: Mesh, rules) -> tuple[ModelConfig, Any]:
  """(ModelConfig, params) of `model.checkpoint` (a Hugging Face directory)."""
  from jaxrl_llm.models import hf

  path, arch = cfg.model.checkpoint, cfg.model.arch
  mc, params = hf.load_checkpoint(
    path,
    mesh=mesh,
    rules=rules,
    param_dtype=arch.param_dtype,
    dtype=arch.dtype,
    scan_layers=arch.scan_layers,
  )
  return _onto(cfg, mc), params


def model_type(path: str) -> str:
  """The `model_type` of a Hugging Face checkpoint directory ("" when not starting from one)."""
  if not path:
    return ""
  with open(os.path.join(path, "config.json")) as f:
    return str(json.load(f).get("model_type", ""))
