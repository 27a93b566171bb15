"""Mixture-of-experts SwiGLU feed-forward block with top-k routing and routing replay.

`MoEMLP` is a drop-in replacement for the dense SwiGLU `MLP`: a float32 router picks
K of E experts per token, each expert is a SwiGLU, and the experts' outputs are summed
with gate weights. Optional always-on shared experts (DeepSeek / Qwen-MoE style) are
added to the output. Besides the output it returns the routing (`topk`, the router's
logits and log-probs) and the regularisers of objectives.md §8; given a recorded routing
it replays it (§9).

The implementations give the same values and gradients:
  - `ragged` (dropless): the N·K (token, expert) assignments are sorted by expert and run
    through `jax.lax.ragged_dot`, one group per expert; no capacity, no dropped tokens. A
    grouped kernel on TPU; XLA expands it to a dense rows x (experts x width) matmul on CPU/GPU.
  - `portable`: the same sorted assignments in tiles of one expert each under a `lax.scan`
    (`kernels.grouped.grouped_swiglu`, its own gradient): each tile gathers its tokens, runs
    gate/up/down and adds the gated output back; O(tokens x d_model) memory on any backend.
  - `auto`: `ragged` on TPU, `portable` elsewhere.
  - `dense`: every expert is applied to every token and the results are combined with a
    [B, N, E] gate matrix. E times the compute; the reference for tests.

Parameters and their logical axes:
  router  kernel [D, E]  ('embed', 'expert')
  gate    [E, D, F]      ('expert', 'embed', 'mlp')
  up      [E, D, F]      ('expert', 'embed', 'mlp')
  down    [E, F, D]      ('expert', 'mlp', 'embed')
  shared/{gate,up}/kernel [D, Fs] ('embed', 'mlp'), shared/down/kernel [Fs, D] ('mlp', 'embed')
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl_llm import sharding
from jaxrl_llm.kernels import grouped, verify
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import IMPLS, ModelConfig, MoEConfig, index_dtype  # noqa: F401


def gather_expert_logprobs(router_logprobs: jax.Array, topk: jax.Array) -> jax.Array:
  """log p(e) of the given experts: [B, N, E] float32, [B, N, K] int -> [B, N, K] (§2.8)."""
  chex.assert_rank([router_logprobs, topk], 3)
  return jnp.take_along_axis(router_logprobs, topk.astype(jnp.int32), axis=-1)


def weighted_loss(moe: MoEConfig, aux: dict[str, jax.Array]) -> jax.Array:
  """aux_loss_coef · load-balance loss + z_loss_coef · z-loss of one layer (§8)."""
  return moe.aux_loss_coef * aux["aux_loss"] + moe.z_loss_coef * aux["z_loss"]


def _gates(logits: jax.Array, idx: jax.Array, normalize: bool) -> jax.Array:
  """Float32 gate weights [B, N, K] of experts `idx` from router logits [B, N, E].

  normalize: softmax over the chosen experts' logits (= top-k softmax probs renormalised to
  sum to 1); otherwise the full-softmax probabilities of the chosen experts.
  """
  chosen = jnp.take_along_axis(logits, idx, axis=-1)  # [B, N, K]
  if normalize:
    return jax.nn.softmax(chosen, axis=-1)
  return jnp.exp(chosen - jax.nn.logsumexp(logits, axis=-1, keepdims=True))


class _SwiGLU(nn.Module):
  """Dense SwiGLU D -> hidden -> D (the shared experts, fused into one)."""

  cfg: ModelConfig
  hidden: int

  @nn.compact
  def __call__(self, x):
    """x: [B, N, D] -> [B, N, D]."""
    cfg = self.cfg

    def dense(features, axes, name):
      kwargs = dict(
        use_bias=False,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.weight_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
      )
      return lora.projection(cfg, name, axes, features=features, **kwargs)

    gate = dense(self.hidden, ("embed", "mlp"), "gate")(x)
    up = dense(self.hidden, ("embed", "mlp"), "up")(x)
    return dense(cfg.d_model, ("mlp", "embed"), "down")(nn.silu(gate) * up)


def _experts_dense(x, idx, gates, w_gate, w_up, w_down):
  """Every expert on every token, combined by a [B, N, E] gate matrix (reference)."""
  e = w_gate.shape[0]
  h = nn.silu(jnp.einsum("bnd,edf->bnef", x, w_gate)) * jnp.einsum("bnd,edf->bnef", x, w_up)
  out = jnp.einsum("bnef,efd->bned", h, w_down)  # [B, N, E, D]
  combine = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32) * gates[..., None], axis=-2)
  return jnp.einsum("bne,bned->bnd", combine, out.astype(jnp.float32))  # [B, N, D] float32


def _experts_ragged(x, idx, gates, w_gate, w_up, w_down, *, matmul=jax.lax.ragged_dot):
  """Dropless: sort the N·K assignments by expert and run one grouped matmul per weight
  (`jax.lax.ragged_dot`; `kernels.grouped.grouped_matmul` computes the same)."""
  b, n, d = x.shape
  e, k = w_gate.shape[0], idx.shape[-1]
  flat_idx = idx.reshape(-1)  # [B·N·K], assignment a = token·K + slot
  order = jnp.argsort(flat_idx, stable=True)  # assignments grouped by expert
  group_sizes = jnp.bincount(flat_idx, length=e).astype(jnp.int32)  # [E]; others dropped
  xs = x.reshape(b * n, d)[order // k]  # [B·N·K, D] token rows, sorted by expert
  h = nn.silu(matmul(xs, w_gate, group_sizes)) * matmul(xs, w_up, group_sizes)
  out = matmul(h, w_down, group_sizes)  # [B·N·K, D] sorted
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  out = out[inverse].reshape(b, n, k, d).astype(jnp.float32)  # back to assignment order
  return jnp.einsum("bnk,bnkd->bnd", gates, out)  # [B, N, D] float32


def _experts_portable(x, idx, gates, w_gate, w_up, w_down):
  """Dropless, fused: `kernels.grouped.grouped_swiglu` gathers each tile of one expert's
  assignments, runs its SwiGLU and adds the gated result into the tokens' rows."""
  b, n, d = x.shape
  k = idx.shape[-1]
  y = grouped.grouped_swiglu(
    x.reshape(b * n, d), idx.reshape(b * n, k), gates.reshape(b * n, k), w_gate, w_up, w_down
  )
  return y.reshape(b, n, d)  # float32


