"""Policy surrogates (objectives.md §2): values and gradients against float64 references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from jaxrl_llm.objectives import aggregation, policy

jax.config.update("jax_enable_x64", False)

RTOL, ATOL = 1e-5, 1e-6


def f32(x):
  return jnp.asarray(x, jnp.float32)


def batch(seed=0, scale=0.4, **kw):
  """Inputs rounded to float32 once, so references and JAX see the same numbers."""
  logp, old, adv, mask = ref.ragged_batch(seed, scale=scale, **kw)
  rnd = lambda x: np.asarray(np.float32(x), np.float64)  # noqa: E731
  return rnd(logp), rnd(old), rnd(adv), mask


def _sg_free(fn):
  return lambda lp, lp0, old, adv, m, **kw: fn(lp, old, adv, m, **kw)


def _reduce_adv(fn, adv_seq):
  return lambda lp, lp0, old, adv, m, **kw: fn(lp, lp0, old, adv_seq, m, **kw)


def _with_base(fn):
  return lambda lp, lp0, old, adv, m, **kw: fn(lp, old, adv, m, lp0, **kw)


# name, kwargs, reference (lp, lp0 = base point of sg[·], old, adv, mask, **kwargs) -> J
CASES = [
  ("ppo_clip", {}, _sg_free(ref.j_ppo_clip)),
  ("ppo_clip", dict(clip_low=0.1, clip_high=0.28, dual_clip=1.3), _sg_free(ref.j_ppo_clip)),
  ("pg", {}, _sg_free(ref.j_pg)),
  ("gspo", {}, _sg_free(ref.j_gspo)),
  ("gspo", dict(clip_low=0.05, clip_high=0.1), _sg_free(ref.j_gspo)),
  ("gspo_token", {}, _with_base(ref.j_gspo_token)),
  ("gspo_token", dict(clip_low=0.05, clip_high=0.1), _with_base(ref.j_gspo_token)),
  ("gmpo", {}, _sg_free(ref.j_gmpo)),
  ("gmpo", dict(clip_log=0.1), _sg_free(ref.j_gmpo)),
  ("cispo", {}, _with_base(ref.j_cispo)),
  ("cispo", dict(clip_low=0.1, clip_high=0.1, cispo_mask=True), _with_base(ref.j_cispo)),
  (
    "cispo",
    dict(is_clip_low=1.0, is_clip_high=0.1, clip_low=0.2, clip_high=0.28, cispo_mask=True),
    _with_base(ref.j_cispo),
  ),
  ("sapo", {}, _sg_free(ref.j_sapo)),
  ("sapo", dict(tau_pos=2.0, tau_neg=3.0), _sg_free(ref.j_sapo)),
]
IDS = [f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)]


@pytest.mark.parametrize(("name", "kwargs", "reference"), CASES, ids=IDS)
@pytest.mark.parametrize("token_adv", [False, True])
def test_objective_value_and_gradient(name, kwargs, reference, token_adv):
  lp, old, adv, mask = batch(seed=1)
  if token_adv:
    adv = np.asarray(np.float32(np.random.default_rng(2).normal(size=mask.shape)), np.float64)
    if name in ("gspo", "gmpo"):  # a [B, T] advantage is reduced to its masked sequence mean
      adv_seq = (adv * mask).sum(-1) / np.maximum(mask.sum(-1), 1)
      reference = _reduce_adv(reference, adv_seq)
  fn = getattr(policy, name)
  j, diag = fn(f32(lp), f32(old), f32(adv), jnp.asarray(mask), **kwargs)
  want = reference(lp, lp, old, adv, mask, **kwargs)
  np.testing.assert_allclose(j, want, rtol=RTOL, atol=ATOL)
  assert diag["ratio"].shape == mask.shape

  c = np.random.default_rng(3).normal(size=want.shape)  # random cotangent: full Jacobian test
  g = jax.grad(lambda x: jnp.sum(f32(c) * fn(x, f32(old), f32(adv), mask, **kwargs)[0]))(f32(lp))
  g_ref = ref.fd_grad(lambda x: np.sum(c * reference(x, lp, old, adv, mask, **kwargs)), lp, mask)
  np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL)


def test_ppo_clip_diagnostics():
  lp, old, adv, mask = batch(seed=4, scale=0.5)
  _, d = policy.ppo_clip(f32(lp), f32(old), f32(adv), mask, clip_low=0.1, clip_high=0.2)
  r = np.exp(lp - old)
  a = adv[:, None]
  np.testing.assert_array_equal(d["is_clipped_low"], mask & (r < 0.9) & (a < 0))
  np.testing.assert_array_equal(d["is_clipped_high"], mask & (r > 1.2) & (a > 0))
  np.testing.assert_allclose(d["ratio"], np.where(mask, r, 1.0), rtol=RTOL)
  assert d["is_clipped_low"].sum() > 0 and d["is_clipped_high"].sum() > 0


def test_value_loss_value_and_gradient():
  rng = np.random.default_rng(5)
  mask = np.arange(6)[None] < np.array([6, 2, 4, 0])[:, None]
  v, v_old, g = (np.float64(np.float32(rng.normal(size=mask.shape))) for _ in range(3))
  out = policy.value_loss(f32(v), f32(v_old), f32(g), mask, 0.2)
  np.testing.assert_allclose(out, ref.value_loss(v, v_old, g, mask, 0.2), rtol=RTOL, atol=ATOL)
  grad = jax.grad(lambda x: policy.value_loss(x, f32(v_old), f32(g), mask, 0.2).sum())(f32(v))
  want = ref.fd_grad(lambda x: ref.value_loss(x, v_old, g, mask, 0.2).sum(), v, mask)
  np.testing.assert_allclose(grad, want, rtol=RTOL, atol=ATOL)
  unclipped = policy.value_loss(f32(v), f32(v_old), f32(g), mask, None)
  np.testing.assert_allclose(unclipped, np.where(mask, 0.5 * (v - g) ** 2, 0), rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# properties


def _reinforce_grad(lp, adv, mask, mode):
  """Gradient of aggregate(−A·ℓ): the on-policy REINFORCE gradient under aggregation `mode`."""
  a = jnp.broadcast_to(f32(adv)[:, None], mask.shape)
  return jax.grad(lambda x: aggregation.aggregate(-a * x, mask, mode))(f32(lp))


@pytest.mark.parametrize(
  ("name", "kwargs"),
  [
    ("ppo_clip", {}),
    ("gspo_token", {}),
    ("cispo", {}),
    ("sapo", {}),
    ("sapo", dict(tau_pos=3.0, tau_neg=0.5)),
    ("pg", {}),
  ],
)
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_on_policy_gradient_is_reinforce(name, kwargs, mode):
  lp, _, adv, mask = batch(seed=6)
  fn = getattr(policy, name)

  def loss(x):
    j, _ = fn(x, jax.lax.stop_gradient(x), f32(adv), mask, **kwargs)  # r = 1 in value
    return aggregation.aggregate(-j, mask, mode)

  np.testing.assert_allclose(
    jax.grad(loss)(f32(lp)), _reinforce_grad(lp, adv, mask, mode), rtol=RTOL, atol=ATOL
  )


@pytest.mark.parametrize("name", ["gspo", "gmpo"])
def test_on_policy_sequence_objectives_are_reinforce_sequence_mean(name):
  lp, _, adv, mask = batch(seed=7)
  valid = mask.sum(-1) > 0

  def loss(x):
    j, _ = getattr(policy, name)(x, jax.lax.stop_gradient(x), f32(adv), mask)
    return aggregation.aggregate_seq(-j, valid)

  want = _reinforce_grad(lp, adv, mask, "seq_mean_token_mean")
  np.testing.assert_allclose(jax.grad(loss)(f32(lp)), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.05, 0.1), (10.0, 10.0)])
def test_gspo_token_equals_gspo(clip):
  lp, old, adv, mask = batch(seed=8, scale=0.2)
  kw = dict(clip_low=clip[0], clip_high=clip[1])
  valid = mask.sum(-1) > 0

  def seq_loss(x):
    return aggregation.aggregate_seq(-policy.gspo(x, f32(old), f32(adv), mask, **kw)[0], valid)

  def tok_loss(x):
    j, _ = policy.gspo_token(x, f32(old), f32(adv), mask, **kw)
    return aggregation.aggregate(-j, mask, "seq_mean_token_mean")

  v1, g1 = jax.value_and_grad(seq_loss)(f32(lp))
  v2, g2 = jax.value_and_grad(tok_loss)(f32(lp))
  np.testing.assert_allclose(v1, v2, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(g1, g2, rtol=RTOL, atol=ATOL)
  assert np.abs(np.asarray(g1)).sum() > 0 or clip[0] < 1e-3


def test_cispo_keeps_gradient_where_ppo_clip_zeroes_it():
  mask = np.ones((2, 4), bool)
  old = np.full((2, 4), -1.0)
  delta = np.array([[0.5, -0.5, 0.0, 0.05], [0.5, -0.5, 0.0, 0.05]])  # r = 1.65, 0.61, 1, 1.05
  lp = old + delta
  adv = np.array([1.0, -1.0])
  kw = dict(clip_low=0.2, clip_high=0.2)
  g_ppo = jax.grad(lambda x: policy.ppo_clip(x, f32(old), f32(adv), mask, **kw)[0].sum())(f32(lp))
  cis_kw = dict(is_clip_low=0.2, is_clip_high=0.2)
  g_cis = jax.grad(lambda x: policy.cispo(x, f32(old), f32(adv), mask, **cis_kw)[0].sum())(f32(lp))
  # PPO zeroes the tokens clipped against the advantage sign (§11 clip-low / clip-high)
  outside = np.array([[True, False, False, False], [False, True, False, False]])
  assert np.all(np.asarray(g_ppo)[outside] == 0)
  # CISPO: every token keeps gradient ŵ·A with ŵ = clip(r, 0.8, 1.2)
  w_hat = np.clip(np.exp(delta), 0.8, 1.2)
  np.testing.assert_allclose(g_cis, w_hat * adv[:, None], rtol=RTOL)
  assert np.all(np.asarray(g_cis) != 0)
  inside = np.abs(delta) < 0.1  # r inside the clip range: both are r·A
  np.testing.assert_allclose(np.asarray(g_cis)[inside], np.asarray(g_ppo)[inside], rtol=RTOL)


def test_gmpo_am_gm_and_closed_form():
  lp, old, adv, mask = batch(seed=9, scale=0.6)
  d = 0.4
  j_gm, _ = policy.gmpo(f32(lp), f32(old), f32(adv), mask, clip_log=d)
  np.testing.assert_allclose(
    j_gm, ref.j_gmpo_closed_form(lp, old, adv, mask, d), rtol=RTOL, atol=ATOL
  )
  # GRPO's per-sequence objective with the same trust region, seq_mean_token_mean
  j_ppo, _ = policy.ppo_clip(
    f32(lp), f32(old), f32(adv), mask, clip_low=1 - np.exp(-d), clip_high=np.exp(d) - 1
  )
  n = np.maximum(mask.sum(-1), 1)
  grpo_seq = np.asarray(j_ppo).sum(-1) / n
  assert np.all(np.abs(np.asarray(j_gm)) <= np.abs(grpo_seq) * (1 + 1e-6) + 1e-7)
  assert np.all(np.sign(np.asarray(j_gm)) == np.sign(grpo_seq))
  assert np.any(np.abs(np.asarray(j_gm)) < np.abs(grpo_seq) * (1 - 1e-3))  # strict somewhere


@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(1.0, 1.05), (0.3, 4.0)])
def test_sapo_gradient_weight_is_sech2(tau_pos, tau_neg):
  lp, old, adv, mask = batch(seed=10, scale=0.8)
  fn = lambda x: policy.sapo(x, f32(old), f32(adv), mask, tau_pos=tau_pos, tau_neg=tau_neg)  # noqa: E731
  g = jax.grad(lambda x: fn(x)[0].sum())(f32(lp))
  r = np.exp(lp - old)
  a = np.broadcast_to(adv[:, None], mask.shape)
  tau = np.where(a > 0, tau_pos, tau_neg)
  sech2 = 1.0 / np.cosh(tau * (r - 1) / 2) ** 2
  np.testing.assert_allclose(g, np.where(mask, sech2 * r * a, 0), rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(fn(f32(lp))[1]["gate_weight"], np.where(mask, sech2, 0), rtol=RTOL)


GARBAGE_CASES = [
  ("ppo_clip", dict(dual_clip=2.0)),
  ("pg", {}),
  ("gspo", {}),
  ("gspo_token", {}),
  ("gmpo", {}),
  ("cispo", dict(cispo_mask=True)),
  ("sapo", {}),
]


@pytest.mark.parametrize(("name", "kwargs"), GARBAGE_CASES)
@pytest.mark.parametrize("garbage", [1e9, -1e9, np.inf, np.nan])
def test_padding_garbage_changes_nothing(name, kwargs, garbage):
  lp, old, adv, mask = batch(seed=11)
  fn = getattr(policy, name)

  def run(x, o):
    def loss(y):
      j, _ = fn(y, o, f32(adv), mask, **kwargs)
      return jnp.sum(j)

    return jax.value_and_grad(loss)(x)

  v0, g0 = run(f32(lp), f32(old))
  v1, g1 = run(f32(np.where(mask, lp, garbage)), f32(np.where(mask, old, -garbage)))
  assert np.isfinite(v1) and np.all(np.isfinite(g1))
  np.testing.assert_array_equal(v0, v1)
  np.testing.assert_array_equal(g0, g1)
  assert np.all(np.asarray(g1)[~mask] == 0)


def test_cispo_minimax_setting_is_weight_without_floor_and_mask_at_0_8_and_1_28():
  """IS weight with no lower bound (ε^IS_low = 1), token mask at 1 − 0.2 / 1 + 0.28 (§2.6)."""
  mask = np.ones((2, 3), bool)
  old = np.zeros((2, 3))
  lp = np.log(np.array([[0.5, 0.9, 1.5], [0.5, 0.9, 1.5]]))  # r = 0.5, 0.9, 1.5
  adv = np.array([1.0, -1.0])
  j, d = policy.cispo(f32(lp), f32(old), f32(adv), mask, cispo_mask=True)
  w = np.asarray(d["is_weight"])
  np.testing.assert_allclose(w, [[0.5, 0.9, 1.28], [0.5, 0.9, 1.28]], rtol=1e-6)  # no floor
  kept = np.asarray(j) != 0
  # dropped: A > 0 with r > 1.28 (row 0, token 2); A < 0 with r < 0.8 (row 1, token 0)
  np.testing.assert_array_equal(kept, [[True, True, False], [False, True, True]])
  np.testing.assert_array_equal(d["is_clipped_high"], [[0, 0, 1], [0, 0, 0]])
  np.testing.assert_array_equal(d["is_clipped_low"], [[0, 0, 0], [1, 0, 0]])
