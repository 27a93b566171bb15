"""Prompt sharing in the learner: each prompt runs once per group, same loss and gradients."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, tiny_config

from jaxrl_llm import sampling
from jaxrl_llm.config.learner import RLSettings
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import Transformer
from jaxrl_llm.rl import update

P, G, S, T = 3, 4, 5, 6


def _model(remat: str = "none", **kw):
  cfg = ModelConfig(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    **kw,
  )
  model = Transformer(cfg, remat=remat)
  ones = jnp.ones((1, S), jnp.int32)
  params = model.init(jax.random.key(0), ones, ones * 0, ones.astype(bool))["params"]
  return model, nn.unbox(params)


def _batch():
  prompts = jnp.repeat(jax.random.randint(jax.random.key(1), (P, S), 3, 60), G, axis=0)
  pads = jnp.array([[0], [2], [4]])  # left padding of 0, 2 and 4 tokens
  mask = jnp.repeat(jnp.arange(S)[None, :] >= pads, G, axis=0)
  tokens = jax.random.randint(jax.random.key(2), (P * G, T), 3, 60)
  return prompts, mask, tokens


# Two corners of (k, remat, scan): full remat unrolled at 4 blocks, no remat scanned at 2.
@pytest.mark.extended
@pytest.mark.parametrize("k,remat,scan", [(4, "full", False), (2, "none", True)])
def test_shared_prompt_scores_and_gradients_equal_the_unshared_pass(k, remat, scan):
  model, params = _model(remat, value_head=True, scan_layers=scan)
  prompts, mask, tokens = _batch()

  def objective(p, group_size):
    sc = sampling.score(model, p, prompts, mask, tokens, 0.7, group_size=group_size)
    total = jnp.sum(sc.logp * jnp.arange(T)) + jnp.sum(sc.entropy) + jnp.sum(sc.values**2)
    return total, sc

  grad = jax.value_and_grad(objective, has_aux=True)
  (l1, s1), g1 = grad(params, 1)
  (lk, sk), gk = grad(params, k)
  np.testing.assert_allclose(lk, l1, rtol=1e-5)
  for name in ("logp", "entropy", "values"):
    np.testing.assert_allclose(getattr(sk, name), getattr(s1, name), atol=1e-5, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), gk, g1)
  assert float(jnp.abs(jax.tree.leaves(g1)[0]).max()) > 0  # gradients are not trivially zero


@pytest.mark.extended
def test_sharing_runs_each_prompt_once_per_block():
  model, params = _model()
  prompts, mask, tokens = _batch()
  wrong = prompts.at[1].set(prompts[1] + 1)  # row 1 no longer holds its group's prompt
  a = sampling.score(model, params, wrong, mask, tokens, 1.0, group_size=4)
  b = sampling.score(model, params, wrong, mask, tokens, 1.0, group_size=1)
  assert not np.allclose(a.logp[1], b.logp[1], atol=1e-4)  # row 1 was scored with row 0's prompt
  np.testing.assert_allclose(a.logp[4:], b.logp[4:], atol=1e-5)


def test_sharing_refuses_moe_models_and_ragged_blocks():
  moe_model, moe_params = _model(moe_num_experts=4, moe_expert_mlp_dim=16)
  prompts, mask, tokens = _batch()
  with pytest.raises(ValueError, match="dense models only"):
    sampling.score(moe_model, moe_params, prompts, mask, tokens, 1.0, group_size=4)
  model, params = _model()
  with pytest.raises(ValueError, match="blocks of group_size=5"):
    sampling.score(model, params, prompts, mask, tokens, 1.0, group_size=5)


def test_block_shuffle_and_split_keep_prompt_blocks_together():
  settings = RLSettings.from_section(tiny_config(**{"rl.num_epochs": 2}).rl)
  order = np.asarray(update.minibatch_order(jax.random.key(0), 16, settings, block=4))
  assert order.shape == (4, 8)
  for epoch in order.reshape(2, 16):
    assert sorted(epoch) == list(range(16))
  blocks = order.reshape(-1, 4)
  assert (blocks % 4 == np.arange(4)).all() and (blocks // 4 == blocks[:, :1] // 4).all()
  split = update.split_leading({"x": jnp.arange(8)}, 2, block=2)["x"]
  np.testing.assert_array_equal(split, [[0, 1, 4, 5], [2, 3, 6, 7]])


@pytest.mark.parametrize(
  "extra",
  [
    pytest.param(
      {"rl.num_microbatches": 2, "kl.beta": 0.05, "rl.old_pass": "always"},  # blocks of 2 rows
      marks=pytest.mark.extended,
    ),
  ],
)
def test_shared_learner_gives_the_same_update(extra):
  """Same loss, gradient norm and update. With microbatches the shuffle keeps prompt blocks
  together, so the slices differ from the unshared run's: only the first step's metrics are
  compared there (AdamW's first step flips the sign of near-zero gradient entries)."""
  over = {"rl.num_minibatches": 1, "optim.warmup_steps": 0, **extra}
  steps = 1 if extra else 2
  shared_states, shared_metrics = run_steps(
    tiny_config(**over, **{"rl.share_prompt": "always"}), steps
  )
  plain_states, plain_metrics = run_steps(
    tiny_config(**over, **{"rl.share_prompt": "never"}), steps
  )
  if not extra:
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      shared_states[-1].params,
      plain_states[-1].params,
    )
  # policy/entropy is a mean of microbatch means: it depends on the slices' composition
  keys = ["policy/loss", "optim/grad_norm"] + (["kl/ref_kl"] if extra else ["policy/entropy"])
  for key in keys:
    for s, p in zip(shared_metrics, plain_metrics):
      np.testing.assert_allclose(s[key], p[key], rtol=1e-5, atol=1e-6, err_msg=key)
