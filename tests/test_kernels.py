"""Fast paths equal their references: chunked log-probs / entropy."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.kernels import logprobs
from jaxrl_llm.kernels.logprobs import chunked
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import Transformer, positions_from_mask, unembed


def _case(seed=0, b=3, t=8, d=16, v=50):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)) / np.sqrt(d), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  return hidden, (lambda h: jnp.einsum("...d,dv->...v", h, w)), tokens


@pytest.mark.parametrize("chunk", [1, 2, 4, 8])
def test_chunked_logprobs_and_entropy_equal_the_full_computation(chunk):
  hidden, head, tokens = _case()
  want = logprobs.reference(hidden, head, tokens, 0.7)
  got = logprobs.chunked(hidden, head, tokens, 0.7, chunk)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  # Gradients with respect to the hidden states (what the learner differentiates).
  f = lambda fn, h: sum(jnp.sum(x * c) for x, c in zip(fn(h), (1.0, 0.3)))  # noqa: E731
  g_ref = jax.grad(functools.partial(f, lambda h: logprobs.reference(h, head, tokens, 0.7)))(hidden)
  g_chk = jax.grad(functools.partial(f, lambda h: logprobs.chunked(h, head, tokens, 0.7, chunk)))(
    hidden
  )
  np.testing.assert_allclose(g_chk, g_ref, rtol=1e-5, atol=1e-6)


def test_chunk_size_is_a_divisor_within_the_budget():
  assert logprobs.chunk_size(8, 256, 151936, 256 * 2**20) == 32  # 8·32·151936·4 B = 148 MiB
  assert 256 % logprobs.chunk_size(64, 256, 151936) == 0
  assert logprobs.chunk_size(1, 7, 10) == 7
  with pytest.raises(ValueError, match="must divide"):
    hidden, head, tokens = _case()
    logprobs.chunked(hidden, head, tokens, 1.0, 3)


@pytest.mark.parametrize("tie", [True, False])
def test_unembed_equals_the_models_output_layer(tie):
  cfg = ModelConfig(
    vocab_size=40,
    d_model=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    mlp_dim=32,
    tie_embeddings=tie,
  )
  model = Transformer(cfg)
  tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
  valid = jnp.ones((2, 5), bool)
  params = nn.unbox(model.init(jax.random.PRNGKey(0), tokens, positions_from_mask(valid), valid))[
    "params"
  ]
  out = model.apply({"params": params}, tokens, positions_from_mask(valid), valid)
  hid = model.apply(
    {"params": params}, tokens, positions_from_mask(valid), valid, return_hidden=True
  )
  assert hid.logits is None
  np.testing.assert_allclose(unembed(cfg, params, hid.hidden), out.logits, rtol=1e-5, atol=1e-5)


def _tiny_model(**kw):
  cfg = ModelConfig(
    vocab_size=40,
    d_model=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    mlp_dim=32,
    **kw,
  )
  tokens = (jnp.arange(14, dtype=jnp.int32).reshape(2, 7) * 3) % 40
  valid = jnp.ones((2, 7), bool).at[0, :2].set(False)
  params = nn.unbox(
    Transformer(cfg).init(jax.random.PRNGKey(0), tokens, positions_from_mask(valid), valid)
  )["params"]
  return cfg, params, tokens, valid


@pytest.mark.extended
@pytest.mark.parametrize(
  "policy",
  ["full", "dots_saveable", "dots_with_no_batch_dims_saveable"],
)
def test_remat_policies_give_the_same_gradients(policy):
  from jaxrl_llm.sampling import score

  cfg, params, tokens, valid = _tiny_model()
  prompt, prompt_mask, comp = tokens[:, :3], valid[:, :3], tokens[:, 3:]

  def loss(p, model):
    sc = score(model, p, prompt, prompt_mask, comp, 0.9)
    return jnp.sum(sc.logp) + 0.1 * jnp.sum(sc.entropy)

  v0, g0 = jax.value_and_grad(loss)(params, Transformer(cfg))
  v1, g1 = jax.value_and_grad(loss)(params, Transformer(cfg, remat=policy))
  np.testing.assert_allclose(v1, v0, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g1, g0)


@pytest.mark.parametrize("tie", [True, False])
def test_score_uses_only_completion_positions_and_equals_the_full_logits_path(tie, monkeypatch):
  from jaxrl_llm.sampling import score

  cfg, params, tokens, valid = _tiny_model(tie_embeddings=tie)
  model = Transformer(cfg)
  args = (model, params, tokens[:, :3], valid[:, :3], tokens[:, 3:], 0.8)
  full = score(*args, full_logits=True)
  want_e = -(jax.nn.softmax(full.logits) * jax.nn.log_softmax(full.logits)).sum(-1)
  monkeypatch.setattr(logprobs, "DEFAULT_BLOCK_BYTES", 2 * 2 * 40 * 4)  # 2-position chunks
  calls = []
  monkeypatch.setattr(logprobs, "chunked", lambda *a: calls.append(a[-1]) or chunked(*a))
  lean = score(*args)
  assert calls == [2]
  assert lean.logits is None
  np.testing.assert_allclose(lean.logp, full.logp, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lean.entropy, want_e, rtol=1e-5, atol=1e-6)
