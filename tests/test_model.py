"""Model and sampler: KV-cache decode equals the full forward; recorded log-probs equal the learner's."""

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.kernels import attention
from jaxrl_llm.models import ModelConfig, Transformer, init_cache
from jaxrl_llm.models.transformer import positions_from_mask
from jaxrl_llm.sampling import (
  SamplingConfig,
  _restrict,
  decode_stages,
  draw,
  first_argmax,
  sample,
  score,
)

VARIANTS = {
  "llama": dict(),
  "qwen2": dict(attention_bias=True, tie_embeddings=False),
  "qwen3": dict(qk_norm=True, num_kv_heads=1),
}


def _setup(variant="llama", **kw):
  base = dict(vocab_size=24, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
  cfg = ModelConfig(**{**base, **VARIANTS[variant], **kw})
  model = Transformer(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (3, 7), 3, cfg.vocab_size)
  mask = jnp.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 0, 0, 0, 0, 1, 1]], bool)
  tokens = jnp.where(mask, tokens, 0)
  variables = model.init(jax.random.PRNGKey(1), tokens, positions_from_mask(mask), mask)
  return cfg, model, nn.unbox(variables["params"]), tokens, mask


@pytest.mark.extended
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kv_cache_decode_matches_full_forward(variant):
  cfg, model, params, prompt, mask = _setup(variant)
  rest = jax.random.randint(jax.random.PRNGKey(2), (3, 5), 3, cfg.vocab_size)
  full = jnp.concatenate([prompt, rest], axis=1)
  valid = jnp.concatenate([mask, jnp.ones(rest.shape, bool)], axis=1)
  ref_logits = model.apply({"params": params}, full, positions_from_mask(valid), valid).logits

  cache = init_cache(cfg, 3, full.shape[1])
  out = model.apply(
    {"params": params}, prompt, positions_from_mask(mask), valid, cache=cache, cache_index=0
  )
  logits, cache = out.logits, out.cache
  step_logits = [logits[:, -1]]
  pos = positions_from_mask(valid)
  for t in range(rest.shape[1] - 1):
    idx = prompt.shape[1] + t
    out = model.apply(
      {"params": params},
      rest[:, t : t + 1],
      pos[:, idx : idx + 1],
      valid,
      cache=cache,
      cache_index=idx,
    )
    cache = out.cache
    step_logits.append(out.logits[:, 0])
  got = jnp.stack(step_logits, axis=1)
  want = ref_logits[:, prompt.shape[1] - 1 : -1]
  # Padded prompt rows: compare only real positions (all completion positions are real).
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(logits[:, -1], ref_logits[:, prompt.shape[1] - 1], atol=1e-5)


