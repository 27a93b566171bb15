"""Hugging Face config.json -> ModelConfig for the families of `families` (Llama, Qwen2, ...);
the way back is `hf_export.config_to_hf`.

Reads both spellings of RoPE settings (`rope_theta` + `rope_scaling` of transformers 4,
`rope_parameters` of transformers 5); the export writes both. ModelConfig fields that config.json has no
name for (moe_impl, the z-loss coefficient, dtypes, ...) are written under the `jaxrl_llm` key
and restored on import, so a config survives export and import unchanged. Everything that differs
between families comes from their `families.Family` rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxrl_llm.models.config import ModelConfig, finite
from jaxrl_llm.models.families import BY_MODEL_TYPE, MODEL_TYPES, Family

EXTRA_KEY = "jaxrl_llm"  # config.json key holding the ModelConfig fields HF has no name for
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
_SIZE_FIELDS = _INT_FIELDS[:7]  # the widths and counts every model has: each at least 1
# The flags config.json is read for (null: the family's default, or off).
_BOOL_FIELDS = (
  "tie_word_embeddings",
  "attention_bias",
  "mlp_bias",
  "norm_topk_prob",
  "use_sliding_window",
)


class CheckpointFormatError(ValueError):
  """A Hugging Face checkpoint is malformed, unsupported, or disagrees with its config.json."""


class MissingCheckpointFileError(CheckpointFormatError, FileNotFoundError):
  """A file a Hugging Face checkpoint needs (config.json, a weight file) is not there."""


# --------------------------------------------------------------------------- configs


def _rope_dict(hf: Mapping[str, Any]) -> tuple[str, Any]:
  """(key, value) of the RoPE settings: `rope_parameters` (transformers 5), else `rope_scaling`
  (4; `{}` where config.json has neither)."""
  key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  return key, hf.get(key) or {}


def _rope_fields(hf: Mapping[str, Any], fam: Family, errors: list[str]) -> dict[str, Any]:
  """RoPE fields from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4)."""
  key, rp = _rope_dict(hf)
  if not isinstance(rp, Mapping) or any(isinstance(v, Mapping) for v in rp.values()):
    errors.append(f"{key}={rp!r} (per-layer-type RoPE parameters are not supported)")
    return {}
  theta = rp.get("rope_theta", hf.get("rope_theta"))  # `_check_rope_theta` refused 0 and nulls
  out: dict[str, Any] = {"rope_theta": float(fam.default("rope_theta") if theta is None else theta)}
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
  out.update(rope_scaling=rtype, rope_scaling_factor=_positive(rp, key, "factor", 1.0, errors))
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
      rope_low_freq_factor=_positive(rp, key, "low_freq_factor", 1.0, errors),
      rope_high_freq_factor=_positive(rp, key, "high_freq_factor", 4.0, errors),
      rope_original_max_len=_positive(rp, key, "original_max_position_embeddings", 1, errors),
    )
  return out


def _positive(rp: Mapping[str, Any], key: str, name: str, default: Any, errors: list[str]) -> Any:
  """`rp[name]` (`default` where absent) if it is a finite number > 0 of `default`'s kind (an
  integer for an int default); else `default`, with the reason added to `errors`."""
  v = rp.get(name, default)
  number = _finite_number(v) and v > 0
  if not number or (isinstance(default, int) and not _is_int(v)):
    kind = "an integer >= 1" if isinstance(default, int) else "a finite number > 0"
    errors.append(f"{key}.{name}={v!r} must be {kind}")
    return default
  return type(default)(v)


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


def _finite_number(v: Any) -> bool:
  """Whether a JSON value is a finite number (a bool is not; nor an integer no float holds)."""
  return isinstance(v, (int, float)) and not isinstance(v, bool) and finite(v)


def _is_int(v: Any) -> bool:
  """Whether a JSON value is an integer (a float with an integral value counts; a bool does not)."""
  return not isinstance(v, bool) and (
    isinstance(v, int) or (isinstance(v, float) and v.is_integer())
  )


def _check_types(hf: Mapping[str, Any], source: str) -> None:
  """Raises CheckpointFormatError naming the first numeric or boolean field that holds something
  else."""
  for key in _INT_FIELDS + _FLOAT_FIELDS:
    v = hf.get(key)
    if v is None:
      continue
    if key in _INT_FIELDS and not _is_int(v):
      raise CheckpointFormatError(f"{source}: {key}={v!r} is not an integer")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise CheckpointFormatError(f"{source}: {key}={v!r} is not a number")
    if key in _FLOAT_FIELDS and not finite(v):  # JSON's Infinity, 1e400, a 400-digit integer
      low = ">= 0" if key == "router_aux_loss_coef" else "> 0"
      raise CheckpointFormatError(f"{source}: {key}={v!r} must be a finite number {low}")
    if key in _SIZE_FIELDS and v < 1:  # a width or count of 0 would divide by it
      raise CheckpointFormatError(f"{source}: {key}={v!r} must be >= 1")
  for key in _BOOL_FIELDS:  # bool("false") is True: a string would turn the flag on
    v = hf.get(key)
    if v is not None and not isinstance(v, bool):
      raise CheckpointFormatError(f"{source}: {key}={v!r} must be true or false (a JSON boolean)")


def _check_rope_theta(hf: Mapping[str, Any], source: str) -> None:
  """Raises CheckpointFormatError unless each rope_theta config.json gives (top-level, in its
  RoPE dict) is a finite number > 0. A null one inside the RoPE dict is refused too:
  transformers keeps it there over the top-level value (and then fails)."""
  key, rp = _rope_dict(hf)
  given = [("rope_theta", hf.get("rope_theta"))]
  if isinstance(rp, Mapping) and "rope_theta" in rp:
    given.append((f"{key}.rope_theta", rp["rope_theta"]))
  for name, v in given:
    if v is None and name == "rope_theta":
      continue  # absent or null: the family's default, unless the RoPE dict gives one
    if not (_finite_number(v) and v > 0):
      hint = " (or omitted, to use the top-level rope_theta or the default)" if v is None else ""
      raise CheckpointFormatError(f"{source}: {name}={v!r} must be a finite number > 0{hint}")


def _get(hf: Mapping[str, Any], fam: Family, key: str) -> Any:
  """config.json's `key`, or the family's reference default where it is absent or null."""
  v = hf.get(key)
  return fam.default(key) if v is None else v


def _optional(hf: Mapping[str, Any], fam: Family, key: str, null: Any) -> Any:
  """config.json's `key`: the family's reference default where it is absent, `null` where it is
  null (or where the family has no default)."""
  v = hf[key] if key in hf else fam.default(key)
  return null if v is None else v


def _family(hf: Mapping[str, Any], source: str) -> Family:
  """The family of config.json's model_type; CheckpointFormatError listing them if unsupported."""
  mt = hf.get("model_type")
  if not isinstance(mt, str) or mt not in BY_MODEL_TYPE:
    raise CheckpointFormatError(
      f"{source}: model_type={mt!r} is not supported; supported model types: {list(MODEL_TYPES)}"
    )
  return BY_MODEL_TYPE[mt]


