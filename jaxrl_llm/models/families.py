"""The Hugging Face model families that `hf_config` imports and `hf_export` exports: one row each.

A `Family` row holds everything that differs between families: the `model_type` and class name
that config.json carries, the defaults its reference configuration class assumes for fields that
config.json omits, the features of its architecture (q/k/v biases, QK-norm, mixture-of-experts
blocks and how config.json spells them), the field that turns on sliding-window attention (which
ModelConfig cannot express, so import refuses it), and its tensor map: `Tensor` rows pairing HF
tensor names, shapes and layouts with our parameter paths. `hf_config` and `hf` hold only the
logic shared by all rows, so a Llama-style family is one row in `FAMILIES`.

Tensor names and parameter paths are templates with `{i}` for the layer and `{e}` for the expert
(a name with `{e}` is one tensor per expert, stacked on our parameter's leading axis). A shape is a
tuple of config.json fields (`a*b` for a product), evaluated by `hf` for a given ModelConfig.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from jaxrl_llm.models.config import ModelConfig

# Which models hold a tensor (`Tensor.when`): all of them, those with an untied output layer,
# q/k/v biases or QK-norm; each dense feed-forward layer; each MoE layer.
WHEN = ("always", "untied", "attention_bias", "qk_norm", "dense", "moe")


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor (per layer / expert where its name holds `{i}` / `{e}`) and our parameter."""

  ours: str  # our parameter path, "/"-separated
  hf: str  # the HF tensor name
  shape: tuple[str, ...]  # HF shape (one expert's), each dimension a config.json field or a*b
  fields: tuple[str, ...]  # the config.json fields that fix the shape, as error messages name them
  linear: bool = False  # HF [out, in] weight: transposed to [in, out], then reshaped
  when: str = "always"  # which models hold it, one of `WHEN`

  def __post_init__(self):
    if self.when not in WHEN:
      raise ValueError(f"Tensor({self.hf!r}).when={self.when!r} must be one of {list(WHEN)}")


def tensor(ours: str, hf: str, shape: str, fields: str = "", **kw: Any) -> Tensor:
  """A `Tensor` from space-separated `shape` and `fields` (default: the fields of `shape`)."""
  dims = tuple(shape.split())
  named = tuple(fields.split()) or tuple(f for d in dims for f in d.split("*"))
  return Tensor(ours, hf, dims, named, **kw)


@dataclasses.dataclass(frozen=True)
class Experts:
  """How a family's config.json and tensor names spell its mixture-of-experts blocks."""

  block: str  # the module of a layer's MoE block: model.layers.{i}.<block>.
  projections: tuple[str, str, str]  # HF names of each expert's gate, up and down projections
  count_key: str  # config.json field: routed experts per MoE layer
  dim_key: str  # config.json field: one expert's hidden width (may be intermediate_size)
  normalize_key: str | None  # config.json field: renormalised top-k gates (None: always)
  layer_pattern: bool  # decoder_sparse_step / mlp_only_layers pick the MoE layers (else: all)
  router: str = "gate"  # the router's module in the block


_L = "model.layers.{i}."
_Q = "num_attention_heads head_dim hidden_size"
_KV = "num_key_value_heads head_dim hidden_size"


def llama_tensors(experts: Experts | None = None) -> tuple[Tensor, ...]:
  """The tensor map of a Llama-style decoder (pre-norm attention and SwiGLU blocks), in HF order;
  with `experts`, also the router and experts of MoE layers."""
  out = [
    tensor("embed/embedding", "model.embed_tokens.weight", "vocab_size hidden_size"),
    tensor("final_norm/scale", "model.norm.weight", "hidden_size"),
    tensor(
      "lm_head/kernel", "lm_head.weight", "vocab_size hidden_size", linear=True, when="untied"
    ),
    tensor("layer_{i}/attn_norm/scale", _L + "input_layernorm.weight", "hidden_size"),
    tensor("layer_{i}/mlp_norm/scale", _L + "post_attention_layernorm.weight", "hidden_size"),
  ]
  for w, heads, fields in (
    ("q", "num_attention_heads", _Q),
    ("k", "num_key_value_heads", _KV),
    ("v", "num_key_value_heads", _KV),
  ):
    ours, hf, dim = f"layer_{{i}}/attn/{w}/", f"{_L}self_attn.{w}_proj.", f"{heads}*head_dim"
    out.append(tensor(ours + "kernel", hf + "weight", f"{dim} hidden_size", fields, linear=True))
    out.append(tensor(ours + "bias", hf + "bias", dim, fields, when="attention_bias"))
  o_shape = "hidden_size num_attention_heads*head_dim"
  out.append(
    tensor("layer_{i}/attn/o/kernel", _L + "self_attn.o_proj.weight", o_shape, _Q, linear=True)
  )
  for w in ("q", "k"):
    name = f"{_L}self_attn.{w}_norm.weight"
    out.append(tensor(f"layer_{{i}}/attn/{w}_norm/scale", name, "head_dim", when="qk_norm"))
  if experts is not None:
    out += _expert_tensors(experts)
  for w in ("gate", "up", "down"):
    shape = "hidden_size intermediate_size" if w == "down" else "intermediate_size hidden_size"
    name, fields = f"{_L}mlp.{w}_proj.weight", "intermediate_size hidden_size"
    out.append(
      tensor(f"layer_{{i}}/mlp/{w}/kernel", name, shape, fields, linear=True, when="dense")
    )
  return tuple(out)


