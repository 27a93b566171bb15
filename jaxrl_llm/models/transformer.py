"""Decoder-only transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Written in Flax Linen and called as a pure function of a parameter pytree
(`Transformer(cfg).apply({"params": params}, ...)`). Every parameter carries logical
axis names (`vocab`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`) that
`jaxrl_llm.sharding` maps to mesh axes.

One call signature serves the learner (full sequences, no cache), the sampler's
prefill (a prompt written into an empty cache) and its decode steps (one token per
sequence written at `cache_index`; the attention reads only the first N cache slots, N the
static width of `key_valid`, which may be under the cache's length). Prompts are left-padded:
each row of `key_valid` is a run of padding (False) then valid keys. `Transformer.attention`
picks how attention is computed (`jaxrl_llm.kernels.attention`: einsum reference, XLA or
cuDNN); it adds no parameters, so any choice runs any checkpoint. The cache and its writes
are `models.kv_cache`, the rotary embeddings `models.rope`.

The blocks run unrolled (`layer_{i}` submodules, a tuple of per-layer caches) or, with
`ModelConfig.scan_layers`, under `nn.scan` (`LayerGroup`; parameters stacked on a leading
`layers` axis, one stacked cache), so that compile time does not grow with depth; the two give
the same outputs for the same parameters converted by `models.scan`.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from jaxrl_llm.kernels import attention
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.kv_cache import KVCache, is_decode_step, write_tokens
from jaxrl_llm.models.moe import MoEMLP, gather_expert_logprobs
from jaxrl_llm.models.rope import rope, rope_inv_freq
from jaxrl_llm.models.scan import SCAN_NAME


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


def _norm(cfg: ModelConfig, name: str, axis_name: str = "norm") -> nn.RMSNorm:
  """RMSNorm; its scale's logical axis `norm` (d_model) stays whole: tiny, and splitting it
  over `fsdp` would reshard every normed activation."""
  return nn.RMSNorm(
    epsilon=cfg.norm_eps,
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, (axis_name,)),
    name=name,
  )


def token_major(fn: Callable[[jax.Array], jax.Array], x: jax.Array, n_in: int = 1) -> jax.Array:
  """`fn(x)` for a dense layer over x's last `n_in` dims, applied to x with its leading (batch,
  position) dims merged into one token dim and split again after. The same values; on the CPU
  backend a matmul with a single free dim needs no transposed copy of its operands in the
  backward pass (1.5x faster SwiGLU forward + backward, 1.8x the output layer, measured at 32 x
  64 tokens); elsewhere the reshape is free."""
  lead = x.shape[: x.ndim - n_in]
  y = fn(x.reshape(-1, *x.shape[x.ndim - n_in :]))
  return y.reshape(*lead, *y.shape[1:])


def _embed(cfg: ModelConfig) -> nn.Embed:
  """The token embedding [V, D] (normal, std D^-1/2); also the output layer when tied."""
  return nn.Embed(
    cfg.vocab_size,
    cfg.d_model,
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    embedding_init=nn.with_logical_partitioning(
      nn.initializers.normal(stddev=cfg.d_model**-0.5), ("vocab", "embed")
    ),
    name="embed",
  )


def _dense(cfg, features, axes, names, *, use_bias=False, in_axes=-1, name=None, std=None):
  init = nn.initializers.normal(stddev=std) if std else nn.initializers.lecun_normal()
  kwargs = dict(
    features=features,
    axis=in_axes,
    use_bias=use_bias,
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    kernel_init=nn.with_logical_partitioning(init, names),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[-len(axes) :]),
  )
  return lora.projection(cfg, name, names, **kwargs)


# The residual stream's logical axes; `sharding.DEFAULT_RULES` maps the rows over the batch
# axes. Outside `sharding.activation_rules` (a model applied on its own) nothing is constrained.
ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")


def constrain_activation(x: jax.Array) -> jax.Array:
  """Pins the residual stream [B, T, D] to its logical layout (rows over data x fsdp x expert), so the
  partitioner gathers FSDP-sharded weights rather than the activations."""
  return nn.with_logical_constraint(
    x, ACTIVATION_AXES, fallback=nn.spmd.RulesFallback.NO_CONSTRAINT
  )


class Attention(nn.Module):
  """Grouped-query self-attention with RoPE, optional qkv bias and QK-norm."""

  cfg: ModelConfig
  implementation: str = attention.AUTO  # kernels.attention.IMPLEMENTATIONS (no parameters)

  @nn.compact
  def __call__(self, x, positions, key_valid, k_cache, v_cache, cache_index):
    """x: [B, Q, D]; key_valid: [B, N] bool; caches: [B, J, >= N, Dh] or None. Attention reads
    the first N cache slots (N, key_valid's static width, may be under the cache's length)
    with this call's keys at `cache_index`; returns the output and this call's keys and values
    [B, J, Q, Dh], which the caller writes into its cache (`write_tokens`)."""
    cfg = self.cfg
    h, j, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b = cfg.attention_bias
    if self.has_variable("params", "qkv"):  # the sampler's fused copy (quant.fuse_projections)
      names = ("embed", "heads", "head_dim")
      qkv = token_major(
        _dense(cfg, (h + 2 * j, dh), (h + 2 * j, dh), names, use_bias=b, name="qkv"), x
      )
      q, k, v = qkv[..., :h, :], qkv[..., h : h + j, :], qkv[..., h + j :, :]
    else:  # one matmul each: the learner's layout, and the reference
      q = token_major(
        _dense(cfg, (h, dh), (h, dh), ("embed", "heads", "head_dim"), use_bias=b, name="q"), x
      )
      k = token_major(
        _dense(cfg, (j, dh), (j, dh), ("embed", "kv_heads", "head_dim"), use_bias=b, name="k"), x
      )
      v = token_major(
        _dense(cfg, (j, dh), (j, dh), ("embed", "kv_heads", "head_dim"), use_bias=b, name="v"), x
      )
    if cfg.qk_norm:
      q = _norm(cfg, "q_norm", "head_dim")(q)
      k = _norm(cfg, "k_norm", "head_dim")(k)
    inv_freq = rope_inv_freq(cfg)
    q = checkpoint_name(rope(q, positions, cfg.rope_theta, inv_freq), "attn_q")
    k = checkpoint_name(rope(k, positions, cfg.rope_theta, inv_freq), "attn_k")
    v = checkpoint_name(v, "attn_v")

    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, J, Q, Dh]: the cache layout
    if k_cache is None:  # full-sequence forward: keys are this call's own tokens
      out = attention.attend(q, k, v, key_valid, 0, self.implementation)
    else:  # attend over the first N = key_valid slots, this call's keys at cache_index
      out = attention.attend(
        q, k_cache, v_cache, key_valid, cache_index, self.implementation, own=(k, v)
      )
      k, v = attention.ordered_after(out, k, v)  # the caller's write follows the read
    out = checkpoint_name(out, "attn_out")
    o = _dense(
      cfg, cfg.d_model, (cfg.d_model,), ("heads", "head_dim", "embed"), in_axes=(-2, -1), name="o"
    )
    return token_major(o, out, n_in=2), k, v


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """SiLU(gate) * up."""
  return nn.silu(gate) * up


class MLP(nn.Module):
  """SwiGLU feed-forward block."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    """x: [B, N, D] -> [B, N, D]."""
    cfg = self.cfg
    down = _dense(cfg, cfg.d_model, (cfg.d_model,), ("mlp", "embed"), name="down")
    if self.has_variable("params", "gate_up"):  # the sampler's fused copy
      f = cfg.mlp_dim
      gate_up = _dense(cfg, 2 * f, (2 * f,), ("embed", "mlp"), name="gate_up")
      return token_major(lambda t: down(_swiglu(*jnp.split(gate_up(t), 2, axis=-1))), x)
    gate = _dense(cfg, cfg.mlp_dim, (cfg.mlp_dim,), ("embed", "mlp"), name="gate")
    up = _dense(cfg, cfg.mlp_dim, (cfg.mlp_dim,), ("embed", "mlp"), name="up")
    return token_major(lambda t: down(_swiglu(gate(t), up(t))), x)


class Block(nn.Module):
  """Pre-norm transformer block with a dense SwiGLU or a mixture-of-experts feed-forward."""

  cfg: ModelConfig
  is_moe: bool = False
  attention: str = attention.AUTO  # kernels.attention.IMPLEMENTATIONS

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
    return constrain_activation(x + y), keys, values, aux


ATTENTION_NAMES = ("attn_q", "attn_k", "attn_v", "attn_out")  # checkpoint_name tags in Attention
# Rematerialisation of each block in the backward pass: what the forward keeps (jax.checkpoint).
REMAT_POLICIES = {
  "none": None,  # no remat: every activation is kept
  "full": jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
  "dots_saveable": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  # between none and full: keep the attention's projections and output (recompute the MLP)
  "attention": jax.checkpoint_policies.save_only_these_names(*ATTENTION_NAMES),
}


class LayerGroup(nn.Module):
  """`cfg.scan_period` consecutive blocks: one step of the scan over layers (`scan_layers`).

  The last block of the group is MoE in an MoE model. The carry is the residual stream and the
  stacked [L, B, J, N, Dh] cache, whose layer slices are read and written in place (only the
  new tokens are written back); the per-step inputs are the group index and the MoE layer's
  replayed and probed experts; the output is that layer's `_layer_moe` dict (None if dense).
  """

  cfg: ModelConfig
  remat: str = "none"  # a REMAT_POLICIES name, applied to each block
  decode: bool = False  # a decode step (its cache_index was traced before the scan)
  attention: str = attention.AUTO  # kernels.attention.IMPLEMENTATIONS, as the unrolled blocks'

  @nn.compact
  def __call__(self, carry, xs, positions, key_valid, cache_index, token_valid):
    """carry: (x [B, Q, D], k, v [L, B, J, N, Dh] or None); xs: (group [], replay, probe)."""
    cfg = self.cfg
    x, cache_k, cache_v = carry
    group, replay, probe = xs  # replay, probe: [B, Q, K] or None
    p = cfg.scan_period
    block_cls = Block
    if self.remat != "none":  # never in a decode step: cache_index is a Python int, kept static
      block_cls = nn.remat(
        Block, policy=REMAT_POLICIES[self.remat], prevent_cse=False, static_argnums=(6,)
      )
    moe = None
    for j in range(p):
      is_moe = bool(cfg.moe_num_experts) and j == p - 1
      layer = group * p + j
      kc = vc = None
      if cache_k is not None:
        kc = jax.lax.dynamic_index_in_dim(cache_k, layer, keepdims=False)
        vc = jax.lax.dynamic_index_in_dim(cache_v, layer, keepdims=False)
      block = block_cls(cfg, is_moe=is_moe, attention=self.attention, name=f"block_{j}")
      x, keys, values, aux = block(
        x, positions, key_valid, kc, vc, cache_index, replay if is_moe else None, token_valid
      )
      if cache_k is not None:
        cache_k = write_tokens(cache_k, keys, cache_index, layer, self.decode)
        cache_v = write_tokens(cache_v, values, cache_index, layer, self.decode)
      if aux is not None:
        moe = _layer_moe(aux, probe)
    return (x, cache_k, cache_v), moe


class Transformer(nn.Module):
  """The policy: token ids -> float32 logits, optionally reading/writing a KV cache."""

  cfg: ModelConfig
  remat: str = "none"  # a REMAT_POLICIES name; applies to passes with a static cache_index
  attention: str = attention.AUTO  # kernels.attention.IMPLEMENTATIONS; numerics only, not params

  @nn.compact
  def __call__(
    self,
    tokens: jax.Array,  # [B, Q] int32
    positions: jax.Array,  # [B, Q] int32 RoPE positions
    key_valid: jax.Array,  # [B, N] bool, left-padded: keys that may be attended (N = Q w/o cache)
    cache: KVCache | None = None,  # N slots or more: attention reads only the first N
    cache_index: jax.Array | int = 0,  # cache slot of tokens[:, 0]
    routing: jax.Array | None = None,  # [B, Q, Lm, K] experts to replay (spec §9)
    probe_experts: jax.Array | None = None,  # [B, Q, Lm, K] experts whose log-probs to report
    return_hidden: bool = False,  # skip the output layer: `unembed` the hidden states later
    token_valid: jax.Array | None = None,  # [B, Q] bool: tokens counted in MoE load / aux / z
  ) -> ModelOutput:
    """Returns float32 logits [B, Q, V], the updated cache and (optionally) values [B, Q].

    With `return_hidden`, the final-normed hidden states [B, Q, D] instead of the logits, so
    a caller can unembed only the positions it needs, in chunks (`unembed`). `token_valid`
    (default: the queries' `key_valid`) marks the real tokens, the only ones MoE statistics
    count (§8).
    """
    cfg = self.cfg
    embed = _embed(cfg)
    x = constrain_activation(embed(tokens))
    num_q = tokens.shape[1]
    if token_valid is not None:
      chex.assert_shape(token_valid, tokens.shape)
    elif cache is None:
      token_valid = key_valid
    else:
      token_valid = jax.lax.dynamic_slice_in_dim(key_valid, cache_index, num_q, axis=1)
    if cfg.scan_layers:
      x, new_cache, moe = self._scanned_layers(
        x, positions, key_valid, cache, cache_index, routing, probe_experts, token_valid
      )
    else:
      x, new_cache, moe = self._unrolled_layers(
        x, positions, key_valid, cache, cache_index, routing, probe_experts, token_valid
      )
    x = _norm(cfg, "final_norm")(x)
    if return_hidden:
      logits = None
    elif cfg.tie_embeddings:
      logits = token_major(embed.attend, x).astype(jnp.float32)
    else:
      lm_head = _dense(cfg, cfg.vocab_size, (cfg.vocab_size,), ("embed", "vocab"), name="lm_head")
      logits = token_major(lm_head, x).astype(jnp.float32)
    values = None
    if cfg.value_head:  # critic on the shared trunk (spec §2.9)
      head = _dense(cfg, 1, (1,), ("embed", None), use_bias=True, name="value_head")
      values = token_major(head, x)
      values = values[..., 0].astype(jnp.float32)
    hidden = x if return_hidden else None
    return ModelOutput(logits=logits, cache=new_cache, values=values, moe=moe, hidden=hidden)

  def _unrolled_layers(
    self, x, positions, key_valid, cache, cache_index, routing, probe_experts, token_valid
  ):
    """The blocks as `layer_{i}` submodules, one Python iteration each."""
    cfg = self.cfg
    new_k, new_v, moe_layers_out = [], [], []
    moe_layers = cfg.moe_layers
    for i in range(cfg.num_layers):
      kc = None if cache is None else cache.k[i]
      vc = None if cache is None else cache.v[i]
      is_moe = i in moe_layers
      replay = probe = None
      if is_moe and routing is not None:
        replay = routing[:, :, moe_layers.index(i)]
      if is_moe and probe_experts is not None:
        probe = probe_experts[:, :, moe_layers.index(i)]
      block_cls = Block
      # Not in decode steps (traced cache_index). static_argnums counts self: cache_index.
      if self.remat != "none" and not is_decode_step(cache_index):
        block_cls = nn.remat(Block, policy=REMAT_POLICIES[self.remat], static_argnums=(6,))
      block = block_cls(cfg, is_moe=is_moe, attention=self.attention, name=f"layer_{i}")
      x, keys, values, aux = block(
        x, positions, key_valid, kc, vc, cache_index, replay, token_valid
      )
      if cache is not None:
        new_k.append(write_tokens(kc, keys, cache_index))
        new_v.append(write_tokens(vc, values, cache_index))
      if aux is not None:
        moe_layers_out.append(_layer_moe(aux, probe))
    new_cache = None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v))
    moe = None
    if moe_layers_out:
      moe = _collect_moe(jax.tree.map(lambda *a: jnp.stack(a), *moe_layers_out))
    return x, new_cache, moe

  def _scanned_layers(
    self, x, positions, key_valid, cache, cache_index, routing, probe_experts, token_valid
  ):
    """The blocks as one `LayerGroup` scanned over L / scan_period steps (`layers`)."""
    cfg = self.cfg
    num_groups = cfg.num_layers // cfg.scan_period
    decode = is_decode_step(cache_index)
    remat = "none" if decode else self.remat  # not in decode steps
    layer_axis = lambda a: None if a is None else jnp.moveaxis(a, 2, 0)  # noqa: E731
    xs = (jnp.arange(num_groups), layer_axis(routing), layer_axis(probe_experts))
    scanned = nn.scan(
      LayerGroup,
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},  # a dropout mask of its own per layer
      in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
      length=num_groups,
      metadata_params={nn.PARTITION_NAME: SCAN_NAME},
    )(cfg, remat=remat, decode=decode, attention=self.attention, name=SCAN_NAME)
    carry = (x, None, None) if cache is None else (x, cache.k, cache.v)
    # A static slot stays static (a prefill at 0 may take the cuDNN form, as unrolled blocks do).
    index = jnp.asarray(cache_index, jnp.int32) if decode else cache_index
    (x, cache_k, cache_v), moe = scanned(carry, xs, positions, key_valid, index, token_valid)
    new_cache = None if cache is None else KVCache(k=cache_k, v=cache_v)
    return x, new_cache, None if moe is None else _collect_moe(moe)


def unembed(cfg: ModelConfig, params, hidden: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Logits [.., V] of final-normed hidden states [.., D]: the model's output layer (the tied
  embedding or `lm_head`) applied outside the module, at the compute dtype, then cast to
  `dtype` (float32; None keeps the compute dtype: the sampler casts inside its fused passes)."""
  dt = cfg.compute_dtype
  if cfg.tie_embeddings:
    w = params["embed"]["embedding"].astype(dt)  # [V, D]
    layer = lambda x: jnp.einsum("nd,vd->nv", x, w)  # noqa: E731
  else:
    w = params["lm_head"]["kernel"].astype(dt)  # [D, V]
    layer = lambda x: jnp.einsum("nd,dv->nv", x, w)  # noqa: E731
  logits = token_major(layer, hidden.astype(dt))
  return logits if dtype is None else logits.astype(dtype)


def _layer_moe(aux: dict, probe: jax.Array | None) -> dict:
  """One MoE layer's part of `MoEOutput` from its aux dict; probe: [B, Q, K] experts or None."""
  logprobs = aux["router_logprobs"]  # [B, Q, E]
  return {
    "routing": aux["topk"],
    "used": gather_expert_logprobs(logprobs, aux["topk"]),
    "probe": None if probe is None else gather_expert_logprobs(logprobs, probe),
    "differs": aux["route_differs"],
    "load": aux["load"],
    "aux_loss": aux["aux_loss"],
    "z_loss": aux["z_loss"],
  }


def _collect_moe(layers: dict) -> MoEOutput:
  """`MoEOutput` of `_layer_moe` dicts stacked on a leading Lm axis (moved after the tokens)."""
  tokens_first = lambda a: None if a is None else jnp.moveaxis(a, 0, 2)  # noqa: E731
  return MoEOutput(
    routing=tokens_first(layers["routing"]),  # [B, Q, Lm, K]
    used_logprobs=tokens_first(layers["used"]),
    probe_logprobs=tokens_first(layers["probe"]),
    own_differs=tokens_first(layers["differs"]),  # [B, Q, Lm]
    load=layers["load"],  # [Lm, E]
    aux_loss=jnp.mean(layers["aux_loss"]),
    z_loss=jnp.mean(layers["z_loss"]),
  )


def positions_from_mask(valid: jax.Array) -> jax.Array:
  """RoPE positions for left-padded rows: 0 at the first real token. valid: [B, N] bool."""
  return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)
