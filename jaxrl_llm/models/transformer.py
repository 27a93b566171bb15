"""Decoder-only transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Written in Flax Linen and called as a pure function of a parameter pytree
(`Transformer(cfg).apply({"params": params}, ...)`). Every parameter carries logical
axis names (`vocab`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`) that
`jaxrl_llm.sharding` maps to mesh axes.

One call signature serves the learner (full sequences, no cache), the sampler's
prefill (a prompt written into an empty cache) and its decode steps (one token per
sequence written at `cache_index`). Prompts are left-padded: each row of `key_valid` is a run of
padding (False) then valid keys. `Transformer.attention` picks how attention is computed
(`jaxrl_llm.kernels.attention`: einsum reference, XLA or cuDNN); it adds no parameters, so any
choice runs any checkpoint.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_llm.kernels import attention
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.moe import MoEMLP, gather_expert_logprobs


@struct.dataclass
class MoEOutput:
  """Routing and router statistics of the MoE layers (Lm of them) for one forward pass."""

  routing: jax.Array  # [B, Q, Lm, K] compact int: experts used by each token (spec §9)
  used_logprobs: jax.Array  # [B, Q, Lm, K] float32 router log-probs of the used experts
  probe_logprobs: jax.Array | None  # [B, Q, Lm, K] router log-probs of `probe_experts`
  own_differs: jax.Array  # [B, Q, Lm] bool: router's own top-k differs from the replayed set
  load: jax.Array  # [Lm, E] fraction of valid assignments per expert
  aux_loss: jax.Array  # [] mean over MoE layers of the load-balance loss (§8)
  z_loss: jax.Array  # [] mean over MoE layers of the router z-loss (§8)


@struct.dataclass
class ModelOutput:
  """What one forward pass returns."""

  logits: jax.Array | None  # [B, Q, V] float32 (None with return_hidden)
  cache: KVCache | None  # updated cache (None without a cache)
  values: jax.Array | None  # [B, Q] float32 value-head outputs (None without a value head)
  moe: MoEOutput | None = None  # routing of the MoE layers (None for a dense model)
  hidden: jax.Array | None = None  # [B, Q, D] final-normed hidden states (return_hidden only)


@struct.dataclass
class KVCache:
  """Per-layer key/value cache of a fixed length N (static shape).

  Heads lead the sequence axis: a decode step's attention is then a batched matmul over
  (B, J) on contiguous [N, Dh] slices, with no relayout of the cache at every step.
  """

  k: tuple[jax.Array, ...]  # L x [B, J, N, Dh]
  v: tuple[jax.Array, ...]  # L x [B, J, N, Dh]


CACHE_SEQ_AXIS = 2  # the sequence axis N of each cache array


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
  """An all-zero cache for `batch` sequences of up to `length` tokens."""
  shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, cfg.compute_dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros, v=zeros)


def grow_cache(cache: KVCache, extra: int) -> KVCache:
  """The cache with `extra` empty slots appended to its sequence axis."""
  pad = [(0, 0)] * 4
  pad[CACHE_SEQ_AXIS] = (0, extra)
  return jax.tree.map(lambda x: jnp.pad(x, pad), cache)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray | None:
  """Scaled RoPE inverse frequencies [Dh/2] (float32), or None for plain RoPE.

  `linear` divides every frequency by the factor; `llama3` divides the low frequencies by it,
  keeps the high ones and interpolates in between (as Llama 3.1 and Hugging Face do).
  """
  if cfg.rope_scaling == "none":
    return None
  dh = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
  factor = cfg.rope_scaling_factor
  if cfg.rope_scaling == "linear":
    return (inv_freq / factor).astype(np.float32)
  low, high, orig = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
  wavelen = 2 * np.pi / inv_freq
  smooth = (orig / wavelen - low) / (high - low)
  mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  out = np.where(wavelen > orig / low, inv_freq / factor, inv_freq)
  out = np.where((wavelen >= orig / high) & (wavelen <= orig / low), mid, out)
  return out.astype(np.float32)


def rope(
  x: jax.Array, positions: jax.Array, theta: float, inv_freq: np.ndarray | None = None
) -> jax.Array:
  """Rotary position embedding, half-split convention. x: [B, N, H, Dh], positions: [B, N].

  `inv_freq` [Dh/2] replaces the plain frequencies theta^(-2i/Dh) (see `rope_inv_freq`).
  """
  dh = x.shape[-1]
  if inv_freq is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))  # [Dh/2]
  else:
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, N, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _norm(cfg: ModelConfig, name: str, axis_name: str = "embed") -> nn.RMSNorm:
  return nn.RMSNorm(
    epsilon=cfg.norm_eps,
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, (axis_name,)),
    name=name,
  )


def _dense(cfg, features, axes, names, *, use_bias=False, in_axes=-1, name=None, std=None):
  init = nn.initializers.normal(stddev=std) if std else nn.initializers.lecun_normal()
  return nn.DenseGeneral(
    features=features,
    axis=in_axes,
    use_bias=use_bias,
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    kernel_init=nn.with_logical_partitioning(init, names),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[-len(axes) :]),
    name=name,
  )


class Attention(nn.Module):
  """Grouped-query self-attention with RoPE, optional qkv bias and QK-norm."""

  cfg: ModelConfig
  implementation: str = "auto"  # kernels.attention.IMPLEMENTATIONS (no parameters of its own)

  @nn.compact
  def __call__(self, x, positions, key_valid, k_cache, v_cache, cache_index):
    """x: [B, Q, D]; key_valid: [B, N] bool; caches: [B, J, N, Dh] or None."""
    cfg = self.cfg
    h, j, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b = cfg.attention_bias
    q = _dense(cfg, (h, dh), (h, dh), ("embed", "heads", "head_dim"), use_bias=b, name="q")(x)
    k = _dense(cfg, (j, dh), (j, dh), ("embed", "kv_heads", "head_dim"), use_bias=b, name="k")(x)
    v = _dense(cfg, (j, dh), (j, dh), ("embed", "kv_heads", "head_dim"), use_bias=b, name="v")(x)
    if cfg.qk_norm:
      q = _norm(cfg, "q_norm", "head_dim")(q)
      k = _norm(cfg, "k_norm", "head_dim")(k)
    inv_freq = rope_inv_freq(cfg)
    q = rope(q, positions, cfg.rope_theta, inv_freq)
    k = rope(k, positions, cfg.rope_theta, inv_freq)

    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, J, Q, Dh]: the cache layout
    if k_cache is None:  # full-sequence forward: keys are this call's own tokens
      keys, values, start = k, v, 0
    else:  # write this call's keys at cache_index, attend over the whole cache
      write = lambda c, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
        c, new.astype(c.dtype), cache_index, CACHE_SEQ_AXIS
      )
      keys, values, start = write(k_cache, k), write(v_cache, v), cache_index
    out = attention.attend(q, keys, values, key_valid, start, self.implementation)  # [B, Q, H, Dh]
    out = _dense(
      cfg, cfg.d_model, (cfg.d_model,), ("heads", "head_dim", "embed"), in_axes=(-2, -1), name="o"
    )(out)
    return out, keys, values


class MLP(nn.Module):
  """SwiGLU feed-forward block."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    """x: [B, N, D] -> [B, N, D]."""
    cfg = self.cfg
    gate = _dense(cfg, cfg.mlp_dim, (cfg.mlp_dim,), ("embed", "mlp"), name="gate")(x)
    up = _dense(cfg, cfg.mlp_dim, (cfg.mlp_dim,), ("embed", "mlp"), name="up")(x)
    return _dense(cfg, cfg.d_model, (cfg.d_model,), ("mlp", "embed"), name="down")(
      nn.silu(gate) * up
    )


class Block(nn.Module):
  """Pre-norm transformer block with a dense SwiGLU or a mixture-of-experts feed-forward."""

  cfg: ModelConfig
  is_moe: bool = False
  attention: str = "auto"  # kernels.attention.IMPLEMENTATIONS

  @nn.compact
  def __call__(self, x, positions, key_valid, k_cache, v_cache, cache_index, replay, token_valid):
    """Returns the new residual stream, this layer's keys and values, and the MoE aux dict."""
    attn, keys, values = Attention(self.cfg, self.attention, name="attn")(
      _norm(self.cfg, "attn_norm")(x), positions, key_valid, k_cache, v_cache, cache_index
    )
    x = x + attn
    h = _norm(self.cfg, "mlp_norm")(x)
    if self.is_moe:
      y, aux = MoEMLP(self.cfg, self.cfg.moe, name="moe")(h, replay=replay, mask=token_valid)
    else:
      y, aux = MLP(self.cfg, name="mlp")(h), None
    return x + y, keys, values, aux