@pytest.mark.extended
def test_left_padding_does_not_change_logits():
  _cfg, model, params, _, _ = _setup()
  seq = jnp.array([[5, 6, 7, 8]])
  padded = jnp.array([[0, 0, 5, 6, 7, 8]])
  m1, m2 = jnp.ones((1, 4), bool), jnp.array([[0, 0, 1, 1, 1, 1]], bool)
  a = model.apply({"params": params}, seq, positions_from_mask(m1), m1).logits
  b = model.apply({"params": params}, padded, positions_from_mask(m2), m2).logits
  np.testing.assert_allclose(a, b[:, 2:], atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_sampler_logprobs_equal_learner_logprobs(temperature, top_k, top_p):
  _cfg, model, params, prompt, mask = _setup("qwen3")
  scfg = SamplingConfig(
    max_new_tokens=9,
    group_size=4,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    eos_id=2,
    pad_id=0,
  )
  r = jax.jit(lambda p, k: sample(model, p, prompt, mask, k, scfg))(params, jax.random.PRNGKey(3))
  assert r.tokens.shape == (12, 9)
  logp = score(model, params, r.prompt_tokens, r.prompt_mask, r.tokens, temperature).logp
  m = np.asarray(r.loss_mask)
  assert m.sum() > 0
  ratio = np.exp(np.asarray(logp - r.logprobs))[m > 0]
  np.testing.assert_allclose(ratio, 1.0, atol=1e-5)
  assert np.all(np.asarray(r.logprobs)[m == 0] == 0)


def test_group_sampling_shares_prompt_and_differs_in_completions():
  _cfg, model, params, prompt, mask = _setup()
  scfg = SamplingConfig(max_new_tokens=6, group_size=5, eos_id=2)
  r = sample(model, params, prompt, mask, jax.random.PRNGKey(0), scfg)
  np.testing.assert_array_equal(r.prompt_tokens, np.repeat(prompt, 5, axis=0))
  groups = np.asarray(r.tokens).reshape(3, 5, 6)
  assert any(len({tuple(row) for row in g}) > 1 for g in groups)


def test_eos_handling_lengths_mask_truncation():
  _cfg, model, params, prompt, mask = _setup()
  # Make EOS (id 2) overwhelmingly likely after a few steps by biasing nothing: instead sample
  # many sequences and check invariants that must hold for every row.
  scfg = SamplingConfig(max_new_tokens=6, group_size=16, eos_id=2, temperature=3.0)
  r = sample(model, params, prompt, mask, jax.random.PRNGKey(4), scfg)
  tokens, lengths = np.asarray(r.tokens), np.asarray(r.lengths)
  for row, n, trunc, m in zip(tokens, lengths, np.asarray(r.truncated), np.asarray(r.loss_mask)):
    assert m.sum() == n
    eos = np.flatnonzero(row == 2)
    if trunc:
      assert n == 6 and eos.size == 0
    else:
      assert eos.size and eos[0] == n - 1
      assert np.all(row[n:] == 0)
  assert (~np.asarray(r.truncated)).any(), "temperature 3 should emit EOS somewhere"


@pytest.mark.extended
def test_greedy_is_deterministic_and_argmax():
  _cfg, model, params, prompt, mask = _setup()
  scfg = SamplingConfig(max_new_tokens=4, group_size=2, greedy=True, eos_id=2)
  r1 = sample(model, params, prompt, mask, jax.random.PRNGKey(0), scfg)
  r2 = sample(model, params, prompt, mask, jax.random.PRNGKey(1), scfg)
  np.testing.assert_array_equal(r1.tokens, r2.tokens)
  sc = score(model, params, r1.prompt_tokens, r1.prompt_mask, r1.tokens, 1.0, full_logits=True)
  logits = sc.logits
  first = np.asarray(jnp.argmax(logits[:, 0], -1))
  np.testing.assert_array_equal(first, np.asarray(r1.tokens[:, 0]))


def test_top_k_top_p_restrict_support():
  logp = jax.nn.log_softmax(jnp.array([[3.0, 2.0, 1.0, 0.0, -1.0]]))
  k2 = np.isfinite(np.asarray(_restrict(logp, 2, 1.0)))
  assert k2.tolist() == [[True, True, False, False, False]]
  probs = np.exp(np.asarray(logp))[0]
  p = float(probs[0] + probs[1] / 2)  # needs the two most likely tokens
  assert np.isfinite(np.asarray(_restrict(logp, 0, p))).sum() == 2


@pytest.mark.extended
def test_early_exit_stops_decoding():
  """When every sequence has emitted EOS the while_loop stops before max_new_tokens."""
  _cfg, model, params, prompt, mask = _setup()
  one = prompt[1:2], mask[1:2]
  probe = SamplingConfig(max_new_tokens=8, group_size=3, greedy=True, eos_id=-1)
  r = sample(model, params, *one, jax.random.PRNGKey(0), probe)
  assert int(r.decode_steps) == 8 and bool(np.all(r.truncated))
  first = int(r.tokens[0, 0])  # greedy's first token; declare it the EOS
  stop = SamplingConfig(max_new_tokens=8, group_size=3, greedy=True, eos_id=first)
  r = sample(model, params, *one, jax.random.PRNGKey(0), stop)
  assert int(r.decode_steps) == 1
  np.testing.assert_array_equal(r.lengths, [1, 1, 1])
  assert not np.any(r.truncated)


def _loop_conditions(jaxpr):
  """The condition jaxprs of every while loop in `jaxpr`, nested ones included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "while":
      yield eqn.params["cond_jaxpr"]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _loop_conditions(sub)


@pytest.mark.extended
def test_a_packs_decode_loop_stops_for_every_run_together_and_copies_no_cache():
  """vmapped over a pack's runs with `loop_axis`, the decode loop's condition is one boolean
  for every run (a per-run condition, the control, is lowered to a select between the old and
  the new loop state, KV cache included, at every step). A run whose rows have all ended rides
  along: its rollout and decode steps equal the run sampled alone."""
  from jaxrl_llm import sharding

  _cfg, model, params, prompt, mask = _setup()
  first = int(sample(model, params, prompt, mask, jax.random.PRNGKey(0), SamplingConfig(
    max_new_tokens=8, group_size=2, greedy=True, eos_id=-1)).tokens[1, 0])  # fmt: skip
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  temps = jnp.array([0.05, 3.0])  # near-greedy: row 1 stops at once; hot: some rows run on

  def packed(loop_axis):
    def one(key, temp):
      cfg = SamplingConfig(8, group_size=2, eos_id=first, loop_axis=loop_axis, temperature=temp)
      return sample(model, params, prompt, mask, key, cfg)

    return jax.vmap(one, axis_name=sharding.PACK_AXIS)

  def condition_shapes(fn):
    return {c.out_avals[0].shape for c in _loop_conditions(jax.make_jaxpr(fn)(keys, temps).jaxpr)}

  assert condition_shapes(packed(sharding.PACK_AXIS)) == {()}
  assert condition_shapes(packed(None)) == {(2,)}
  got = packed(sharding.PACK_AXIS)(keys, temps)
  for r in range(2):
    cfg = SamplingConfig(8, group_size=2, eos_id=first, temperature=float(temps[r]))
    alone = sample(model, params, prompt, mask, keys[r], cfg)
    for field in ("tokens", "logprobs", "lengths", "truncated", "decode_steps"):
      np.testing.assert_allclose(getattr(got, field)[r], getattr(alone, field), err_msg=field)
  assert int(got.decode_steps[0]) < int(got.decode_steps[1])  # one run ended first


@pytest.mark.extended
@pytest.mark.parametrize("scan_layers,dtype", [(False, "float32"), (True, "bfloat16")])
def test_decode_steps_write_the_cache_in_place_alone_and_in_a_pack(scan_layers, dtype):
  """The compiled decode loop, of a run alone and of a vmapped pack of 1 and of 2, holds no copy
  of a cache array: each step writes its slot in place (the attention reads the cache before the
  write, `attention.one_query_beside`, and the write is ordered after that read). Before, the
  scanned layers' loop copied the whole stacked cache twice per step alone (8 times in a pack of
  1), a pack of 1 of unrolled layers copied every layer's cache 4 times, and a pack's bfloat16
  cache was written through a float32 scatter into a copy (`kv_cache._write_at`). The
  rollouts equal the run's alone."""
  from jaxrl_llm import hlo, sharding
  from jaxrl_llm.sampling import DECODE_SCOPE

  _cfg, model, params, prompt, mask = _setup(scan_layers=scan_layers, num_layers=2, dtype=dtype)
  n = prompt.shape[1] + 8  # the slots read: [.., B, J, N, Dh], in a cache of cache_slots(N)
  shapes = {f"{m},{_cfg.head_dim}]" for m in (n, attention.cache_slots(n))}

  def fn(loop_axis):
    cfg = SamplingConfig(8, group_size=2, eos_id=-1, kv_block=0, loop_axis=loop_axis)
    return lambda p, k: sample(model, p, prompt, mask, k, cfg)

  def cache_copies(f, *args):
    body = hlo.loop_instructions(jax.jit(f).lower(*args).compile().as_text(), DECODE_SCOPE)
    assert any(i.opcode == "dynamic-update-slice" for i in body)  # the cache writes are there
    return [i.line for i in body if i.opcode == "copy" and any(x in i.line for x in shapes)]

  key = jax.random.PRNGKey(0)
  assert cache_copies(fn(None), params, key) == []
  alone = fn(None)(params, key)
  for runs in (1, 2):
    packed = jax.vmap(fn(sharding.PACK_AXIS), axis_name=sharding.PACK_AXIS)
    stacked = jax.tree.map(lambda x, r=runs: jnp.stack([x] * r), params)
    keys = jnp.stack([key] * runs)
    assert cache_copies(packed, stacked, keys) == []
    got = packed(stacked, keys)
    np.testing.assert_array_equal(got.tokens[-1], alone.tokens)
    np.testing.assert_allclose(got.logprobs[-1], alone.logprobs, atol=1e-6)