def _check_required(hf: Mapping[str, Any], fam: Family, source: str) -> None:
  """Raises CheckpointFormatError naming the fields config.json must hold but lacks."""
  missing = [
    k
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    if hf.get(k) is None
  ]
  # The MLP width: intermediate_size, unless the family's experts have a width field of their own.
  own_width = fam.experts is not None and fam.experts.dim_key != "intermediate_size"
  if missing or (hf.get("intermediate_size") is None and not own_width):
    raise CheckpointFormatError(
      f"{source}: required field(s) {missing or ['intermediate_size']} missing "
      f"(model_type={fam.model_type})"
    )


def _window_error(hf: Mapping[str, Any], fam: Family) -> str | None:
  """What turns on sliding-window attention in config.json (None: nothing does)."""
  key = fam.window_key
  if key is None:
    return None
  value = hf[key] if key in hf else fam.default(key)
  if value is None or value is False:
    return None
  if isinstance(value, bool):
    return f"{key}=True (sliding-window attention is not supported)"
  what = f"{key}={value}" if key in hf else f"{key} omitted ({fam.model_type}'s default is {value})"
  return (
    f"{what} (sliding-window attention is not supported; set it to null in config.json if "
    "sequences never exceed it)"
  )


def _unsupported(hf: Mapping[str, Any], fam: Family) -> list[str]:
  """The config.json settings of features that ModelConfig cannot express."""
  errors: list[str] = []
  if hf.get("hidden_act", "silu") != "silu":
    errors.append(f"hidden_act={hf['hidden_act']!r} (only 'silu' / SwiGLU is supported)")
  window = _window_error(hf, fam)
  if window:
    errors.append(window)
  layer_types = set(hf.get("layer_types") or []) - {"full_attention"}
  if layer_types:
    errors.append(f"layer_types holds {sorted(layer_types)} (only 'full_attention' is supported)")
  if not fam.qkv_bias and hf.get("attention_bias"):
    errors.append(
      f"attention_bias=True ({fam.model_type} puts a bias on o_proj too, which is not supported)"
    )
  if hf.get("mlp_bias"):
    errors.append("mlp_bias=True (biases on the MLP are not supported)")
  return errors


