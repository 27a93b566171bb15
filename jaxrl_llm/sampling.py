"""The in-graph sampler: prefill + KV-cache decode inside `lax.while_loop`.

`sample` is a pure function of (params, prompts, rng), callable inside the fused RL step.
Each prompt is prefilled once and its cache is shared by its G completions. The loop exits
early once every sequence has emitted EOS. The decode runs in static stages of
`SamplingConfig.kv_block` steps, one `while_loop` each, whose attention reads only the first
S + (k+1)·kv_block cache slots (all its steps can have filled), not the whole S+T cache. While
drawing tokens it records, per token, the log-prob of the *sampling distribution* (spec §0):
log-softmax of logits / temperature over the full vocabulary; top-k / top-p only restrict which
token is drawn.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm.config.sections import SamplingSettings
from jaxrl_llm.kernels import attention, logprobs
from jaxrl_llm.models.kv_cache import KVCache, grow_cache, init_cache
from jaxrl_llm.models.transformer import MoEOutput, Transformer, positions_from_mask, unembed
from jaxrl_llm.turns import Turns, over_budget, take_turns
from jaxrl_llm.types import Rollout

_DEFAULT = SamplingSettings()  # the `sampling` section's defaults, written there once


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static sampler settings (hashable, bound at trace time)."""

  max_new_tokens: int  # T: completion budget
  group_size: int = 1  # G: completions per prompt
  temperature: float = _DEFAULT.temperature  # τ_s; the recorded log-probs are of logits / τ_s
  top_k: int = _DEFAULT.top_k  # draw only among the k most likely tokens (0 = off)
  top_p: float = _DEFAULT.top_p  # nucleus: draw within the smallest set of mass >= top_p
  greedy: bool = False  # argmax decoding (evaluation); log-probs still use τ_s
  eos_id: int = 2  # end-of-sequence token id
  pad_id: int = 0  # id written after EOS
  kv_block: int = (
    _DEFAULT.kv_block
  )  # decode stage length: attention reads S + (k+1)·kv_block slots (0 = S+T)
  loop_axis: str | None = None  # a pack's vmap axis name: its runs' decode loops stop together
  tool: Any = None  # an `envs.ToolEnv` answering the policy's calls (None: single-turn)
  float32_logits: bool = False  # reference path: the model's float32 [B, V] logits each step
  max_turns: int = 1  # the policy's segments per episode: at most max_turns - 1 tool calls
  turn_tokens: int = _DEFAULT.turn_tokens  # the most tokens of one policy segment (0: off)


def with_values(cfg: SamplingConfig, values: Mapping[str, Any] | None) -> SamplingConfig:
  """`cfg` with traced `sampling.*` values (a pack's per-run or a single run's own; which
  fields may be traced is declared in `config.sections.SamplingSettings`) in place; None: `cfg`."""
  section = {k.partition(".")[2]: v for k, v in (values or {}).items() if k.startswith("sampling.")}
  return dataclasses.replace(cfg, **section) if section else cfg


@struct.dataclass
class _LoopState:
  step: jax.Array  # [] int32, decode steps taken (the slot written next)
  taken: jax.Array  # [] int32, steps this run had a row running in (a pack's loop runs on)
  tokens: jax.Array  # [B, T] int32
  logprobs: jax.Array  # [B, T] float32
  done: jax.Array  # [B] bool
  lengths: jax.Array  # [B] int32
  logits: jax.Array  # [B, V] next-token logits at the compute dtype (float32: reference path)
  cache: KVCache
  rng: jax.Array
  routing: (
    jax.Array | None
  )  # [B, S+T, Lm, K] experts used per processed token (MoE only; -1: never reached)
  turns: Turns | None = None  # multi-turn rollouts only (`SamplingConfig.tool`)


DECODE_SCOPE = "decode"  # jax.named_scope of the decode while_loop
NEVER_ROUTED = -1  # routing entry of a token slot the decode loop never reached


