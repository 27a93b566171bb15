"""Hugging Face config.json <-> ModelConfig for Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral.

Reads both spellings of RoPE settings (`rope_theta` + `rope_scaling` of transformers 4,
`rope_parameters` of transformers 5) and writes both. ModelConfig fields that config.json has no
name for (moe_impl, the z-loss coefficient, dtypes, ...) are written under the `jaxrl_llm` key
and restored on import, so a config survives export and import unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxrl_llm.models.config import ModelConfig

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
EXTRA_KEY = "jaxrl_llm"  # config.json key holding the ModelConfig fields HF has no name for
_ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "mixtral": "MixtralForCausalLM",
}
# Defaults of the reference configuration classes, used when config.json omits a field.
_DEFAULT_THETA = {"mixtral": 1e6}
_DEFAULT_EPS = {"mixtral": 1e-5}
_DEFAULT_MAX_POS = {
  "llama": 2048,
  "qwen2": 32768,
  "qwen3": 40960,
  "qwen3_moe": 32768,
  "mixtral": 131072,
}
_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
# config.json fields that an export copies from the checkpoint the model was imported from.
CARRIED_FIELDS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
_INT_FIELDS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
  "num_key_value_heads",
  "head_dim",
  "num_experts",
  "num_local_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "decoder_sparse_step",
)
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "router_aux_loss_coef")


class CheckpointFormatError(ValueError):
  """A Hugging Face checkpoint is malformed, unsupported, or disagrees with its config.json."""


# --------------------------------------------------------------------------- configs


def _rope_fields(hf: Mapping[str, Any], mt: str, errors: list[str]) -> dict[str, Any]:
  """RoPE fields from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4)."""
  key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  rp = hf.get(key) or {}
  if not isinstance(rp, Mapping) or any(isinstance(v, Mapping) for v in rp.values()):
    errors.append(f"{key}={rp!r} (per-layer-type RoPE parameters are not supported)")
    return {}
  theta = rp.get("rope_theta", hf.get("rope_theta")) or _DEFAULT_THETA.get(mt, 10_000.0)
  out: dict[str, Any] = {"rope_theta": float(theta)}
  partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    errors.append(f"partial_rotary_factor={partial} (only full-width RoPE is supported)")
  rtype = rp.get("rope_type", rp.get("type", "default"))
  if rtype == "default":
    return out
  if rtype not in ("linear", "llama3"):
    errors.append(
      f"{key}.rope_type={rtype!r} is not supported (supported: 'default', 'linear', 'llama3')"
    )
    return out
  out.update(rope_scaling=rtype, rope_scaling_factor=float(rp.get("factor", 1.0)))
  if rtype == "llama3":
    missing = [
      k
      for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
      if rp.get(k) is None
    ]
    if missing:
      errors.append(f"{key} of rope_type 'llama3' lacks {missing}")
      return out
    out.update(
      rope_low_freq_factor=float(rp["low_freq_factor"]),
      rope_high_freq_factor=float(rp["high_freq_factor"]),
      rope_original_max_len=int(rp["original_max_position_embeddings"]),
    )
  return out


def _moe_every(hf: Mapping[str, Any], num_layers: int, errors: list[str]) -> int | None:
  """Qwen3-MoE's decoder_sparse_step / mlp_only_layers as our `moe_every` (None: no MoE layer)."""
  step = hf.get("decoder_sparse_step") or 1
  dense_only = set(hf.get("mlp_only_layers") or [])
  layers = {i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0}
  if not layers:
    return None
  for n in range(1, num_layers + 1):
    if layers == {i for i in range(num_layers) if i % n == n - 1}:
      return n
  errors.append(
    f"decoder_sparse_step={step} with mlp_only_layers={sorted(dense_only)} puts MoE blocks on "
    f"layers {sorted(layers)}; only every n-th layer (n-1, 2n-1, ...) is supported"
  )
  return None