def _attention_fields(hf: Mapping[str, Any], fam: Family) -> dict[str, Any]:
  """The ModelConfig fields of the embedding, attention and norms."""
  d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  return {
    "vocab_size": int(hf["vocab_size"]),
    "d_model": d,
    "num_layers": int(hf["num_hidden_layers"]),
    "num_heads": h,
    "num_kv_heads": int(_optional(hf, fam, "num_key_value_heads", h)),
    "head_dim": int(_optional(hf, fam, "head_dim", d // h)),
    "norm_eps": float(_get(hf, fam, "rms_norm_eps")),
    "attention_bias": fam.qkv_bias,
    "qk_norm": fam.qk_norm,
    "tie_embeddings": bool(_get(hf, fam, "tie_word_embeddings")),
    "value_head": False,
    "rope_scaling": "none",
  }


def _num_experts(hf: Mapping[str, Any], fam: Family) -> int:
  """Routed experts per MoE layer, under either spelling (0: none); the family's default where
  config.json has neither."""
  if fam.experts is not None and not {"num_experts", "num_local_experts"} & set(hf):
    return int(fam.default(fam.experts.count_key))
  return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _moe_layers(hf: Mapping[str, Any], fam: Family, errors: list[str]) -> int | None:
  """Our `moe_every` for the family's MoE layers (None: a dense model)."""
  if fam.experts is None or not _num_experts(hf, fam):
    return None
  if not fam.experts.layer_pattern:
    return 1
  return _moe_every(hf, int(hf["num_hidden_layers"]), errors)


def _mlp_fields(
  hf: Mapping[str, Any], fam: Family, moe_every: int | None
) -> tuple[dict[str, Any], dict[str, Any]]:
  """(fixed, overridable) ModelConfig fields of the feed-forward blocks."""
  if not moe_every:
    mlp_dim = int(hf.get("intermediate_size") or hf.get("moe_intermediate_size"))
    return {"mlp_dim": mlp_dim, "moe_num_experts": 0}, {}
  ex = fam.experts
  expert_dim = int(hf.get(ex.dim_key) or hf.get("intermediate_size"))
  k = int(_get(hf, fam, "num_experts_per_tok"))
  hard: dict[str, Any] = {
    "moe_normalize_gates": bool(_get(hf, fam, ex.normalize_key)) if ex.normalize_key else True,
    "moe_num_experts": _num_experts(hf, fam),
    "moe_top_k": k,
    "moe_expert_mlp_dim": expert_dim,
    "moe_every": moe_every,
    "moe_num_shared_experts": 0,
  }
  # HF's load-balance loss is K times ours (its expert loads sum to K, ours to 1).
  soft = {"moe_aux_loss_coef": float(_get(hf, fam, "router_aux_loss_coef")) * k}
  # The dense layers' width; unused when every layer is MoE.
  dense = hf.get("intermediate_size") if ex.dim_key != "intermediate_size" else None
  (hard if moe_every > 1 else soft)["mlp_dim"] = int(dense or expert_dim)
  return hard, soft


def hf_fields(hf: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """The ModelConfig fields of config.json `hf`: (those it fixes, HF-derived defaults that the
  `jaxrl_llm` extras may override); a CheckpointFormatError names what it cannot import."""
  fam = _family(hf, source)
  _check_types(hf, source)
  _check_rope_theta(hf, source)
  _check_required(hf, fam, source)
  errors = _unsupported(hf, fam)
  hard = _attention_fields(hf, fam)
  hard.update(_rope_fields(hf, fam, errors))
  moe_every = _moe_layers(hf, fam, errors)
  if errors:
    raise CheckpointFormatError(
      f"{source}: unsupported {fam.model_type} config: " + "; ".join(errors)
    )
  mlp_hard, soft = _mlp_fields(hf, fam, moe_every)
  return {**hard, **mlp_hard}, soft


def config_from_hf(hf_config: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
  """The `ModelConfig` of a Hugging Face config.json dict (model types in `MODEL_TYPES`).

  Raises CheckpointFormatError naming `source` and the field for unsupported features.
  """
  if not isinstance(hf_config, Mapping):
    raise CheckpointFormatError(
      f"{source}: holds a JSON {type(hf_config).__name__}, not an object of config fields"
    )
  try:
    hard, soft = hf_fields(hf_config, source)
  except CheckpointFormatError:
    raise
  except (TypeError, ValueError, AttributeError, OverflowError) as e:  # a string for a number
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
  if _finite_number(aux) and not math.isclose(
    aux, soft.get("moe_aux_loss_coef", aux), rel_tol=1e-9
  ):
    del extras["moe_aux_loss_coef"]  # router_aux_loss_coef was edited: it wins
  fields = {**soft, **{k: v for k, v in extras.items() if k not in hard}, **hard}
  try:
    return ModelConfig(**fields)
  except (TypeError, ValueError) as e:
    raise CheckpointFormatError(f"{source}: {e}") from None


def _check_token_id(key: str, v: Any, source: str, vocab: Any) -> None:
  """Raises CheckpointFormatError unless `v` is null, an id >= 0 or (eos only) a list of ids,
  each below `vocab` (the model's vocab_size) where that is an integer."""
  ids = v if isinstance(v, list) and key == "eos_token_id" else [v]
  if v is not None and not (ids and all(_is_int(i) and i >= 0 for i in ids)):
    what = "a token id >= 0, a list of them or null" if key == "eos_token_id" else "a token id >= 0"
    raise CheckpointFormatError(f"{source}: {key}={v!r} is not {what}")
  if v is not None and _is_int(vocab) and any(i >= vocab for i in ids):
    raise CheckpointFormatError(
      f"{source}: {key}={v!r} is not below the model's vocab_size={vocab} (a token id of "
      "another model?)"
    )


def carried_fields(
  hf_config: Mapping[str, Any], *, source: str = "config.json", vocab: Any = None
) -> dict[str, Any]:
  """The `CARRIED_FIELDS` of a config.json dict (those it holds), checked.

  Raises CheckpointFormatError naming `source` and the field when a token id is not a
  non-negative integer (`eos_token_id` may be a list of them) below the vocabulary (`vocab`, else
  the dict's own vocab_size, where either is an integer), or max_position_embeddings is not a
  positive integer.
  """
  if not isinstance(hf_config, Mapping):
    raise CheckpointFormatError(
      f"{source}: holds a JSON {type(hf_config).__name__}, not an object of config fields"
    )
  vocab = hf_config.get("vocab_size") if vocab is None else vocab
  out = {k: hf_config[k] for k in CARRIED_FIELDS if k in hf_config}
  for key, v in out.items():
    if key == "max_position_embeddings":
      if v is not None and not (_is_int(v) and v >= 1):
        raise CheckpointFormatError(f"{source}: {key}={v!r} is not a positive integer")
      if v is not None:
        out[key] = int(v)
    else:
      _check_token_id(key, v, source, vocab)
  return out
