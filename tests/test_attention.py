"""Attention implementations (kernels/attention.py) against the einsum reference: values,
gradients, prefill + decode, a prefix-cache pass, GQA and MoE; cuDNN on a GPU (marked gpu)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from jaxrl_llm.config import ConfigError, check, parse
from jaxrl_llm.config.sections import ModelSettings
from jaxrl_llm.kernels import attention
from jaxrl_llm.models import ModelConfig, Transformer, init_cache
from jaxrl_llm.models.transformer import positions_from_mask
from jaxrl_llm.sampling import SamplingConfig, sample

BASE = dict(vocab_size=24, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
VARIANTS = {
  "mha": dict(num_kv_heads=4),
  "gqa": dict(),  # 4 query heads share 2 key/value heads
  "mqa_qknorm_bias": dict(num_kv_heads=1, qk_norm=True, attention_bias=True),
  "moe": dict(moe_num_experts=4, moe_top_k=2, moe_expert_mlp_dim=16),
}
# Left-padded prompts [3, 7]: 2 pads, none, 5 pads.
PROMPT_MASK = np.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 0, 0, 0, 0, 1, 1]], bool)
T = 5  # completion tokens


def _setup(variant, **kw):
  """(cfg, params, tokens [3, 7+T], key_valid [3, 7+T]) of a random-init model."""
  cfg = ModelConfig(**{**BASE, **VARIANTS[variant], **kw})
  valid = jnp.concatenate([PROMPT_MASK, np.ones((3, T), bool)], axis=1)
  tokens = jax.random.randint(jax.random.PRNGKey(0), valid.shape, 3, cfg.vocab_size)
  tokens = jnp.where(valid, tokens, 0)
  variables = jax.jit(Transformer(cfg, attention="einsum").init)(
    jax.random.PRNGKey(1), tokens, positions_from_mask(valid), valid
  )
  return cfg, nn.unbox(variables["params"]), tokens, valid


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(cfg, impl, params, tokens, valid):
  model = Transformer(cfg, attention=impl)
  return model.apply({"params": params}, tokens, positions_from_mask(valid), valid).logits


def test_implementation_adds_no_parameters():
  cfg, params, tokens, valid = _setup("gqa")
  runnable = attention.cudnn_refusal(cfg.compute_dtype, cfg.head_dim) is None
  for impl in [i for i in attention.IMPLEMENTATIONS if i != "cudnn" or runnable]:
    model = Transformer(cfg, attention=impl)
    other = nn.unbox(
      jax.jit(model.init)(jax.random.PRNGKey(1), tokens, positions_from_mask(valid), valid)
    )
    assert jax.tree.structure(other["params"]) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, other["params"], params)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_full_forward_xla_matches_einsum(variant):
  cfg, params, tokens, valid = _setup(variant)
  want = _forward(cfg, "einsum", params, tokens, valid)
  got = _forward(cfg, "xla", params, tokens, valid)
  m = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], atol=2e-5, rtol=2e-5)
  assert np.abs(np.asarray(want)[m]).max() > 0.1  # real logits, not a vacuous comparison


@pytest.mark.parametrize("variant", ["gqa", pytest.param("moe", marks=pytest.mark.extended)])
def test_prefill_decode_and_prefix_pass_xla_match_einsum(variant):
  """Sampler-style: prefill at slot 0, decode steps at a traced cache_index, and a learner pass
  of all T completion tokens from the prefilled cache (static cache_index = S)."""
  cfg, params, tokens, valid = _setup(variant)
  s = PROMPT_MASK.shape[1]
  pos = positions_from_mask(valid)
  full = _forward(cfg, "einsum", params, tokens, valid)
  results = {}
  for impl in ("einsum", "xla"):
    model = Transformer(cfg, attention=impl)
    apply = lambda tok, p, cache, idx, m=model: m.apply(  # noqa: E731
      {"params": params}, tok, p, valid, cache=cache, cache_index=idx
    )
    static = jax.jit(apply, static_argnums=3)  # a static cache_index: prefill, prefix pass
    prefill = static(tokens[:, :s], pos[:, :s], init_cache(cfg, 3, s + T), 0)
    step = jax.jit(apply)  # cache_index traced, as in `sample`'s while_loop
    cache, logits = prefill.cache, [prefill.logits[:, -1]]
    for t in range(T - 1):
      out = step(tokens[:, s + t : s + t + 1], pos[:, s + t : s + t + 1], cache, s + t)
      cache = out.cache
      logits.append(out.logits[:, 0])
    prefix = static(tokens[:, s:], pos[:, s:], prefill.cache, s)  # static index > 0
    results[impl] = (prefill.logits, jnp.stack(logits, 1), prefix.logits)
  m = PROMPT_MASK
  (pre_e, dec_e, fix_e), (pre_x, dec_x, fix_x) = results["einsum"], results["xla"]
  np.testing.assert_allclose(np.asarray(pre_x)[m], np.asarray(pre_e)[m], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(dec_x, dec_e, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(fix_x, fix_e, atol=2e-5, rtol=2e-5)
  # ... and both equal the full forward pass at the same positions.
  np.testing.assert_allclose(dec_x, full[:, s - 1 : -1], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(fix_x, full[:, s:], atol=2e-5, rtol=2e-5)


@pytest.mark.extended
def test_greedy_rollout_is_the_same_under_xla():
  cfg, params, tokens, _ = _setup("gqa")
  prompt = tokens[:, : PROMPT_MASK.shape[1]]
  scfg = SamplingConfig(max_new_tokens=6, group_size=2, greedy=True, eos_id=2, pad_id=0)
  rollouts = {
    impl: sample(
      Transformer(cfg, attention=impl), params, prompt, PROMPT_MASK, jax.random.PRNGKey(0), scfg
    )
    for impl in ("einsum", "xla")
  }
  np.testing.assert_array_equal(rollouts["xla"].tokens, rollouts["einsum"].tokens)
  np.testing.assert_allclose(rollouts["xla"].logprobs, rollouts["einsum"].logprobs, atol=2e-5)


@pytest.mark.parametrize("variant", ["gqa", "moe"])
def test_gradients_xla_match_einsum(variant):
  cfg, params, tokens, valid = _setup(variant)
  w = jax.random.normal(jax.random.PRNGKey(5), (*tokens.shape, cfg.vocab_size))
  w = w * valid[..., None]  # the loss reads valid positions only

  def loss(p, impl):
    return jnp.sum(_forward(cfg, impl, p, tokens, valid) * w)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  g_e, g_x = grad(params, "einsum"), grad(params, "xla")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), g_x, g_e)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_e)) > 1e-2


def _qkv(seed, b=4, n=8, h=4, j=2, dh=16, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(k1, (b, n, h, dh), dtype)
  # keys and values in the cache layout [B, J, N, Dh]
  return q, jax.random.normal(k2, (b, j, n, dh), dtype), jax.random.normal(k3, (b, j, n, dh), dtype)


# Left-padded rows including an unpadded one and an all-padding one.
KEY_VALID = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8, [0] * 7 + [1], [0] * 8], bool)


def test_padded_causal_form_matches_reference_values_and_gradients():
  """The cuDNN formulation (rows rotated to right padding, causal + sequence lengths), run
  through the XLA implementation, against the einsum oracle."""
  q, k, v = _qkv(0)
  m = attention.mask(KEY_VALID, 8, 0)
  rows = KEY_VALID[:, :, None, None]  # the loss reads valid query rows only
  w = jax.random.normal(jax.random.PRNGKey(9), q.shape) * rows

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v) * w)

  ref = lambda q, k, v: attention.reference(q, k, v, m)  # noqa: E731
  form = lambda q, k, v: attention.padded_causal(q, k, v, KEY_VALID, "xla")  # noqa: E731
  out = jax.jit(form)(q, k, v)
  np.testing.assert_allclose(out * rows, jax.jit(ref)(q, k, v) * rows, atol=1e-5)
  assert np.isfinite(np.asarray(out)).all()
  grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
  g_ref, g_form = grad(ref, q, k, v), grad(form, q, k, v)
  for a, b in zip(g_form, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_auto_and_bad_values():
  if jax.default_backend() == "cpu":
    assert attention.select("auto", jnp.bfloat16, 64, 0) == "einsum"
  assert attention.select("auto", jnp.float32, 64, 0) == "einsum"  # cuDNN refuses float32
  cfg, params, tokens, valid = _setup("gqa")
  with pytest.raises(ValueError, match=r"attention='flash' \(model\.attention\); allowed: auto"):
    _forward(cfg, "flash", params, tokens, valid)
  if attention.cudnn_refusal(jnp.float32, 8):
    with pytest.raises(ValueError, match=r"attention='cudnn' \(model\.attention\) cannot run"):
      _forward(cfg, "cudnn", params, tokens, valid)


def test_config_field_is_validated_and_not_part_of_the_model():
  config = tiny_config(**{"model.attention": "flash"})
  with pytest.raises(ConfigError, match=r"model\.attention='flash'; allowed: auto"):
    check(parse(config), num_devices=1)
  mc = ModelSettings.from_section(config.model).arch  # the architecture has no such field
  assert "attention" not in mc.to_dict() and mc == parse(tiny_config()).model.arch
  if jax.default_backend() == "cpu":
    config = tiny_config(**{"model.attention": "cudnn", "model.dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"model\.attention='cudnn' cannot run"):
      check(parse(config), num_devices=1)


def _max_err(a, b, m):
  return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))[m].max())


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_cached_prefill_picks_the_cudnn_form_in_either_layer_layout(
  scan_layers, remat, monkeypatch
):
  """A prefill into a cache at slot 0 (the sampler's; with remat, a learner pass's shared
  prompt) reaches `select` with a static start in scanned layers as in unrolled ones, so
  model.attention=cudnn picks the cuDNN form in both (scanned layers took einsum before).
  cuDNN's refusal is lifted as on a GPU; its form traced as the reference (no cuDNN here)."""
  picked = []
  select = attention.select
  monkeypatch.setattr(attention, "cudnn_refusal", lambda dtype, head_dim: None)
  monkeypatch.setattr(
    attention, "select", lambda *a, **k: picked.append(select(*a, **k)) or picked[-1]
  )

  def padded_causal(q, keys, values, key_valid, implementation="cudnn"):
    picked.append(f"form:{implementation}")
    q_len = q.shape[1]
    m = attention.mask(key_valid[:, :q_len], q_len, 0)
    return attention.reference(q, keys[:, :, :q_len], values[:, :, :q_len], m)

  monkeypatch.setattr(attention, "padded_causal", padded_causal)
  cfg = ModelConfig(num_layers=2, d_model=32, mlp_dim=32, scan_layers=scan_layers, dtype="bfloat16")
  model = Transformer(cfg, remat=remat, attention="cudnn")
  s, n = 8, 16
  tokens, key_valid = jnp.ones((2, s), jnp.int32), jnp.ones((2, n), bool)
  positions = jnp.broadcast_to(jnp.arange(s), (2, s))
  init = lambda: model.init(jax.random.PRNGKey(0), tokens, positions, key_valid[:, :s])  # noqa: E731
  params = jax.eval_shape(init)["params"]
  picked.clear()
  jax.eval_shape(
    lambda p: model.apply(
      {"params": p}, tokens, positions, key_valid, cache=init_cache(cfg, 2, n), cache_index=0
    ),
    params,
  )
  assert picked and set(picked) == {"cudnn", "form:cudnn"}, picked  # every block, each trace