def test_a_packs_cache_write_is_one_update_at_a_shared_slot_and_vmap_at_per_run_slots():
  """`kv_cache._write_at` under vmap: at a slot shared by the runs, one dynamic_update_slice
  (no scatter), also nested and with an unbatched operand or update; at per-run slots, JAX's own
  batching. Values equal a vmapped `lax.dynamic_update_slice` in every case."""
  from jaxrl_llm.models.kv_cache import _write_at

  ops = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 4, 5, 6))  # [R, B, J, N, Dh]
  ups = jax.random.normal(jax.random.PRNGKey(1), (3, 2, 4, 1, 6))
  at = jnp.array([0, 0, 3, 0])
  dus = lambda o, u, s: jax.lax.dynamic_update_slice(o, u, tuple(s))  # noqa: E731

  def prims(fn, *args):
    return {e.primitive.name for e in jax.make_jaxpr(fn)(*args).eqns}

  cases = [((0, 0, None), ops, ups, at), ((None, 0, None), ops[0], ups, at)]
  cases += [((0, None, None), ops, ups[0], at)]
  for axes, o, u, s in cases:
    got = jax.vmap(_write_at, in_axes=axes)(o, u, s)
    np.testing.assert_array_equal(got, jax.vmap(dus, in_axes=axes)(o, u, s))
    assert "scatter" not in prims(jax.vmap(_write_at, in_axes=axes), o, u, s)
  nested = jax.vmap(jax.vmap(_write_at, in_axes=(0, 0, None)), in_axes=(0, 0, None))
  pair = lambda x: jnp.stack([x, x + 1])  # noqa: E731
  want = jax.vmap(jax.vmap(dus, (0, 0, None)), (0, 0, None))(pair(ops), pair(ups), at)
  np.testing.assert_array_equal(nested(pair(ops), pair(ups), at), want)
  assert "scatter" not in prims(nested, pair(ops), pair(ups), at)
  per_run = jnp.array([[0, 0, 1, 0], [0, 0, 4, 0], [0, 1, 2, 0]])
  got = jax.vmap(_write_at)(ops, ups, per_run)
  np.testing.assert_array_equal(got, jax.vmap(dus)(ops, ups, per_run))