def _restrict(logp: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Sets log-probs outside the top-k / top-p set to -inf (for drawing only). [B, V].

  `top_k` / `top_p` may be traced (per-run values of a pack): both sets are then computed and
  each applied where its value turns it on, with the same operations as the static path."""
  if isinstance(top_k, jax.Array) or isinstance(top_p, jax.Array):
    return _restrict_per_run(logp, jnp.asarray(top_k), jnp.asarray(top_p))
  if top_k and top_k < logp.shape[-1]:
    kth = jax.lax.top_k(logp, top_k)[0][:, -1:]
    logp = jnp.where(logp >= kth, logp, -jnp.inf)
  if top_p < 1.0:
    logp = _nucleus(logp, top_p)
  return logp


def _nucleus(logp: jax.Array, top_p) -> jax.Array:
  """`logp` with the tokens outside the smallest set of mass >= top_p set to -inf."""
  sorted_logp = jnp.sort(logp, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(sorted_logp, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
  keep_sorted = mass_before < top_p
  cutoff = jnp.min(jnp.where(keep_sorted, sorted_logp, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logp >= cutoff, logp, -jnp.inf)


def _restrict_per_run(logp: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """`_restrict` for traced values: top-k by a sort and a dynamic index, then the nucleus."""
  v = logp.shape[-1]
  sorted_logp = jnp.sort(logp, axis=-1)[:, ::-1]
  kth = jax.lax.dynamic_index_in_dim(sorted_logp, jnp.clip(top_k, 1, v) - 1, axis=1)
  on_k = (top_k > 0) & (top_k < v)
  logp = jnp.where(on_k & (logp < kth), -jnp.inf, logp)
  return jnp.where(top_p < 1.0, _nucleus(logp, top_p), logp)


def first_argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, -1)` as int32 for NaN-free x (the first index of the row maximum), written as
  a max and a masked min over an iota: two plain reductions, where `argmax`'s variadic
  (value, index) reduction runs element by element on the CPU backend (7 ms per decode step of
  128 x 4096 float32 on two cores, against under 1 ms)."""
  v = x.shape[-1]
  top = jnp.max(x, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
  return jnp.minimum(first, v - 1)  # a NaN row (no element equals its max) -> the last id


def draw(key: jax.Array, logp: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """One token per row [B] int32 from log-probs [B, V], known up to a per-row constant
  (argmax when `cfg.greedy`; top-k / top-p restrict the draw). The Gumbel-max draw is
  `jax.random.categorical`'s, token for token: argmax(logp + gumbel(key, [B, V]))."""
  if cfg.greedy:
    return first_argmax(logp)
  logp = _restrict(logp, cfg.top_k, cfg.top_p)
  return first_argmax(logp + jax.random.gumbel(key, logp.shape, logp.dtype))


def sample(
  model: Transformer,
  params: Any,
  prompt_tokens: jax.Array,  # [P, S] int32, left-padded
  prompt_mask: jax.Array,  # [P, S] bool
  rng: jax.Array,
  cfg: SamplingConfig,
) -> Rollout:
  """Samples G completions per prompt; returns a `Rollout` of B = P * G rows (group-major)."""
  chex.assert_rank([prompt_tokens, prompt_mask], 2)
  chex.assert_equal_shape([prompt_tokens, prompt_mask])
  prompt_len, t_max = prompt_tokens.shape[1], cfg.max_new_tokens
  state, key_valid, next_pos, prompt_rows = _prefill(
    model, params, prompt_tokens, prompt_mask, rng, cfg
  )
  with jax.named_scope(DECODE_SCOPE):  # names the loops in the compiled program (HLO tests)
    for end in decode_stages(t_max, cfg.kv_block):  # static: the attention's key count
      cond = functools.partial(_decoding, end, cfg.loop_axis)
      visible = key_valid[:, : prompt_len + end]  # its width is the slots the attention reads
      body = functools.partial(
        _decode_step, model, params, cfg, visible, next_pos, prompt_len, prompt_rows[0]
      )
      state = jax.lax.while_loop(cond, body, state)
  loss_mask = (jnp.arange(t_max)[None, :] < state.lengths[:, None]).astype(jnp.float32)
  turns = state.turns
  if turns is not None:  # the environment's tokens are context, never learned (§0)
    loss_mask = loss_mask * (1.0 - turns.env_mask)
  return Rollout(
    prompt_tokens=prompt_rows[0],
    prompt_mask=prompt_rows[1],
    tokens=state.tokens,
    loss_mask=loss_mask,
    lengths=state.lengths,
    truncated=~state.done,
    logprobs=state.logprobs,
    decode_steps=state.taken,
    routing=state.routing,
    env_mask=None if turns is None else turns.env_mask,
    tool_calls=None if turns is None else turns.calls,
    tool_errors=None if turns is None else turns.errors,
  )


def decode_stages(t_max: int, kv_block: int) -> tuple[int, ...]:
  """The decode stages' ends in steps: kv_block, 2·kv_block, ..., T (one stage, (T,), when
  kv_block is 0 or >= T). Steps [end_{k-1}, end_k) attend over S + end_k cache slots."""
  if kv_block <= 0 or kv_block >= t_max:
    return (t_max,)
  return (*range(kv_block, t_max, kv_block), t_max)


def _prefill(model, params, prompt_tokens, prompt_mask, rng, cfg: SamplingConfig):
  """Prefills each prompt [P, S] once and shares its cache across its group of G rows. Returns
  the decode loop's first state, the keys' validity [B, S+T], the position of each row's first
  completion token [B] and the rows' prompts (tokens, mask) [B, S]."""
  num_prompts, prompt_len = prompt_tokens.shape
  g, t_max = cfg.group_size, cfg.max_new_tokens
  key_valid = jnp.concatenate([prompt_mask, jnp.ones((num_prompts, t_max), bool)], axis=1)
  positions = positions_from_mask(prompt_mask)
  cache = init_cache(model.cfg, num_prompts, attention.cache_slots(prompt_len + t_max))
  out = model.apply(
    {"params": params},
    prompt_tokens,
    positions,
    key_valid,
    cache=cache,
    cache_index=0,
    return_hidden=not cfg.float32_logits,  # the output layer at the last position alone
  )
  repeat = lambda x: jnp.repeat(x, g, axis=0)  # noqa: E731
  cache = out.cache.repeat_rows(g)
  routing = None
  if out.moe is not None:  # record the prompt's routing, then each generated token's
    r = out.moe.routing  # [P, S, Lm, K]
    # Slots the loop never reaches (it stops once every row has ended) keep the sentinel -1:
    # replay there falls back to the router's own choice, and no statistic counts them.
    pad = jnp.full((num_prompts, t_max, *r.shape[2:]), NEVER_ROUTED, r.dtype)
    routing = repeat(jnp.concatenate([r, pad], axis=1))
  key_valid, next_pos = repeat(key_valid), repeat(positions[:, -1] + 1)
  prompt_rows = repeat(prompt_tokens), repeat(prompt_mask)
  b = num_prompts * g
  state = _LoopState(
    step=jnp.zeros((), jnp.int32),
    taken=jnp.zeros((), jnp.int32),
    tokens=jnp.full((b, t_max), cfg.pad_id, jnp.int32),
    logprobs=jnp.zeros((b, t_max), jnp.float32),
    done=jnp.zeros((b,), bool),
    lengths=jnp.zeros((b,), jnp.int32),
    logits=repeat(_next_logits(model, params, out, cfg)),
    cache=cache,
    rng=rng,
    routing=routing,
    turns=None if cfg.tool is None else Turns.start(b, t_max, cfg.tool.answer_len),
  )
  return state, key_valid, next_pos, prompt_rows


def _next_logits(model, params, out, cfg: SamplingConfig) -> jax.Array:
  """The last position's next-token logits [B, V]. The fast path unembeds that position alone
  and keeps its logits at the compute dtype, so the loop carries no float32 [B, V] buffer and
  the draw and the log-prob cast them (exactly) inside their own fused passes: the reference
  path's tokens, log-probs within float32 rounding (`tests/test_sampler_logits.py`). The
  reference path takes the model's float32 logits of every position."""
  if cfg.float32_logits:
    return out.logits[:, -1]
  return unembed(model.cfg, params, out.hidden[:, -1], dtype=None)


def _decoding(end: int, loop_axis: str | None, s: _LoopState) -> jax.Array:
  """A decode stage's condition: steps left in the stage (before `end`) and a row running;
  in a pack (vmapped over `loop_axis`), a row of any run. That condition is the same for
  every run, so the loop carries no per-run copy of its state (a per-run condition would
  select between the old and the new KV cache at every step)."""
  running = ~jnp.all(s.done)
  if loop_axis is not None:
    running = jax.lax.psum(running.astype(jnp.int32), loop_axis) > 0
  return (s.step < end) & running


def _decode_step(
  model: Transformer,
  params: Any,
  cfg: SamplingConfig,
  key_valid: jax.Array,  # [B, S+end] bool: the stage's visible slots (the attention's keys)
  next_pos: jax.Array,  # [B] position of each row's first completion token
  prompt_len: int,
  prompts: jax.Array,  # [B, S] each row's prompt (what an environment may read)
  s: _LoopState,
) -> _LoopState:
  """One decode step: draws each running row's token, records its sampling log-prob (spec §0)
  and runs it through the model, writing its keys/values (and routing) at slot S + step. In a
  multi-turn rollout a pending tool answer's next token is taken instead (log-prob 0, the
  environment's); `turns.take_turns` handles the calls, `turns.over_budget` the turn budget."""
  rng, draw_key = jax.random.split(s.rng)
  # ℓ^μ = z_y - logsumexp(z) with z = logits / τ_s: the [B, V] log-softmax is never stored,
  # and the draw reads z itself (every rule below is invariant to a shift of z).
  z = s.logits.astype(jnp.float32) / cfg.temperature  # [B, V]
  token = draw(draw_key, z, cfg)
  token_logp = jnp.take_along_axis(z, token[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(z, -1)
  active = ~s.done
  token = jnp.where(active, token, cfg.pad_id)
  turns, forced = s.turns, jnp.zeros_like(active)
  if turns is not None:
    forced = active & (turns.pending_i < turns.pending_n)
    env_token = jnp.take_along_axis(turns.pending, turns.pending_i[:, None], axis=1)[:, 0]
    token = jnp.where(forced, env_token, token)
  tokens = s.tokens.at[:, s.step].set(token)
  logprobs = s.logprobs.at[:, s.step].set(jnp.where(active & ~forced, token_logp, 0.0))
  done = s.done | ((token == cfg.eos_id) & ~forced)
  if turns is not None:
    turns = take_turns(cfg, turns, prompts, tokens, token, s.step, active, forced)
    done |= over_budget(cfg, turns, s.step, active, forced)
  out = model.apply(
    {"params": params},
    token[:, None],
    (next_pos + s.step)[:, None],
    key_valid,
    cache=s.cache,
    cache_index=prompt_len + s.step,
    return_hidden=not cfg.float32_logits,
  )
  live = jnp.any(active)  # in a pack, this run's rows may all have ended while others run
  routing = s.routing
  if routing is not None:  # a run that has ended reaches no more slots: they keep the sentinel
    routed = jnp.where(live, out.moe.routing, NEVER_ROUTED)
    routing = jax.lax.dynamic_update_slice_in_dim(routing, routed, prompt_len + s.step, axis=1)
  return _LoopState(
    step=s.step + 1,
    taken=s.taken + live.astype(jnp.int32),
    tokens=tokens,
    logprobs=logprobs,
    done=done,
    lengths=s.lengths + active.astype(jnp.int32),
    logits=_next_logits(model, params, out, cfg),
    cache=out.cache,
    rng=rng,
    routing=routing,
    turns=turns,
  )


@struct.dataclass
class Scores:
  """The learner's view of a batch of completions."""

  logp: jax.Array  # [B, T] float32 ℓ of each completion token under logits / τ
  entropy: jax.Array  # [B, T] float32 H of the temperature-scaled distribution (§8)
  values: jax.Array | None  # [B, T] value estimate before each token (value head only)
  moe: MoEOutput | None = None  # routing over all S+T positions (MoE only)
  logits: jax.Array | None = None  # [B, T, V] float32 logits / τ (full_logits=True only)


def score(
  model: Transformer,
  params: Any,
  prompt_tokens: jax.Array,  # [B, S]
  prompt_mask: jax.Array,  # [B, S]
  tokens: jax.Array,  # [B, T]
  temperature: float,
  *,
  routing: jax.Array | None = None,  # [B, S+T, Lm, K] experts to replay (§9)
  probe_experts: jax.Array | None = None,  # [B, S+T, Lm, K] experts whose log-probs to report
  full_logits: bool = False,  # reference path: materialise and return the [B, T, V] logits
  group_size: int = 1,  # rows in consecutive blocks of this many share their prompt
  completion_mask: jax.Array | None = None,  # [B, T] real completion tokens (MoE statistics)
  dropout_key: jax.Array | None = None,  # the learner's gradient pass: adapter dropout on
) -> Scores:
  """Learner log-probs ℓ [B, T], entropies (and values) of `tokens` given the prompts.

  One forward pass over prompt + completion; the output layer runs only at the T positions
  that predict completion tokens, in chunks of positions (`kernels.logprobs`), so no float32
  [B, S+T, V] (nor, at a large vocabulary, [B, T, V]) logits buffer is made. The log-prob is of
  the same temperature-scaled full softmax the sampler records (spec §0). `full_logits=True`
  is the reference path: the whole [B, T, V] logits, also returned. `completion_mask`
  (default: every position) marks the completion tokens that are real (through EOS): with the
  prompt mask it is what MoE load and regularisers count (§8); log-probs do not depend on it.

  `group_size` k > 1 (dense models): rows b·k .. b·k + k - 1 must hold the same prompt; it is
  run once per block and its keys/values are shared by the block's completions
  (`_shared_prompt_hidden`). Same result and gradients as k = 1, with 1/k of the prompt work.
  `dropout_key` (the learner's loss pass only): the model runs with a `dropout` rng, so the
  adapters' dropout (`model.lora_dropout`) acts; None (every other pass): deterministic.
  """
  chex.assert_equal_shape([prompt_tokens, prompt_mask])
  chex.assert_equal_shape_prefix([prompt_tokens, tokens], 1)
  key_valid = jnp.concatenate([prompt_mask, jnp.ones(tokens.shape, bool)], axis=1)
  positions = positions_from_mask(key_valid)
  if group_size > 1:
    if model.cfg.moe_layers or routing is not None or probe_experts is not None:
      raise ValueError("score(group_size > 1) shares prompts for dense models only")
    hidden, values = _shared_prompt_hidden(
      model, params, prompt_tokens, tokens, key_valid, positions, group_size, dropout_key
    )
    moe = None
  else:
    prompt, experts = (prompt_tokens, prompt_mask), (routing, probe_experts)
    hidden, values, moe = _full_hidden(
      model, params, prompt, tokens, completion_mask, key_valid, positions, experts, dropout_key
    )
  head = functools.partial(unembed, model.cfg, params)
  if full_logits:
    logp, entropy = logprobs.reference(hidden, head, tokens, temperature)
    logits = head(hidden) / temperature
    return Scores(logp=logp, entropy=entropy, values=values, moe=moe, logits=logits)
  logp, entropy = logprobs.select(hidden, head, tokens, temperature, model.cfg.vocab_size)
  return Scores(logp=logp, entropy=entropy, values=values, moe=moe)


def _rngs(dropout_key: jax.Array | None) -> dict[str, jax.Array] | None:
  """`model.apply`'s rngs: a `dropout` stream when a key is given, else none (deterministic)."""
  return None if dropout_key is None else {"dropout": dropout_key}


def _full_hidden(
  model, params, prompt, tokens, completion_mask, key_valid, positions, experts, dropout_key=None
):
  """Hidden states [B, T, D] (and values [B, T]) predicting `tokens`, and the MoE routing over
  all S+T positions: one forward pass over prompt + completion, each row on its own. prompt:
  (tokens, mask) [B, S]; experts: (to replay, to probe) [B, S+T, Lm, K] or None; MoE statistics
  count the prompt's and `completion_mask`'s tokens; `dropout_key`: the pass's dropout rng."""
  prompt_tokens, prompt_mask = prompt
  routing, probe_experts = experts
  prompt_len, t_max = prompt_tokens.shape[1], tokens.shape[1]
  out = model.apply(
    {"params": params},
    jnp.concatenate([prompt_tokens, tokens], axis=1),
    positions,
    key_valid,
    routing=routing,
    probe_experts=probe_experts,
    return_hidden=True,
    token_valid=None
    if completion_mask is None
    else jnp.concatenate([prompt_mask, completion_mask > 0], axis=1),
    rngs=_rngs(dropout_key),
  )
  window = slice(prompt_len - 1, prompt_len - 1 + t_max)  # positions predicting each token
  hidden = out.hidden[:, window]  # [B, T, D]
  values = None if out.values is None else out.values[:, window]
  return hidden, values, out.moe


def _shared_prompt_hidden(
  model, params, prompt_tokens, tokens, key_valid, positions, k: int, dropout_key=None
):
  """Hidden states [B, T, D] (and values [B, T]) predicting `tokens`, the prompt run once per
  block of k rows: a prefill of the B/k prompts, its cache repeated k times, then the
  completions attend to it from cache slot S on (the sampler's own prefill/decode path).
  `dropout_key`: the passes' dropout rng (`score`), a key of its own for each of the two (the
  rows of a block then share their prompt's dropout mask)."""
  b, prompt_len = prompt_tokens.shape
  if b % k:
    raise ValueError(f"score: {b} rows are not blocks of group_size={k}")
  first = lambda x: x.reshape(b // k, k, *x.shape[1:])[:, 0]  # noqa: E731
  repeat = lambda x: jnp.repeat(x, k, axis=0)  # noqa: E731
  cache = init_cache(model.cfg, b // k, prompt_len)
  keys = (None, None) if dropout_key is None else tuple(jax.random.split(dropout_key))
  pre = model.apply(
    {"params": params},
    first(prompt_tokens),
    first(positions[:, :prompt_len]),
    first(key_valid[:, :prompt_len]),
    cache=cache,
    cache_index=0,
    return_hidden=True,
    rngs=_rngs(keys[0]),
  )
  out = model.apply(
    {"params": params},
    tokens,
    positions[:, prompt_len:],
    key_valid,
    cache=grow_cache(pre.cache.repeat_rows(k), tokens.shape[1]),
    cache_index=prompt_len,
    return_hidden=True,
    rngs=_rngs(keys[1]),
  )
  hidden = jnp.concatenate([repeat(pre.hidden[:, -1:]), out.hidden[:, :-1]], axis=1)
  values = None
  if out.values is not None:
    values = jnp.concatenate([repeat(pre.values[:, -1:]), out.values[:, :-1]], axis=1)
  return hidden, values