@pytest.mark.gpu
def test_cudnn_bf16_matches_einsum():
  """cuDNN in bfloat16 is as close to the float32 einsum as einsum in bfloat16 is: values and
  gradients of the full forward, prefill logits, and the kernel on its own."""
  if reason := attention.cudnn_refusal(jnp.bfloat16, 64):
    pytest.skip(f"cuDNN flash attention unavailable: {reason}")
  cfg, params, tokens, valid = _setup("gqa", head_dim=64, dtype="bfloat16")
  cfg32 = ModelConfig(**{**cfg.to_dict(), "dtype": "float32"})
  m = np.asarray(valid)
  fwd = _forward
  hlo = fwd.lower(cfg, "cudnn", params, tokens, valid).compile().as_text()
  assert "cudnn" in hlo.lower()  # the fused kernel really runs
  f32 = fwd(cfg32, "einsum", params, tokens, valid)
  e_bf16 = _max_err(fwd(cfg, "einsum", params, tokens, valid), f32, m)
  e_cudnn = _max_err(fwd(cfg, "cudnn", params, tokens, valid), f32, m)
  assert e_cudnn <= 2 * e_bf16 + 1e-2, (e_cudnn, e_bf16)
  np.testing.assert_allclose(
    np.asarray(fwd(cfg, "auto", params, tokens, valid))[m],
    np.asarray(fwd(cfg, "cudnn", params, tokens, valid))[m],
  )

  w = jax.random.normal(jax.random.PRNGKey(5), (*tokens.shape, cfg.vocab_size)) * m[..., None]
  grad = jax.jit(
    jax.grad(lambda p, c, impl: jnp.sum(_forward(c, impl, p, tokens, valid) * w)),
    static_argnums=(1, 2),
  )
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])  # noqa: E731
  g32 = flat(grad(params, cfg32, "einsum"))
  rel = lambda g: np.linalg.norm(flat(g) - g32) / np.linalg.norm(g32)  # noqa: E731
  r_bf16, r_cudnn = rel(grad(params, cfg, "einsum")), rel(grad(params, cfg, "cudnn"))
  assert r_cudnn <= 2 * r_bf16 + 1e-2, (r_cudnn, r_bf16)

  s = PROMPT_MASK.shape[1]
  pos = positions_from_mask(valid)
  pre = {
    impl: Transformer(cfg, attention=impl)
    .apply({"params": params}, tokens[:, :s], pos[:, :s], valid, cache=init_cache(cfg, 3, s + T))
    .logits
    for impl in ("einsum", "cudnn")
  }
  pre32 = f32[:, :s]
  e_pre = _max_err(pre["cudnn"], pre32, PROMPT_MASK)
  assert e_pre <= 2 * _max_err(pre["einsum"], pre32, PROMPT_MASK) + 1e-2

  q, k, v = _qkv(0, n=133, dh=64)  # odd: the cuDNN form pads its slots
  kv_valid = np.arange(133)[None, :] >= np.array([0, 5, 64, 132])[:, None]
  ref = attention.reference(q, k, v, attention.mask(kv_valid, 133, 0))
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  e_k = _max_err(attention.padded_causal(*bf, kv_valid, "cudnn"), ref, kv_valid)
  e_k_bf16 = _max_err(attention.reference(*bf, attention.mask(kv_valid, 133, 0)), ref, kv_valid)
  assert e_k <= 2 * e_k_bf16 + 1e-2, (e_k, e_k_bf16)