def test_draw_is_categorical_token_for_token_and_first_argmax_keeps_ties():
  """`draw` gives jax.random.categorical's token for the same key (so a seed's rollouts do not
  change with the faster argmax), and `first_argmax` is jnp.argmax, ties to the first index."""
  logits = jax.random.normal(jax.random.PRNGKey(5), (64, 257)) * 3
  for i in range(5):
    key = jax.random.PRNGKey(10 + i)
    want = jax.random.categorical(key, logits)
    got = draw(key, logits, SamplingConfig(max_new_tokens=1))
    np.testing.assert_array_equal(got, want)
  ties = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-jnp.inf, -1.0, -jnp.inf, -1.0]])
  np.testing.assert_array_equal(first_argmax(ties), jnp.argmax(ties, -1))
  np.testing.assert_array_equal(first_argmax(logits), jnp.argmax(logits, -1))


def _staged_rollouts(model, params, prompt, mask, t_max, blocks, **kw):
  """One jitted rollout per kv_block in `blocks` from the same key: {kv_block: Rollout}."""
  out = {}
  for c in blocks:
    scfg = SamplingConfig(max_new_tokens=t_max, group_size=2, eos_id=-1, kv_block=c, **kw)
    fn = jax.jit(lambda p, k, scfg=scfg: sample(model, p, prompt, mask, k, scfg))
    out[c] = fn(params, jax.random.PRNGKey(7))
  return out


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decode_stages_read_filled_slots_and_sample_the_same(scan_layers):
  """kv_block 0 (the whole cache), 3 (stages of 3 steps over T = 8: 3, 6, 8, the last one
  short) and 16 (one stage) give the same tokens and log-probs: the slots a stage leaves out are
  masked ones, which weigh exactly 0 (a shorter softmax sum may round its last bit apart)."""
  assert decode_stages(8, 0) == decode_stages(8, 16) == (8,)
  assert decode_stages(8, 3) == (3, 6, 8) and decode_stages(8, 4) == (4, 8)
  _cfg, model, params, prompt, mask = _setup(scan_layers=scan_layers, num_layers=2)
  runs = _staged_rollouts(model, params, prompt, mask, 8, (0, 3, 16), temperature=0.9)
  np.testing.assert_array_equal(runs[16].logprobs, runs[0].logprobs)  # the same program
  for c in (3, 16):
    np.testing.assert_array_equal(runs[c].tokens, runs[0].tokens)
    np.testing.assert_allclose(runs[c].logprobs, runs[0].logprobs, rtol=1e-6, atol=1e-6)
    assert int(runs[c].decode_steps) == 8