def _experts_kernel(x, idx, gates, w_gate, w_up, w_down, *, ops="mgpu"):
  """Dropless, as `ragged`, on the Mosaic GPU grouped matmuls (`kernels.grouped.kernel_matmul`,
  Hopper GPUs; ops="mgpu_forward" is what the Pallas GPU interpreter runs on CPU, for tests)."""
  matmul = functools.partial(grouped.kernel_matmul, ops=ops)
  return _experts_ragged(x, idx, gates, w_gate, w_up, w_down, matmul=matmul)


EXPERTS = {
  "kernel": _experts_kernel,
  "ragged": _experts_ragged,
  "portable": _experts_portable,
  "dense": _experts_dense,
}


def _gathered(w: jax.Array, spec: PartitionSpec) -> jax.Array:
  """A device's block of a weight laid out as `spec`, gathered over every mesh axis but
  `expert` (inside `shard_map`). The result is typed invariant over those axes, so its
  gradient is summed over them and each device keeps its block: sharded like the weight."""
  for dim, entry in enumerate(spec):
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    others = tuple(a for a in names if a != "expert")
    if others:
      w = jax.lax.all_gather(w, others, axis=dim, tiled=True, to="invarying")
  return w


def _dispatch(x, idx, gates, w_gate, w_up, w_down, *, experts, ep: int, specs):
  """One device's part of expert parallelism (inside `shard_map`): its tokens' assignments go
  to the devices holding their experts by all-to-all, run there, and come back. With one
  expert-parallel device (ep = 1) the device runs its tokens through its experts directly.

  x [t, D], idx / gates [t, K] (experts >= E mark padding), w_* the device's E/ep experts.
  Buffers are static and dropless: each of the ep destinations gets room for all t·K
  assignments (the worst case: every token routed to one device's experts)."""
  w_gate, w_up, w_down = (_gathered(w, p) for w, p in zip((w_gate, w_up, w_down), specs))
  t, k = idx.shape
  if ep == 1:
    return experts(x[None], idx[None], gates[None], w_gate, w_up, w_down)[0]
  local = w_gate.shape[0]
  flat = idx.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True)  # assignments by expert, hence by destination
  dest = flat[order] // local  # ep for padding: dropped below
  counts = jnp.zeros((ep + 1,), jnp.int32).at[dest].add(1)
  slot = jnp.arange(t * k) - (jnp.cumsum(counts) - counts)[dest]  # place in dest's block
  send = jnp.zeros((ep, t * k, x.shape[-1]), x.dtype).at[dest, slot].set(x[order // k], mode="drop")
  send_ids = (
    jnp.full((ep, t * k), local, jnp.int32).at[dest, slot].set(flat[order] % local, mode="drop")
  )
  recv = jax.lax.all_to_all(send, "expert", 0, 0)  # recv[j]: what device j sends here
  recv_ids = jax.lax.all_to_all(send_ids, "expert", 0, 0)
  rows = recv.reshape(1, ep * t * k, -1)
  ones = jnp.ones((1, ep * t * k, 1), jnp.float32)
  out = experts(rows, recv_ids.reshape(1, -1, 1), ones, w_gate, w_up, w_down)  # padding -> 0
  back = jax.lax.all_to_all(out.astype(x.dtype).reshape(ep, t * k, -1), "expert", 0, 0)
  mine = back.at[dest, slot].get(mode="fill", fill_value=0)  # [t·K, D] in sorted order
  per_slot = jnp.zeros(mine.shape, jnp.float32).at[order].set(mine.astype(jnp.float32))
  return jnp.einsum("tk,tkd->td", gates, per_slot.reshape(t, k, -1))


def experts_parallel(x, idx, gates, w_gate, w_up, w_down, *, experts, mesh, batch_axes):
  """Routed experts under `jax.shard_map`: every device routes its own tokens (the rows over
  `batch_axes` x `expert`), and with experts sharded over the `expert` mesh axis dispatches
  them to their experts' devices and back by all-to-all (`_dispatch`); y [B, N, D] float32,
  as `experts` gives. Weights enter in their own layout and are gathered inside over every
  axis but `expert` (one layer at a time), so their gradients leave sharded as they are."""
  b, n, d = x.shape
  e, ep = w_gate.shape[0], mesh.shape["expert"]
  shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
  per_shard = b // shards * n  # tokens of one batch shard
  t = -(-per_shard // ep)  # tokens per device

  def split(a, fill):  # [B, N, ...] -> [shards·ep·t, ...]: rows over batch axes x expert
    a = a.reshape(shards, per_shard, *a.shape[2:])
    pad = [(0, 0), (0, ep * t - per_shard)] + [(0, 0)] * (a.ndim - 2)
    return jnp.pad(a, pad, constant_values=fill).reshape(shards * ep * t, *a.shape[2:])

  rows = PartitionSpec((*batch_axes, "expert"))
  specs = tuple(
    sharding.logical_spec(axes) or PartitionSpec("expert")
    for axes in (("expert", "embed", "mlp"), ("expert", "embed", "mlp"), ("expert", "mlp", "embed"))
  )
  fn = jax.shard_map(
    functools.partial(_dispatch, experts=experts, ep=ep, specs=specs),
    mesh=mesh,
    in_specs=(rows, rows, rows, *specs),
    out_specs=rows,
  )
  y = fn(split(x, 0), split(idx.astype(jnp.int32), e), split(gates, 0), w_gate, w_up, w_down)
  return y.reshape(shards, ep * t, d)[:, :per_shard].reshape(b, n, d)


def kernel_refusal(device, dtype, dims: tuple[int, ...]) -> str | None:
  """The error of an explicit `model.moe_impl='kernel'` on `device` (a jax Device or None) with
  compute `dtype` and matmul widths `dims`: why it cannot run and what runs instead (None where
  it can, or under the Pallas GPU interpreter of the tests). The config check gives it before
  anything is built."""
  why = grouped.kernel_unsupported(device, dtype, dims)
  if why is None or grouped.interpreting():
    return None
  return (
    f"model.moe_impl='kernel' cannot run here: {why}. Allowed on this backend: "
    "auto, portable, ragged, dense"
  )


def resolve_impl(impl: str, device=None, dtype=jnp.bfloat16, dims: tuple[int, ...] = ()) -> str:
  """The expert implementation for `impl` on `device` (a jax Device or a platform name; None:
  the default backend's first device). `auto`: `ragged` on TPU (`jax.lax.ragged_dot` lowers
  to a grouped kernel there), `kernel` on Hopper GPUs when the Mosaic GPU kernels accept
  `dtype` and the widths `dims` and their checks pass on this device (`verify.choose`, once
  per process), else `portable` (XLA expands ragged_dot to a dense E x rows
  product on CPU and other GPUs). An explicit `kernel` where it cannot run is an error naming
  why, except under the Pallas GPU interpreter (tests)."""
  if device is None:
    device = jax.devices()[0]
  if isinstance(device, str):
    platform, device = device, None
  else:
    platform = device.platform
  why = grouped.kernel_unsupported(device, dtype, dims)
  if impl == "kernel" and (error := kernel_refusal(device, dtype, dims)):
    raise ValueError(error)
  if impl != "auto":
    return impl
  if platform == "tpu":
    return "ragged"
  return verify.choose("moe_kernel", "kernel", "portable") if why is None else "portable"


def _router(cfg: ModelConfig, num_experts: int) -> nn.Dense:
  """The float32 router D -> E (its kernel stored at `cfg.weight_dtype`)."""
  return nn.Dense(
    num_experts,
    use_bias=False,
    dtype=jnp.float32,
    param_dtype=cfg.weight_dtype,
    kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "expert")),
    name="router",
  )


def _route(logits: jax.Array, k: int, replay: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """Experts idx [B, N, K] int32 to use and whether the router's own top-k set differs, [B, N]
  bool (§9). Without `replay` the router's top-k; with it the replayed experts, except on
  tokens with a negative entry (slots never routed), which keep the router's choice."""
  b, n = logits.shape[:2]
  _, own_idx = jax.lax.top_k(logits, k)  # [B, N, K] int32
  if replay is None:
    return own_idx, jnp.zeros((b, n), bool)
  chex.assert_shape(replay, (b, n, k))
  replay = replay.astype(jnp.int32)
  recorded = jnp.all(replay >= 0, axis=-1)  # a negative entry: a slot never routed (-1)
  idx = jnp.where(recorded[..., None], replay, own_idx)
  differs = recorded & jnp.any(jnp.sort(own_idx, axis=-1) != jnp.sort(idx, axis=-1), axis=-1)
  return idx, differs


def _expert_params(module: nn.Module, e: int, d: int, f: int):
  """The routed experts' SwiGLU weights gate, up [E, D, F] and down [E, F, D] of `module` (an
  `MoEMLP`, inside its compact call), stacked on a leading expert axis; fan-in D (F for down)."""
  init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
  dtype = module.cfg.weight_dtype
  return tuple(
    module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)
    for name, shape, axes in (
      ("gate", (e, d, f), ("expert", "embed", "mlp")),
      ("up", (e, d, f), ("expert", "embed", "mlp")),
      ("down", (e, f, d), ("expert", "mlp", "embed")),
    )
  )


def _experts_for(impl: str, dtype, dims: tuple[int, ...]):
  """The routed-experts function of `impl` (an `EXPERTS` entry, `resolve_impl`d for the devices
  the program is compiled for: a TPU slice from a CPU host too), under `experts_parallel` when
  tracing on a mesh of several devices."""
  active = sharding.active_mesh()
  device = active[0].devices.flat[0] if active else None
  impl = resolve_impl(impl, device, dtype, dims)
  experts = EXPERTS[impl]
  if impl == "kernel" and (device or jax.devices()[0]).platform != "gpu":
    experts = functools.partial(experts, ops="mgpu_forward")  # the GPU interpreter (tests)
  if active is not None and impl != "dense" and active[0].size > 1:
    mesh, batch_axes = active  # each device routes its own rows (and dispatches them)
    experts = functools.partial(
      experts_parallel,
      experts=experts,
      mesh=mesh,
      batch_axes=tuple(a for a in batch_axes if a != "expert"),
    )
  return experts


def _regularisers(logits, logprobs, idx, mask, e: int, k: int):
  """(load [E], aux_loss, z_loss) of §8 over the valid tokens of `mask` [B, N]: the stop-gradient
  fraction of valid assignments per expert, E·Σ_e load_e·mean router prob_e and the mean of
  logsumexp(logits)²."""
  valid = mask.astype(jnp.float32)  # [B, N]
  num_valid = jnp.maximum(jnp.sum(valid), 1.0)
  assigned = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=-2)  # [B, N, E]
  load = jax.lax.stop_gradient(jnp.einsum("bn,bne->e", valid, assigned) / (num_valid * k))
  mean_prob = jnp.einsum("bn,bne->e", valid, jnp.exp(logprobs)) / num_valid  # [E]
  aux_loss = e * jnp.sum(load * mean_prob)
  z = jax.nn.logsumexp(logits, axis=-1)  # [B, N]
  z_loss = jnp.sum(valid * z**2) / num_valid
  return load, aux_loss, z_loss