@pytest.mark.parametrize(
  "heads,kv_heads", [pytest.param(4, 4, marks=pytest.mark.extended), (4, 2), (6, 1)]
)
def test_one_query_form_matches_reference_values_and_gradients(heads, kv_heads):
  """The decode-step einsums (query axis dropped) equal the reference at Q = 1: values and the
  gradients through q, keys and values, with masked slots and a fully padded row."""
  b, n, dh = 3, 9, 8
  ks = jax.random.split(jax.random.PRNGKey(3), 3)
  q = jax.random.normal(ks[0], (b, 1, heads, dh))
  keys = jax.random.normal(ks[1], (b, kv_heads, n, dh))
  values = jax.random.normal(ks[2], (b, kv_heads, n, dh))
  key_valid = jnp.asarray(np.arange(n)[None, :] >= np.array([[0], [4], [8]]))
  m = attention.mask(key_valid, 1, n - 1)  # the last slot's query
  want = attention.reference(q, keys, values, m)
  got = attention.one_query(q, keys, values, m)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a, m)))  # noqa: E731
  g_want = jax.grad(loss(attention.reference), argnums=(0, 1, 2))(q, keys, values)
  g_got = jax.grad(loss(attention.one_query), argnums=(0, 1, 2))(q, keys, values)
  for a, w in zip(g_got, g_want, strict=True):
    np.testing.assert_allclose(a, w, atol=1e-6, rtol=1e-6)
  # attend() takes this form for einsum decode steps: the same values through the dispatcher
  np.testing.assert_allclose(
    attention.attend(q, keys, values, key_valid, jnp.int32(n - 1), "einsum"), want, atol=1e-6
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_decode_step_reads_the_cache_unwritten_with_its_own_key_beside_it(dtype):
  """`one_query_beside` (what `attend` runs for an einsum decode step given `own`) over a cache
  whose slot `start` and later hold garbage equals writing the own key/value at `start` first
  and attending the written cache (the reference), at every traced slot, with padded rows and a
  fully padded row; at a static slot 0 (a prefill) `attend` writes them and attends as before."""
  b, j, heads, n, dh = 3, 2, 4, 9, 8
  ks = jax.random.split(jax.random.PRNGKey(4), 5)
  q = jax.random.normal(ks[0], (b, 1, heads, dh)).astype(dtype)
  cache_k = (jax.random.normal(ks[1], (b, j, n, dh)) * 3).astype(dtype)  # every slot filled
  cache_v = (jax.random.normal(ks[2], (b, j, n, dh)) * 3).astype(dtype)
  own_k = jax.random.normal(ks[3], (b, j, 1, dh)).astype(dtype)
  own_v = jax.random.normal(ks[4], (b, j, 1, dh)).astype(dtype)
  key_valid = jnp.asarray(np.arange(n)[None, :] >= np.array([[0], [4], [n]]))  # row 2: padding
  tol = 1e-6 if dtype == jnp.float32 else 2e-2
  beside = jax.jit(functools.partial(attention.attend, implementation="einsum"))
  for start in range(4, n):
    write = lambda c, o: jax.lax.dynamic_update_slice_in_dim(c, o, start, 2)  # noqa: B023,E731
    keys, values = write(cache_k, own_k), write(cache_v, own_v)
    want = attention.reference(q, keys, values, attention.mask(key_valid, 1, start))
    got = beside(q, cache_k, cache_v, key_valid, jnp.int32(start), own=(own_k, own_v))
    np.testing.assert_allclose(
      np.asarray(got[:2], np.float32), np.asarray(want[:2], np.float32), atol=tol, rtol=tol
    )
    assert got.dtype == q.dtype and got.shape == want.shape
  qs = jax.random.normal(ks[0], (b, n, heads, dh)).astype(dtype)  # a prefill: Q = N from slot 0
  own = (cache_k, cache_v)
  zeros = jnp.zeros_like(cache_k)
  np.testing.assert_allclose(
    np.asarray(attention.attend(qs, zeros, zeros, key_valid, 0, "einsum", own=own), np.float32),
    np.asarray(attention.attend(qs, *own, key_valid, 0, "einsum"), np.float32),
  )
