"""Optimiser steps over a `PolicyBatch` and the reference policy's life cycle (spec §4, §5).

`optimise` shuffles the batch once per epoch, splits it into minibatches (a tree map) and runs
them in a `lax.scan`; each minibatch accumulates its gradient over microbatches in an inner
`lax.scan` with one minibatch-level normaliser, so the update does not depend on the number
of microbatches (§5).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import optim, sharding
from jaxrl_llm.config.learner import KLSettings, RLSettings, Settings
from jaxrl_llm.models import lora
from jaxrl_llm.rl import loss as rl_loss
from jaxrl_llm.rl import metrics as rl_metrics
from jaxrl_llm.rl.stages import split_leading
from jaxrl_llm.types import PolicyBatch, TrainState

LossFn = Callable[[Any, PolicyBatch, rl_loss.Normalizers], tuple[jax.Array, dict[str, jax.Array]]]


def minibatch_grads(
  loss_fn: LossFn,
  params,
  mb: PolicyBatch,
  *,
  settings: Settings,
  max_len: int,
  prompt_group: int = 1,
  dropout_key: jax.Array | None = None,
):
  """Gradient and metrics of one minibatch, accumulated over its microbatches (§5).

  `dropout_key` (adapter dropout on): each microbatch's loss gets its own key from it, as
  `loss_fn(..., dropout_key=k)`; None: `loss_fn(params, mb, norms)`, no key drawn."""
  norms = rl_loss.normalizers(mb, settings, max_len)
  num_microbatches = settings.rl.num_microbatches
  block = rl_loss.prompt_block(prompt_group, mb.tokens.shape[0] // num_microbatches)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def accumulate(grads, xs):
    micro, key = xs
    micro = sharding.constrain_rows(micro)  # each device computes its own rows
    keyword = {} if key is None else {"dropout_key": key}
    (_, metrics), g = grad_fn(params, micro, norms, **keyword)
    return jax.tree.map(jnp.add, grads, g), metrics

  zeros = jax.tree.map(jnp.zeros_like, params)
  micro = sharding.constrain_rows(split_leading(mb, num_microbatches, block), axis=1)
  grads, metrics = jax.lax.scan(accumulate, zeros, (micro, _split(dropout_key, num_microbatches)))
  return grads, rl_metrics.microbatch_mean(metrics, num_microbatches)


def _split(key: jax.Array | None, num: int) -> jax.Array | None:
  """`num` keys from `key` (one per scan step), or None without one."""
  return None if key is None else jax.random.split(key, num)


def minibatch_step(carry, mb: PolicyBatch, *, loss_fn: LossFn, optimizer, **kwargs):
  """One optimiser step `((params, opt_state), mb) -> ((params, opt_state), metrics)`;
  `kwargs` are `minibatch_grads`'s (`dropout_key` included). A non-finite loss, gradient or
  update skips the step (`optim.guarded_update`), counted in `optim/skipped_updates`."""
  params, opt_state = carry
  frozen, params = lora.trainable(params)  # adapters only, when the policy has them
  if frozen is not None:
    loss_fn = _on_frozen(loss_fn, frozen)
  grads, metrics = minibatch_grads(loss_fn, params, mb, **kwargs)
  metrics.update(rl_metrics.grad_norm(grads))
  params, opt_state, skipped = optim.guarded_update(
    optimizer, grads, opt_state, params, metrics["policy/total_loss"]
  )
  metrics["optim/skipped_updates"] = skipped.astype(jnp.float32)
  return (lora.with_frozen(frozen, params), opt_state), metrics


def _on_frozen(loss_fn: LossFn, frozen) -> LossFn:
  """`loss_fn` of the adapters alone, on the fixed base `frozen` (keywords passed on)."""
  return lambda adapters, mb, norms, **kw: loss_fn(
    lora.join_adapters(frozen, adapters), mb, norms, **kw
  )


def minibatch_order(key: jax.Array, batch_size: int, rl: RLSettings, block: int = 1) -> jax.Array:
  """Row indices [E*M, B/M]: one permutation per epoch of blocks of `block` consecutive rows
  (rows sharing a prompt stay together), cut into M minibatches."""
  perms = jax.vmap(lambda k: jax.random.permutation(k, batch_size // block))(
    jax.random.split(key, rl.num_epochs)
  )  # [E, B / block]
  rows = (perms[..., None] * block + jnp.arange(block)).reshape(rl.num_epochs, batch_size)
  return rows.reshape(rl.num_epochs * rl.num_minibatches, batch_size // rl.num_minibatches)


def optimise(
  loss_fn: LossFn,
  optimizer,
  params,
  opt_state,
  batch: PolicyBatch,
  key: jax.Array,
  *,
  settings: Settings,
  max_len: int,
  dropout_key: jax.Array | None = None,
  prompt_group: int = 1,
):
  """Epochs × minibatches of optimiser steps; returns (params, opt_state, metrics [E*M]).

  `prompt_group` G > 1: the batch is group-major and the loss shares each prompt over blocks
  of gcd(G, microbatch rows) rows, which the shuffle and the microbatch split keep together.
  `dropout_key` (`adapter_dropout_key`, adapter dropout on): one key per optimiser step, split
  per microbatch by `minibatch_grads`; None (the default): no dropout, no key drawn.
  """
  rl = settings.rl
  b = batch.tokens.shape[0]
  block = rl_loss.prompt_block(prompt_group, b // (rl.num_minibatches * rl.num_microbatches))
  order = minibatch_order(key, b, rl, block)
  minibatches = jax.tree.map(lambda x: x[order], batch)  # leaves [E*M, B/M, ...]
  minibatches = sharding.constrain_rows(minibatches, axis=1)
  step = functools.partial(
    minibatch_step,
    loss_fn=loss_fn,
    optimizer=optimizer,
    settings=settings,
    max_len=max_len,
    prompt_group=prompt_group,
  )
  xs = (minibatches, _split(dropout_key, order.shape[0]))
  keyed = lambda carry, x: step(carry, x[0], dropout_key=x[1])  # noqa: E731
  (params, opt_state), metrics = jax.lax.scan(keyed, (params, opt_state), xs)
  return params, opt_state, metrics


DROPOUT_STREAM = 0x64726F70  # fold_in data of the adapter-dropout keys ("drop")


def adapter_dropout_key(model_cfg, key: jax.Array) -> jax.Array | None:
  """The learner's adapter-dropout key (`model.lora_dropout` > 0): fold_in(key, DROPOUT_STREAM),
  a key of its own that leaves every other draw of `key` as it was; None when dropout is off."""
  if not model_cfg.lora_dropout:
    return None
  return jax.random.fold_in(key, DROPOUT_STREAM)


def init_reference(state: TrainState, beta: float) -> TrainState:
  """Freezes a copy of the current policy as the KL reference (§4); none when β = 0, and
  none under adapters, whose reference is the base they sit on (`reference_params`)."""
  if beta <= 0 or state.ref_params is not None or lora.has_adapters(state.params):
    return state
  shardings = jax.tree.map(lambda x: x.sharding, state.params)  # one program, not one per leaf
  return state.replace(ref_params=jax.jit(_copies, out_shardings=shardings)(state.params))


def _copies(tree):
  return jax.tree.map(jnp.copy, tree)


def reference_params(state: TrainState):
  """The KL reference's parameters (§4): the frozen copy, or the base under adapters."""
  if state.ref_params is None and lora.has_adapters(state.params):
    return lora.reference(state.params)
  return state.ref_params


def update_reference(state: TrainState, params, opt_state, *, kl: KLSettings, optimizer):
  """Reference update after the step (§4): frozen, reset every N steps, or EMA.

  Returns (ref_params, opt_state); with `reset_optimizer` a reset also restarts Adam's
  moments (`optim.reset_moments`), while the learning-rate schedule goes on from its count.
  """
  ref = state.ref_params
  if ref is None or kl.reference == "frozen":
    return ref, opt_state
  if kl.reference == "ema":
    a = kl.ema
    return jax.tree.map(lambda r, p: a * p + (1.0 - a) * r, ref, params), opt_state
  reset = (state.step + 1) % kl.reset_every == 0
  ref = jax.tree.map(lambda r, p: jnp.where(reset, p, r), ref, params)
  if kl.reset_optimizer:
    fresh = optim.reset_moments(optimizer, lora.trainable(params)[1], opt_state)
    opt_state = jax.tree.map(lambda o, f: jnp.where(reset, f, o), opt_state, fresh)
  return ref, opt_state