class MoEMLP(nn.Module):
  """Top-k routed SwiGLU experts plus optional shared experts (objectives.md §8, §9).

  Uses `cfg.d_model`, `cfg.compute_dtype` (expert matmuls) and `cfg.weight_dtype`; the router,
  its softmax and the gates are float32 whatever the compute dtype.
  """

  cfg: ModelConfig
  moe: MoEConfig

  @nn.compact
  def __call__(
    self,
    x: jax.Array,  # [B, N, D]
    replay: jax.Array | None = None,  # [B, N, K] int: experts to use instead of the router's
    mask: jax.Array | None = None,  # [B, N] bool: tokens counted in load / aux / z losses
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns y [B, N, D] (compute dtype) and the routing/regulariser dict.

    aux: 'topk' [B, N, K] (`moe.index_dtype`) experts used (the replayed ones under replay);
    'router_logits' / 'router_logprobs' [B, N, E] float32; 'load' [E] float32 fraction of the
    valid (token, k) assignments per expert (stop-gradient, sums to 1); 'aux_loss' scalar
    E·Σ_e f_e p_e with f = load and p_e the mean router prob over valid tokens (1 when
    balanced, whatever K); 'z_loss' scalar mean over valid tokens of logsumexp(logits)²;
    'route_differs' [B, N] bool, whether the router's own top-k set differs from the replayed
    set (all False without replay; §9 metric).

    Replay (§9): the experts in `replay` are used (tokens whose entry is negative, slots the
    sampler never reached, use the router's own choice), with gates recomputed from the current
    router logits by the same normalisation as unreplayed routing (softmax over the replayed
    experts' logits when `normalize_gates`), so the router still receives gradient.
    """
    cfg, moe = self.cfg, self.moe
    e, k, f, d = moe.num_experts, moe.top_k, moe.expert_mlp_dim, cfg.d_model
    chex.assert_rank(x, 3)
    chex.assert_axis_dimension(x, 2, d)
    b, n = x.shape[:2]
    if mask is None:
      mask = jnp.ones((b, n), bool)
    chex.assert_shape(mask, (b, n))

    logits = _router(cfg, e)(x.astype(jnp.float32))  # [B, N, E], float32 throughout
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    idx, differs = _route(logits, k, replay)
    gates = _gates(logits, idx, moe.normalize_gates)  # [B, N, K] float32

    w_gate, w_up, w_down = _expert_params(self, e, d, f)
    dt = cfg.compute_dtype
    experts = _experts_for(moe.impl, dt, (d, f))
    y = experts(x.astype(dt), idx, gates, w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt))
    y = y.astype(dt)
    if moe.num_shared_experts:
      y = y + _SwiGLU(cfg, moe.shared_hidden_dim, name="shared")(x.astype(dt))

    load, aux_loss, z_loss = _regularisers(logits, logprobs, idx, mask, e, k)
    aux = {
      "topk": idx.astype(moe.index_dtype),
      "router_logits": logits,
      "router_logprobs": logprobs,
      "load": load,
      "aux_loss": aux_loss,
      "z_loss": z_loss,
      "route_differs": differs,
    }
    return y, aux