# Rematerialisation of each block in the backward pass: what the forward keeps (jax.checkpoint).
REMAT_POLICIES = {
  "none": None,  # no remat: every activation is kept
  "full": jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
  "dots_saveable": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nn.Module):
  """The policy: token ids -> float32 logits, optionally reading/writing a KV cache."""

  cfg: ModelConfig
  remat: str = "none"  # a REMAT_POLICIES name; applies to passes with a static cache_index
  attention: str = "auto"  # kernels.attention.IMPLEMENTATIONS; numerics only, not in the params

  @nn.compact
  def __call__(
    self,
    tokens: jax.Array,  # [B, Q] int32
    positions: jax.Array,  # [B, Q] int32 RoPE positions
    key_valid: jax.Array,  # [B, N] bool, left-padded: keys that may be attended (N = Q w/o cache)
    cache: KVCache | None = None,
    cache_index: jax.Array | int = 0,  # cache slot of tokens[:, 0]
    routing: jax.Array | None = None,  # [B, Q, Lm, K] experts to replay (spec §9)
    probe_experts: jax.Array | None = None,  # [B, Q, Lm, K] experts whose log-probs to report
    return_hidden: bool = False,  # skip the output layer: `unembed` the hidden states later
  ) -> ModelOutput:
    """Returns float32 logits [B, Q, V], the updated cache and (optionally) values [B, Q].

    With `return_hidden`, the final-normed hidden states [B, Q, D] instead of the logits, so
    a caller can unembed only the positions it needs, in chunks (`unembed`).
    """
    cfg = self.cfg
    embed = nn.Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=cfg.compute_dtype,
      param_dtype=cfg.weight_dtype,
      embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(stddev=cfg.d_model**-0.5), ("vocab", "embed")
      ),
      name="embed",
    )
    x = embed(tokens)
    num_q = tokens.shape[1]
    if cache is None:
      token_valid = key_valid
    else:
      token_valid = jax.lax.dynamic_slice_in_dim(key_valid, cache_index, num_q, axis=1)
    new_k, new_v, moe_aux = [], [], []
    moe_layers = cfg.moe_layers
    for i in range(cfg.num_layers):
      kc = None if cache is None else cache.k[i]
      vc = None if cache is None else cache.v[i]
      is_moe = i in moe_layers
      replay = None
      if is_moe and routing is not None:
        replay = routing[:, :, moe_layers.index(i)]
      block_cls = Block
      # Not in decode steps (traced cache_index). static_argnums counts self: cache_index.
      if self.remat != "none" and isinstance(cache_index, int):
        block_cls = nn.remat(Block, policy=REMAT_POLICIES[self.remat], static_argnums=(6,))
      block = block_cls(cfg, is_moe=is_moe, attention=self.attention, name=f"layer_{i}")
      x, keys, values, aux = block(
        x, positions, key_valid, kc, vc, cache_index, replay, token_valid
      )
      new_k.append(keys)
      new_v.append(values)
      if aux is not None:
        moe_aux.append(aux)
    x = _norm(cfg, "final_norm")(x)
    if return_hidden:
      logits = None
    elif cfg.tie_embeddings:
      logits = embed.attend(x).astype(jnp.float32)
    else:
      lm_head = _dense(cfg, cfg.vocab_size, (cfg.vocab_size,), ("embed", "vocab"), name="lm_head")
      logits = lm_head(x).astype(jnp.float32)
    new_cache = None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v))
    values = None
    if cfg.value_head:  # critic on the shared trunk (spec §2.9)
      values = _dense(cfg, 1, (1,), ("embed", None), use_bias=True, name="value_head")(x)
      values = values[..., 0].astype(jnp.float32)
    moe = _collect_moe(moe_aux, probe_experts) if moe_aux else None
    hidden = x if return_hidden else None
    return ModelOutput(logits=logits, cache=new_cache, values=values, moe=moe, hidden=hidden)