def _expert_tensors(ex: Experts) -> list[Tensor]:
  """The router and stacked expert projections of one MoE layer of a Llama-style decoder."""
  block, n, f = f"{_L}{ex.block}.", ex.count_key, ex.dim_key
  out = [
    tensor(
      "layer_{i}/moe/router/kernel",
      f"{block}{ex.router}.weight",
      f"{n} hidden_size",
      linear=True,
      when="moe",
    )
  ]
  for w, proj in zip(("gate", "up", "down"), ex.projections):
    shape = f"hidden_size {f}" if w == "down" else f"{f} hidden_size"
    name = f"{block}experts.{{e}}.{proj}.weight"
    out.append(
      tensor(f"layer_{{i}}/moe/{w}", name, shape, f"{n} {f} hidden_size", linear=True, when="moe")
    )
  return out


# Reference defaults that a row's `defaults` need not repeat.
COMMON_DEFAULTS: Mapping[str, Any] = types.MappingProxyType(
  {
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "use_sliding_window": False,
    "sliding_window": None,
  }
)


@dataclasses.dataclass(frozen=True)
class Family:
  """A Hugging Face model family: everything about it that import and export depend on."""

  model_type: str  # config.json's model_type
  architecture: str  # config.json's architectures[0]: the transformers model class
  # The reference configuration class's values of the optional config.json fields we read
  # (rope_theta, rms_norm_eps, max_position_embeddings, num_experts_per_tok, ...), beside
  # `COMMON_DEFAULTS`; num_key_value_heads and head_dim only where they are not derived (from
  # num_attention_heads and hidden_size / num_attention_heads, as a null value always is).
  defaults: Mapping[str, Any]
  qkv_bias: bool = False  # q/k/v projections always have biases (no config.json field for it)
  qk_norm: bool = False  # RMSNorm on per-head queries and keys
  experts: Experts | None = None  # MoE layers and how they are spelled (None: dense only)
  # The config.json field that turns sliding-window attention on: use_sliding_window (a flag),
  # sliding_window (a non-null window size) or None (the family has none).
  window_key: str | None = None
  tensors: tuple[Tensor, ...] = ()  # its tensor map (default: `llama_tensors(experts)`)

  def __post_init__(self):
    defaults = types.MappingProxyType({**COMMON_DEFAULTS, **self.defaults})
    object.__setattr__(self, "defaults", defaults)
    if not self.tensors:
      object.__setattr__(self, "tensors", llama_tensors(self.experts))

  def default(self, key: str) -> Any:
    """The reference configuration class's value of `key` when config.json omits it."""
    return self.defaults.get(key)


_QWEN_WINDOW = "use_sliding_window"

# In `default_model_type`'s order of preference: the first that fits a model wins.
FAMILIES: tuple[Family, ...] = (
  Family("llama", "LlamaForCausalLM", {"max_position_embeddings": 2048}),
  Family(
    "qwen2",
    "Qwen2ForCausalLM",
    {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    qkv_bias=True,
    window_key=_QWEN_WINDOW,
  ),
  Family(
    "qwen3",
    "Qwen3ForCausalLM",
    {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    qk_norm=True,
    window_key=_QWEN_WINDOW,
  ),
  Family(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    {
      "max_position_embeddings": 32768,
      "num_key_value_heads": 4,
      "num_experts": 128,
      "num_experts_per_tok": 8,
    },
    qk_norm=True,
    experts=Experts(
      block="mlp",
      projections=("gate_proj", "up_proj", "down_proj"),
      count_key="num_experts",
      dim_key="moe_intermediate_size",
      normalize_key="norm_topk_prob",
      layer_pattern=True,
    ),
    window_key=_QWEN_WINDOW,
  ),
  Family(
    "mixtral",
    "MixtralForCausalLM",
    {
      "max_position_embeddings": 131072,
      "rope_theta": 1e6,
      "rms_norm_eps": 1e-5,
      "num_key_value_heads": 8,
      "num_local_experts": 8,
    },
    experts=Experts(
      block="block_sparse_moe",
      projections=("w1", "w3", "w2"),
      count_key="num_local_experts",
      dim_key="intermediate_size",
      normalize_key=None,
      layer_pattern=False,
    ),
    window_key="sliding_window",
  ),
  Family(
    "mistral",
    "MistralForCausalLM",
    {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    window_key="sliding_window",
  ),
)
BY_MODEL_TYPE: Mapping[str, Family] = types.MappingProxyType({f.model_type: f for f in FAMILIES})
MODEL_TYPES = tuple(BY_MODEL_TYPE)


def features(cfg: ModelConfig, fam: Family) -> tuple[tuple[str, bool, bool], ...]:
  """(feature, whether `cfg` has it, whether `fam` has it) for each feature of a family row."""
  return (
    ("attention_bias", cfg.attention_bias, fam.qkv_bias),
    ("qk_norm", cfg.qk_norm, fam.qk_norm),
    ("MoE layers (moe_num_experts > 0)", bool(cfg.moe_num_experts), fam.experts is not None),
  )


def default_model_type(cfg: ModelConfig) -> str:
  """The HF model type whose architecture matches `cfg` most directly.

  The first family in `FAMILIES` with the features of `cfg`; where none has them all, the one
  that differs least, MoE layers counting first, then QK-norm, then attention biases.
  """
  mismatch = lambda fam: tuple(have != wanted for _, have, wanted in features(cfg, fam))[::-1]  # noqa: E731
  return min(FAMILIES, key=mismatch).model_type