def _is_int(v: Any) -> bool:
  """Whether a JSON value is an integer (a float with an integral value counts; a bool does not)."""
  return not isinstance(v, bool) and (
    isinstance(v, int) or (isinstance(v, float) and v.is_integer())
  )


def _check_types(hf: Mapping[str, Any], source: str) -> None:
  """Raises CheckpointFormatError naming the first numeric field that holds something else."""
  for key in _INT_FIELDS + _FLOAT_FIELDS:
    v = hf.get(key)
    if v is None:
      continue
    if key in _INT_FIELDS and not _is_int(v):
      raise CheckpointFormatError(f"{source}: {key}={v!r} is not an integer")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise CheckpointFormatError(f"{source}: {key}={v!r} is not a number")


def _hf_fields(hf: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """(fields fixed by config.json, HF-derived defaults that the `jaxrl_llm` extras may override)."""
  mt = hf.get("model_type")
  if mt not in MODEL_TYPES:
    raise CheckpointFormatError(
      f"{source}: model_type={mt!r} is not supported; supported model types: {list(MODEL_TYPES)}"
    )
  _check_types(hf, source)
  missing = [
    k
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    if hf.get(k) is None
  ]
  if missing or (hf.get("intermediate_size") is None and mt != "qwen3_moe"):
    raise CheckpointFormatError(
      f"{source}: required field(s) {missing or ['intermediate_size']} missing (model_type={mt})"
    )
  errors: list[str] = []
  if hf.get("hidden_act", "silu") != "silu":
    errors.append(f"hidden_act={hf['hidden_act']!r} (only 'silu' / SwiGLU is supported)")
  if mt in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
    errors.append("use_sliding_window=True (sliding-window attention is not supported)")
  if mt == "mixtral" and hf.get("sliding_window") is not None:
    errors.append(
      f"sliding_window={hf['sliding_window']} (sliding-window attention is not supported; set it "
      "to null in config.json if sequences never exceed it)"
    )
  layer_types = set(hf.get("layer_types") or []) - {"full_attention"}
  if layer_types:
    errors.append(f"layer_types holds {sorted(layer_types)} (only 'full_attention' is supported)")
  if mt != "qwen2" and hf.get("attention_bias"):
    errors.append(f"attention_bias=True ({mt} puts a bias on o_proj too, which is not supported)")
  if hf.get("mlp_bias"):
    errors.append("mlp_bias=True (biases on the MLP are not supported)")

  d, h, nl = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
  head_dim = hf.get("head_dim") or d // h
  k = int(hf.get("num_experts_per_tok") or (8 if mt == "qwen3_moe" else 2))
  hard: dict[str, Any] = {
    "vocab_size": int(hf["vocab_size"]),
    "d_model": d,
    "num_layers": nl,
    "num_heads": h,
    "num_kv_heads": int(hf.get("num_key_value_heads") or h),
    "head_dim": int(head_dim),
    "norm_eps": float(hf.get("rms_norm_eps") or _DEFAULT_EPS.get(mt, 1e-6)),
    "attention_bias": mt == "qwen2",
    "qk_norm": mt in ("qwen3", "qwen3_moe"),
    "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    "value_head": False,
    "rope_scaling": "none",
  }
  hard.update(_rope_fields(hf, mt, errors))
  soft: dict[str, Any] = {}
  num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
  moe_every = None
  if mt == "mixtral":
    moe_every = 1
  elif mt == "qwen3_moe" and num_experts:
    moe_every = _moe_every(hf, nl, errors)
  if errors:
    raise CheckpointFormatError(f"{source}: unsupported {mt} config: " + "; ".join(errors))
  if mt == "mixtral":
    expert_dim = int(hf["intermediate_size"])
    hard.update(moe_normalize_gates=True)
    soft["mlp_dim"] = expert_dim  # unused: every Mixtral layer is MoE
  elif mt == "qwen3_moe" and moe_every:
    expert_dim = int(hf.get("moe_intermediate_size") or hf.get("intermediate_size"))
    hard["moe_normalize_gates"] = bool(hf.get("norm_topk_prob", False))
    dense = hf.get("intermediate_size")
    (hard if moe_every > 1 else soft)["mlp_dim"] = int(dense or expert_dim)
  else:
    hard["mlp_dim"] = int(hf.get("intermediate_size") or hf.get("moe_intermediate_size"))
    hard["moe_num_experts"] = 0
    return hard, soft
  hard.update(
    moe_num_experts=num_experts,
    moe_top_k=k,
    moe_expert_mlp_dim=expert_dim,
    moe_every=moe_every,
    moe_num_shared_experts=0,
  )
  # HF's load-balance loss is K times ours (its expert loads sum to K, ours to 1).
  soft["moe_aux_loss_coef"] = float(hf.get("router_aux_loss_coef", 0.001)) * k
  return hard, soft


def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
  """The `ModelConfig` of a Hugging Face config.json dict (model types in `MODEL_TYPES`).

  Raises CheckpointFormatError naming `source` and the field for unsupported features.
  """
  if not isinstance(hf_config, Mapping):
    raise CheckpointFormatError(
      f"{source}: holds a JSON {type(hf_config).__name__}, not an object of config fields"
    )
  try:
    hard, soft = _hf_fields(hf_config, source)
  except CheckpointFormatError:
    raise
  except (TypeError, ValueError, AttributeError) as e:  # e.g. a string where a number belongs
    raise CheckpointFormatError(
      f"{source}: a field holds a value of the wrong type ({e})"
    ) from None
  extras = hf_config.get(EXTRA_KEY) or {}
  if not isinstance(extras, Mapping):
    raise CheckpointFormatError(f"{source}: {EXTRA_KEY}={extras!r} is not an object")
  extras = dict(extras)
  unknown = sorted(set(extras) - _FIELDS)
  if unknown:
    raise CheckpointFormatError(f"{source}: unknown field(s) {unknown} under {EXTRA_KEY!r}")
  aux = extras.get("moe_aux_loss_coef")
  if aux is not None and not math.isclose(aux, soft.get("moe_aux_loss_coef", aux), rel_tol=1e-9):
    del extras["moe_aux_loss_coef"]  # router_aux_loss_coef was edited: it wins
  fields = {**soft, **{k: v for k, v in extras.items() if k not in hard}, **hard}
  try:
    return ModelConfig(**fields)
  except (TypeError, ValueError) as e:
    raise CheckpointFormatError(f"{source}: {e}") from None


def _check_token_id(key: str, v: Any, source: str) -> None:
  """Raises CheckpointFormatError unless `v` is null, an id >= 0 or (eos only) a list of ids."""
  ids = v if isinstance(v, list) and key == "eos_token_id" else [v]
  if v is None or (ids and all(_is_int(i) and i >= 0 for i in ids)):
    return
  what = "a token id >= 0, a list of them or null" if key == "eos_token_id" else "a token id >= 0"
  raise CheckpointFormatError(f"{source}: {key}={v!r} is not {what}")


def carried_fields(hf_config: Mapping[str, Any], *, source: str = "config.json") -> dict[str, Any]:
  """The `CARRIED_FIELDS` of a config.json dict (those it holds), checked.

  Raises CheckpointFormatError naming `source` and the field when a token id is not a
  non-negative integer (`eos_token_id` may be a list of them) or max_position_embeddings is not
  a positive integer.
  """
  if not isinstance(hf_config, Mapping):
    raise CheckpointFormatError(
      f"{source}: holds a JSON {type(hf_config).__name__}, not an object of config fields"
    )
  out = {k: hf_config[k] for k in CARRIED_FIELDS if k in hf_config}
  for key, v in out.items():
    if key == "max_position_embeddings":
      if v is not None and not (_is_int(v) and v >= 1):
        raise CheckpointFormatError(f"{source}: {key}={v!r} is not a positive integer")
      if v is not None:
        out[key] = int(v)
    else:
      _check_token_id(key, v, source)
  return out


def default_model_type(cfg: ModelConfig) -> str:
  """The HF model type whose architecture matches `cfg` most directly."""
  if cfg.moe_num_experts:
    return "qwen3_moe" if cfg.qk_norm else "mixtral"
  if cfg.qk_norm:
    return "qwen3"
  return "qwen2" if cfg.attention_bias else "llama"


def config_to_hf(
  cfg: ModelConfig,
  model_type: str | None = None,
  *,
  dtype: str = "float32",
  max_position_embeddings: int | None = None,
):
  """The config.json dict of `cfg` as `model_type`; raises ValueError if it cannot express it.

  ModelConfig records no context length: `max_position_embeddings` defaults to the one the
  reference configuration class of `model_type` assumes when config.json omits it.
  """
  mt = model_type or default_model_type(cfg)
  if mt not in MODEL_TYPES:
    raise ValueError(f"model_type={mt!r} is not supported; supported: {list(MODEL_TYPES)}")
  errors = []
  moe = bool(cfg.moe_num_experts)
  for name, have, wanted in (
    ("attention_bias", cfg.attention_bias, mt == "qwen2"),
    ("qk_norm", cfg.qk_norm, mt in ("qwen3", "qwen3_moe")),
    ("MoE layers (moe_num_experts > 0)", moe, mt in ("qwen3_moe", "mixtral")),
  ):
    if have != wanted:
      errors.append(f"{mt} {'needs' if wanted else 'cannot have'} {name}")
  if moe and cfg.moe_num_shared_experts:
    errors.append(
      f"{mt} has no shared experts (moe_num_shared_experts={cfg.moe_num_shared_experts})"
    )
  if mt == "mixtral" and moe and (cfg.moe_every != 1 or not cfg.moe_normalize_gates):
    errors.append("mixtral needs moe_every=1 and moe_normalize_gates=True")
  if errors:
    raise ValueError(f"cannot export this model as model_type={mt!r}: " + "; ".join(errors))

  rope: dict[str, Any] = {"rope_type": "default"}
  if cfg.rope_scaling != "none":
    rope = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "llama3":
      rope.update(
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_position_embeddings=cfg.rope_original_max_len,
      )
  hf: dict[str, Any] = {
    "architectures": [_ARCHITECTURES[mt]],
    "model_type": mt,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.moe_expert_mlp_dim if mt == "mixtral" else cfg.mlp_dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": max_position_embeddings or _DEFAULT_MAX_POS[mt],
    "rms_norm_eps": cfg.norm_eps,
    # Both spellings: `rope_theta` + `rope_scaling` (transformers 4) and `rope_parameters` (5).
    "rope_theta": cfg.rope_theta,
    "rope_scaling": None if cfg.rope_scaling == "none" else dict(rope),
    "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
    "tie_word_embeddings": cfg.tie_embeddings,
    "torch_dtype": dtype,
    "use_cache": True,
  }
  if mt != "qwen2":
    hf["attention_bias"] = False
  if mt in ("qwen2", "qwen3", "qwen3_moe"):
    hf.update(use_sliding_window=False, sliding_window=None)
  if mt == "mixtral":
    hf.update(sliding_window=None, num_local_experts=cfg.moe_num_experts)
  if mt == "qwen3_moe":
    hf.update(
      num_experts=cfg.moe_num_experts,
      moe_intermediate_size=cfg.moe_expert_mlp_dim,
      norm_topk_prob=cfg.moe_normalize_gates,
      decoder_sparse_step=cfg.moe_every,
      mlp_only_layers=[],
    )
  if moe:
    hf.update(
      num_experts_per_tok=cfg.moe_top_k,
      router_aux_loss_coef=cfg.moe_aux_loss_coef / cfg.moe_top_k,
      output_router_logits=False,
    )
  hard, _ = _hf_fields(hf, "config_to_hf")
  ours = cfg.to_dict()
  hf[EXTRA_KEY] = {k: v for k, v in ours.items() if k not in hard}
  return hf
