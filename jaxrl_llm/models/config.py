"""Frozen model hyperparameters: `ModelConfig` (handed to every layer) and `MoEConfig`."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
from typing import Any, ClassVar, TypeVar

import jax.numpy as jnp
import numpy as np

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ROPE_SCALINGS = ("none", "linear", "llama3")
IMPLS = ("auto", "kernel", "ragged", "portable", "dense")
MAX_EXPERTS = 2**24  # E x 63 padding rows of the grouped layout stay well inside int32

_Config = TypeVar("_Config", bound="_DictConfig")

LORA_BASE_DTYPES = ("auto", "int8")  # what model.lora_base_dtype may be
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # what lora_targets may name
HF_NAMES = {f"{p}_proj": p for p in PROJECTIONS}  # Hugging Face module names: q_proj -> q


# True while a config names a checkpoint: its placeholder architecture's widths are not the
# ones the adapters will sit on, so a LoRA rank is held to the checkpoint's (at `onto`).
_WIDTHS_FROM_CHECKPOINT = contextvars.ContextVar("widths_from_checkpoint", default=False)


@contextlib.contextmanager
def widths_from_checkpoint(yes: bool = True):
  """Within it, a ModelConfig built leaves out the checks that need the real projections' widths
  (the LoRA rank's bound, the targeted projections' presence): a checkpoint will set them."""
  token = _WIDTHS_FROM_CHECKPOINT.set(yes)
  try:
    yield
  finally:
    _WIDTHS_FROM_CHECKPOINT.reset(token)


def _mapped(targets: str) -> list[str]:
  """`lora_targets` split at its commas, Hugging Face names mapped (`q_proj` -> `q`)."""
  return [HF_NAMES.get(n, n) for t in targets.split(",") if (n := t.strip())]


def target_names(targets: str) -> tuple[str, ...]:
  """`lora_targets` as projection names (Hugging Face names mapped: `q_proj` -> `q`)."""
  return tuple(dict.fromkeys(_mapped(targets)))


def normal_targets(targets: str) -> str:
  """`lora_targets` as a model holds, a checkpoint records and a resume compares it: its
  projections' short names in `PROJECTIONS` order (`k_proj,q` -> `q,k`); a list that
  `target_errors` refuses is returned as given."""
  if target_errors(targets):
    return targets
  names = set(_mapped(targets))
  return ",".join(p for p in PROJECTIONS if p in names)


# Model fields a checkpoint's meta may spell otherwise than the config: {dotted field: the
# function that gives both sides one spelling}, for the resume's comparison.
RESUME_SPELLINGS = {"model.lora_targets": normal_targets}


def target_errors(targets: str) -> list[str]:
  """Why `lora_targets` is not a list of known projections, each named once (empty list: it
  is)."""
  mapped = _mapped(targets)
  names = tuple(dict.fromkeys(mapped))
  unknown = [n for n in names if n not in PROJECTIONS]
  twice = [n for n in names if mapped.count(n) > 1]
  if not names:
    return [
      f"model.lora_targets={targets!r} names no projection; allowed: {', '.join(PROJECTIONS)}"
    ]
  if unknown:
    return [
      f"model.lora_targets={targets!r}: {', '.join(unknown)} is no projection; allowed: "
      f"{', '.join(PROJECTIONS)} (or {', '.join(HF_NAMES)})"
    ]
  if twice:
    return [
      f"model.lora_targets={targets!r} names {', '.join(twice)} more than once (a Hugging Face "
      f"name is its short one: q_proj is q); name each of {', '.join(PROJECTIONS)} at most once"
    ]
  return []


def _field(default: Any, **meta: Any) -> Any:
  """A `ModelConfig` field with its default and what a run must know of it, as metadata:
  `numerics=True`: it picks an implementation, not the function (a run resumes across it);
  `onto_checkpoint`: "always", the config's value applies to a loaded checkpoint's architecture
  too; "if_set", where the config sets another value than the default (else the checkpoint's);
  `hparam=True`: a column of TensorBoard's HParams view (the keys of `config.fields`)."""
  return dataclasses.field(default=default, metadata=meta)


class _DictConfig:
  """`to_dict` / `from_dict` of a frozen config dataclass; `KIND` names it in errors."""

  KIND: ClassVar[str]

  def to_dict(self) -> dict[str, Any]:
    """A JSON-friendly dict (a model config's is saved with checkpoints, compared on resume)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls: type[_Config], d: dict[str, Any]) -> _Config:
    """Builds a config from a dict, naming any unknown field."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"unknown {cls.KIND} config field(s) {unknown}; allowed: {sorted(fields)}")
    return cls(**d)


def finite(v: Any) -> bool:
  """Whether the number `v` is finite (an integer too large for a float is not)."""
  try:
    return math.isfinite(v)
  except OverflowError:
    return False


def number_errors(config: Any) -> list[str]:
  """The int and float fields of the dataclass `config` that hold something else: a bool or a
  string, a fraction for an int, an infinite or NaN float."""
  errors = []
  for f in dataclasses.fields(config):
    v, where = getattr(config, f.name), f"{config.KIND}.{f.name}={getattr(config, f.name)!r}"
    if f.type == "int" and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
      errors.append(f"{where} must be an integer")
    elif f.type == "float" and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
      errors.append(f"{where} must be a number")
    elif f.type == "float" and not finite(v):
      errors.append(f"{where} must be a finite number")
  return errors


@dataclasses.dataclass(frozen=True)
class ModelConfig(_DictConfig):
  """Decoder-only transformer of the Llama / Qwen family."""

  KIND: ClassVar[str] = "model"

  vocab_size: int = 32  # number of token ids (embedding rows)
  d_model: int = _field(64, hparam=True)  # residual stream width D
  num_layers: int = _field(2, hparam=True)  # transformer blocks L
  num_heads: int = 4  # query heads H
  num_kv_heads: int = 2  # key/value heads J (grouped-query attention; H % J == 0)
  head_dim: int = 16  # per-head width Dh
  mlp_dim: int = 256  # SwiGLU hidden width F
  rope_theta: float = 10_000.0  # RoPE base frequency
  rope_scaling: str = "none"  # none | linear | llama3 (Llama 3.1 per-frequency scaling)
  rope_scaling_factor: float = 1.0  # context extension factor of linear / llama3 scaling
  rope_low_freq_factor: float = 1.0  # llama3: wavelengths > orig_len / this are fully scaled
  rope_high_freq_factor: float = 4.0  # llama3: wavelengths < orig_len / this are not scaled
  rope_original_max_len: int = 8192  # llama3: orig_len, the pre-training context length
  norm_eps: float = 1e-6  # RMSNorm epsilon
  attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
  qk_norm: bool = False  # RMSNorm on per-head queries and keys (Qwen3)
  tie_embeddings: bool = True  # output projection shares the embedding matrix
  value_head: bool = False  # scalar value head on the final hidden state (PPO critic, §2.9)
  moe_num_experts: int = 0  # routed experts E per MoE layer (0 = dense model, no MoE)
  moe_top_k: int = 2  # experts per token K
  moe_expert_mlp_dim: int = 64  # SwiGLU hidden width of each routed expert
  moe_every: int = 1  # every n-th layer is MoE (1 = all layers; layers n-1, 2n-1, ...)
  moe_num_shared_experts: int = 0  # always-on shared experts (DeepSeek / Qwen-MoE style)
  moe_shared_mlp_dim: int = 0  # hidden width of one shared expert (0 = moe_expert_mlp_dim)
  moe_normalize_gates: bool = True  # renormalise top-k gates to sum to 1 (Mixtral, Qwen3-MoE)
  moe_impl: str = _field(
    "auto", numerics=True, onto_checkpoint="always"
  )  # auto (ragged on TPU, kernel on Hopper GPUs where its checks pass, else portable) | kernel (Mosaic GPU grouped matmuls) | ragged (lax.ragged_dot) | portable (fused tiles) | dense (one-hot reference); not part of the checkpoint
  moe_aux_loss_coef: float = _field(
    0.01, onto_checkpoint="if_set"
  )  # load-balance loss coefficient (§8)
  moe_z_loss_coef: float = _field(0.001, onto_checkpoint="if_set")  # router z-loss coefficient (§8)
  dtype: str = _field(
    "float32", onto_checkpoint="always"
  )  # compute dtype of matmuls (log-softmax is always float32)
  param_dtype: str = _field("float32", onto_checkpoint="always")  # storage dtype of parameters
  scan_layers: bool = _field(
    False, onto_checkpoint="always"
  )  # blocks under nn.scan, params stacked on a leading "layers" axis
  lora_rank: int = _field(
    0, onto_checkpoint="always"
  )  # rank r of low-rank adapters on lora_targets; only they train (0 = none)
  lora_alpha: float = _field(
    16.0, onto_checkpoint="always"
  )  # adapter scale alpha / r (PEFT's lora_alpha)
  lora_targets: str = _field(
    "q,k,v,o,gate,up,down", onto_checkpoint="always"
  )  # projections given adapters (or q_proj, ...), each once; held as short names in this order
  lora_dropout: float = _field(
    0.0, onto_checkpoint="always"
  )  # PEFT's lora_dropout on the adapters' input (learner passes only)
  lora_base_dtype: str = _field(
    "auto", onto_checkpoint="always"
  )  # storage of the frozen base's projections: auto (param_dtype) | int8 (weight-only, one scale per output channel)

  @classmethod
  def tagged(cls, key: str, value: Any = None) -> tuple[str, ...]:
    """The fields whose metadata sets `key` (e.g. "numerics", "hparam"), to `value` if given."""
    return tuple(
      f.name
      for f in dataclasses.fields(cls)
      if (f.metadata.get(key) if value is None else f.metadata.get(key) == value)
    )

  def onto(self, checkpoint: ModelConfig) -> ModelConfig:
    """A loaded checkpoint's architecture with this config's fields that apply to it
    (`onto_checkpoint` "always"; "if_set" where this config differs from the default)."""
    default, out = ModelConfig(), {}
    for f in dataclasses.fields(self):
      when, value = f.metadata.get("onto_checkpoint"), getattr(self, f.name)
      if when == "always" or (when == "if_set" and value != getattr(default, f.name)):
        out[f.name] = value
    return dataclasses.replace(checkpoint, **out)

  def __post_init__(self):
    errors = number_errors(self)
    if errors:  # the checks below compare numbers
      raise ValueError("invalid model config: " + "; ".join(errors))
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
      if getattr(self, name) < 1:
        errors.append(f"model.{name}={getattr(self, name)} must be >= 1")
    if self.mlp_dim < 1:
      errors.append(f"model.mlp_dim={self.mlp_dim} must be >= 1")
    if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
      errors.append(
        f"model.num_heads={self.num_heads} must be a multiple of "
        f"model.num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim % 2:
      errors.append(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    for name in ("rope_theta", "rope_scaling_factor", "norm_eps"):  # NaN fails `> 0` too
      if not getattr(self, name) > 0:
        errors.append(f"model.{name}={getattr(self, name)} must be > 0")
    for name in ("moe_aux_loss_coef", "moe_z_loss_coef"):
      if not getattr(self, name) >= 0:
        errors.append(f"model.{name}={getattr(self, name)} must be >= 0 (0 = off)")
    if self.rope_scaling not in ROPE_SCALINGS:
      errors.append(
        f"model.rope_scaling={self.rope_scaling!r} must be one of {list(ROPE_SCALINGS)}"
      )
    if self.rope_scaling == "llama3":
      if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
        errors.append(
          f"model.rope_low_freq_factor={self.rope_low_freq_factor} and model.rope_high_freq_factor="
          f"{self.rope_high_freq_factor} must satisfy 0 < low < high"
        )
      if self.rope_original_max_len < 1:
        errors.append(f"model.rope_original_max_len={self.rope_original_max_len} must be >= 1")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        errors.append(f"model.{name}={getattr(self, name)!r} must be one of {sorted(_DTYPES)}")
    errors += self._moe_errors() + self._lora_errors()
    if errors:
      raise ValueError("invalid model config: " + "; ".join(errors))
    object.__setattr__(self, "lora_targets", normal_targets(self.lora_targets))  # one spelling

  def _moe_errors(self) -> list[str]:
    """A known implementation; for MoE: experts in [0, 2**24], top-k within them, the MoE
    layers' spacing within the stack (and, scanned, dividing it)."""
    out = []
    if self.moe_impl not in IMPLS:  # a dense model too: a checkpoint or a relaunch may be MoE
      out.append(f"model.moe_impl={self.moe_impl!r}; allowed: {', '.join(IMPLS)}")
    if not 0 <= self.moe_num_experts <= MAX_EXPERTS:
      out.append(
        f"model.moe_num_experts={self.moe_num_experts} must be in [0, 2**24 = {MAX_EXPERTS}] (0 = "
        "dense; the grouped layout pads each expert's rows to a tile of up to 64 rows and "
        "indexes them in int32)"
      )
    if 0 < self.moe_num_experts <= MAX_EXPERTS:
      if not 1 <= self.moe_top_k <= self.moe_num_experts:
        out.append(
          f"model.moe_top_k={self.moe_top_k} must be in [1, model.moe_num_experts="
          f"{self.moe_num_experts}]"
        )
      if not 1 <= self.moe_every <= self.num_layers:
        out.append(f"model.moe_every={self.moe_every} must be in [1, {self.num_layers}]")
      if self.scan_layers and 1 <= self.moe_every <= self.num_layers:
        if self.num_layers % self.moe_every:
          out.append(
            f"model.scan_layers=True needs model.num_layers={self.num_layers} to be a multiple "
            f"of model.moe_every={self.moe_every} (each scan step runs moe_every - 1 dense "
            "blocks and one MoE block); use a multiple or model.scan_layers=False"
          )
    return out

  def _lora_errors(self) -> list[str]:
    """Rank in [1, the narrowest targeted projection's width], alpha > 0, targets that name
    projections this model has."""
    if self.lora_rank <= 0:
      if self.lora_rank < 0:
        return [f"model.lora_rank={self.lora_rank} must be >= 0"]
      said = []
      if self.lora_base_dtype != "auto":
        said.append(f"model.lora_base_dtype={self.lora_base_dtype!r}")
      if self.lora_dropout:
        said.append(f"model.lora_dropout={self.lora_dropout}")
      if not said:
        return []
      one = len(said) == 1
      return [
        f"{' and '.join(said)} {'acts' if one else 'act'} on adapters; set model.lora_rank >= 1 "
        f"or leave {'it' if one else 'them'} at the default (lora_base_dtype auto, lora_dropout 0)"
      ]
    errors = target_errors(self.lora_targets)
    if not 0 <= self.lora_dropout < 1:
      errors.append(f"model.lora_dropout={self.lora_dropout} must be in [0, 1)")
    if self.lora_base_dtype not in LORA_BASE_DTYPES:
      errors.append(
        f"model.lora_base_dtype={self.lora_base_dtype!r}; allowed: {', '.join(LORA_BASE_DTYPES)}"
      )
    if not self.lora_alpha > 0:
      errors.append(f"model.lora_alpha={self.lora_alpha} must be > 0")
    if _WIDTHS_FROM_CHECKPOINT.get():  # checked again on the checkpoint's architecture
      return errors
    widths, names = self.projection_widths, target_names(self.lora_targets)
    absent = [n for n in names if n not in widths and not errors]
    if absent:
      errors.append(
        f"model.lora_targets={self.lora_targets!r}: this model has no {', '.join(absent)} "
        f"projection (no dense MLP or shared experts); its projections: {', '.join(widths)}"
      )
    narrow = min((n for n in names if n in widths), key=lambda n: widths[n], default=None)
    if narrow and self.lora_rank > widths[narrow]:
      errors.append(
        f"model.lora_rank={self.lora_rank} is larger than projection {narrow!r}, whose narrower "
        f"side is {widths[narrow]}; allowed: 1..{widths[narrow]}"
      )
    return errors

  def without_adapters(self) -> ModelConfig:
    """This architecture as a plain model: no adapters, a float base (a merged export)."""
    return dataclasses.replace(self, lora_rank=0, lora_dropout=0.0, lora_base_dtype="auto")

  @property
  def projection_widths(self) -> dict[str, int]:
    """{each projection the model has: the narrower of its input and output widths} (what
    bounds a LoRA rank); gate/up/down only where a dense MLP or shared experts exist."""
    q, kv, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.d_model
    widths = {"q": min(d, q), "k": min(d, kv), "v": min(d, kv), "o": min(q, d)}
    hidden = [self.mlp_dim] if len(self.moe_layers) < self.num_layers else []
    if self.moe_num_experts and self.moe_num_shared_experts:
      hidden.append(
        self.moe_num_shared_experts * (self.moe_shared_mlp_dim or self.moe_expert_mlp_dim)
      )
    return widths | (dict.fromkeys(("gate", "up", "down"), min(d, *hidden)) if hidden else {})

  @property
  def compute_dtype(self) -> Any:
    """The jnp dtype used for activations and matmuls."""
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self) -> Any:
    """The jnp dtype parameters are stored in."""
    return _DTYPES[self.param_dtype]

  @property
  def moe(self):
    """The `MoEConfig` of the MoE layers (None for a dense model)."""
    if not self.moe_num_experts:
      return None
    return MoEConfig(
      num_experts=self.moe_num_experts,
      top_k=self.moe_top_k,
      expert_mlp_dim=self.moe_expert_mlp_dim,
      num_shared_experts=self.moe_num_shared_experts,
      shared_mlp_dim=self.moe_shared_mlp_dim,
      normalize_gates=self.moe_normalize_gates,
      impl=self.moe_impl,
      aux_loss_coef=self.moe_aux_loss_coef,
      z_loss_coef=self.moe_z_loss_coef,
    )

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """Indices of the layers whose feed-forward block is MoE."""
    if not self.moe_num_experts:
      return ()
    return tuple(i for i in range(self.num_layers) if i % self.moe_every == self.moe_every - 1)

  @property
  def scan_period(self) -> int:
    """Blocks per step of the scan over layers (scan_layers): moe_every for MoE models, else 1."""
    return self.moe_every if self.moe_num_experts else 1


@dataclasses.dataclass(frozen=True)
class MoEConfig(_DictConfig):
  """Hyperparameters of one mixture-of-experts feed-forward block.

  With top_k=1 and normalize_gates the single gate is always 1, so the router learns only
  from the regularisers; use normalize_gates=False for Switch-style top-1 routing.
  """

  KIND: ClassVar[str] = "moe"

  num_experts: int = 8  # routed experts E
  top_k: int = 2  # experts per token K (1 <= K <= E)
  expert_mlp_dim: int = 64  # SwiGLU hidden width F of each routed expert
  num_shared_experts: int = 0  # always-on shared experts (0 = none)
  shared_mlp_dim: int = 0  # hidden width of one shared expert (0 = expert_mlp_dim)
  normalize_gates: bool = True  # renormalise the top-k softmax gates to sum to 1 (Mixtral, Qwen3)
  impl: str = "ragged"  # 'ragged' (dropless grouped matmul) or 'dense' (one-hot reference)
  aux_loss_coef: float = 0.01  # load-balance loss coefficient (§8)
  z_loss_coef: float = 0.001  # router z-loss coefficient (§8)

  def __post_init__(self):
    errors = []
    if self.num_experts < 1:
      errors.append(f"moe.num_experts={self.num_experts} must be >= 1")
    if not 1 <= self.top_k <= max(self.num_experts, 1):
      errors.append(f"moe.top_k={self.top_k} must be in [1, moe.num_experts={self.num_experts}]")
    if self.expert_mlp_dim < 1:
      errors.append(f"moe.expert_mlp_dim={self.expert_mlp_dim} must be >= 1")
    if self.num_shared_experts < 0:
      errors.append(f"moe.num_shared_experts={self.num_shared_experts} must be >= 0")
    if self.shared_mlp_dim < 0:
      errors.append(f"moe.shared_mlp_dim={self.shared_mlp_dim} must be >= 0 (0 = expert_mlp_dim)")
    if self.impl not in IMPLS:
      errors.append(f"moe.impl={self.impl!r} must be one of {list(IMPLS)}")
    for name in ("aux_loss_coef", "z_loss_coef"):
      if getattr(self, name) < 0:
        errors.append(f"moe.{name}={getattr(self, name)} must be >= 0")
    if errors:
      raise ValueError("invalid moe config: " + "; ".join(errors))

  @property
  def shared_hidden_dim(self) -> int:
    """Hidden width of the fused shared-expert SwiGLU (0 when there are none)."""
    return self.num_shared_experts * (self.shared_mlp_dim or self.expert_mlp_dim)

  @property
  def index_dtype(self) -> Any:
    """The smallest signed integer dtype that holds every expert index."""
    return index_dtype(self.num_experts)


def index_dtype(num_experts: int) -> Any:
  """int8 / int16 / int32: the smallest that holds indices 0..num_experts-1."""
  for dtype in (jnp.int8, jnp.int16):
    if num_experts - 1 <= np.iinfo(dtype).max:
      return dtype
  return jnp.int32