def unembed(cfg: ModelConfig, params, hidden: jax.Array) -> jax.Array:
  """float32 logits [.., V] of final-normed hidden states [.., D]: the model's output layer
  (the tied embedding or `lm_head`) applied outside the module, at the compute dtype."""
  dt = cfg.compute_dtype
  if cfg.tie_embeddings:
    w = params["embed"]["embedding"].astype(dt)  # [V, D]
    return jnp.einsum("...d,vd->...v", hidden.astype(dt), w).astype(jnp.float32)
  w = params["lm_head"]["kernel"].astype(dt)  # [D, V]
  return jnp.einsum("...d,dv->...v", hidden.astype(dt), w).astype(jnp.float32)


def _collect_moe(aux: list[dict], probe_experts: jax.Array | None) -> MoEOutput:
  """Stacks per-layer MoE aux dicts into one `MoEOutput` (layer axis after the token axis)."""
  routing = jnp.stack([a["topk"] for a in aux], axis=2)  # [B, Q, Lm, K]
  logprobs = [a["router_logprobs"] for a in aux]  # Lm x [B, Q, E]
  used = jnp.stack([gather_expert_logprobs(lp, a["topk"]) for lp, a in zip(logprobs, aux)], axis=2)
  probe = None
  if probe_experts is not None:
    probe = jnp.stack(
      [gather_expert_logprobs(lp, probe_experts[:, :, j]) for j, lp in enumerate(logprobs)], axis=2
    )
  return MoEOutput(
    routing=routing,
    used_logprobs=used,
    probe_logprobs=probe,
    own_differs=jnp.stack([a["route_differs"] for a in aux], axis=2),
    load=jnp.stack([a["load"] for a in aux]),
    aux_loss=jnp.mean(jnp.stack([a["aux_loss"] for a in aux])),
    z_loss=jnp.mean(jnp.stack([a["z_loss"] for a in aux])),
  )


def positions_from_mask(valid: jax.Array) -> jax.Array:
  """RoPE positions for left-padded rows: 0 at the first real token. valid: [B, N] bool."""
  return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)
