"""Switches that reproduce verl's conventions (docs/conventions.md), on a 4x3 case by hand.

The 4x3 batch: row 0 full, row 1 a single token, row 2 with a hole (a non-action token inside
the completion), row 3 two tokens. References are written from verl's formulas
(`core_algos.py`, `torch_functional.masked_whiten`) in float64 NumPy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives as obj

MASK = np.array([[1, 1, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0]], np.float64)


def verl_masked_whiten(x, m):
  """verl_F.masked_whiten: unbiased variance, (x - mean) * rsqrt(var + 1e-8)."""
  n = m.sum()
  mean = (x * m).sum() / n
  var = (((x - mean) ** 2) * m).sum() / n * n / (n - 1)
  return (x - mean) / np.sqrt(var + 1e-8)


def test_whiten_unbiased_matches_verl_and_population_is_the_spec():
  adv = np.array([[0.5, -1.0, 2.0], [1.5, 9.0, 9.0], [-0.5, 9.0, 0.25], [1.0, 3.0, 9.0]])
  got = obj.whiten(jnp.float32(adv), jnp.float32(MASK), variance="unbiased")
  np.testing.assert_allclose(got, verl_masked_whiten(adv, MASK) * MASK, rtol=1e-5, atol=1e-6)
  x = adv[MASK > 0]  # 8 tokens
  pop = obj.whiten(jnp.float32(adv), jnp.float32(MASK))
  np.testing.assert_allclose(
    np.asarray(pop)[MASK > 0], (x - x.mean()) / (x.std() + 1e-6), rtol=1e-5
  )
  # The two differ by sqrt(n / (n - 1)): 7% at 8 tokens.
  ratio = np.asarray(pop)[MASK > 0] / np.asarray(got)[MASK > 0]
  np.testing.assert_allclose(ratio, np.sqrt(8 / 7), rtol=1e-4)
  with pytest.raises(ValueError, match="population, unbiased"):
    obj.whiten(jnp.float32(adv), jnp.float32(MASK), variance="bessel")


def test_reinforce_pp_baseline_is_group_centred_then_token_whitened():
  rewards = np.array([1.0, 0.0, 0.5, 2.0])  # groups (0, 1) and (2, 3)
  got = obj.reinforce_pp_baseline(jnp.float32(rewards), 2, mask=jnp.float32(MASK))
  centred = np.array([0.5, -0.5, -0.75, 0.75])  # R - group mean
  want = verl_masked_whiten(centred[:, None] * MASK, MASK) * MASK
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert got.shape == MASK.shape
  # The spec's reinforce_baseline subtracts the batch mean instead: a different estimator.
  spec = obj.reinforce_baseline(jnp.float32(rewards), 2)
  np.testing.assert_allclose(spec, rewards - rewards.mean(), rtol=1e-6)


def verl_gae(rewards, values, m, gamma, lam):
  """verl's compute_gae_advantage_return loop (before its whitening)."""
  b, t = m.shape
  nextvalues, lastgaelam, out = np.zeros(b), np.zeros(b), np.zeros((b, t))
  for i in reversed(range(t)):
    delta = rewards[:, i] + gamma * nextvalues - values[:, i]
    lastgaelam_ = delta + gamma * lam * lastgaelam
    nextvalues = values[:, i] * m[:, i] + (1 - m[:, i]) * nextvalues
    lastgaelam = lastgaelam_ * m[:, i] + (1 - m[:, i]) * lastgaelam
    out[:, i] = lastgaelam
  return out, out + values


def test_gae_carries_across_a_hole_like_verl_and_resets_by_default():
  rewards = np.array([[0, 0, 1.0], [2.0, 0, 0], [0, 0, -1.0], [0, 0.5, 0]])
  values = np.array([[0.1, 0.2, 0.3], [0.4, 0, 0], [0.5, 7.0, 0.6], [0.2, 0.1, 0]])
  gamma, lam = 0.9, 0.8
  adv, ret = obj.gae(
    jnp.float32(rewards), jnp.float32(values), jnp.float32(MASK), gamma, lam, carry_masked=True
  )
  want_adv, want_ret = verl_gae(rewards, values * MASK, MASK, gamma, lam)
  np.testing.assert_allclose(adv, want_adv * MASK, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ret, want_ret * MASK, rtol=1e-5, atol=1e-6)
  # Row 2 by hand: A_2 = -1 - 0.6; the hole passes (A, V) of token 2 to token 0.
  a2 = -1.0 - 0.6
  a0 = (0 + gamma * 0.6 - 0.5) + gamma * lam * a2
  np.testing.assert_allclose(np.asarray(adv)[2], [a0, 0.0, a2], rtol=1e-5)
  # Default (spec): the hole resets, so token 0 sees V = A = 0 after it.
  reset, _ = obj.gae(jnp.float32(rewards), jnp.float32(values), jnp.float32(MASK), gamma, lam)
  np.testing.assert_allclose(np.asarray(reset)[2], [-0.5, 0.0, a2], rtol=1e-5)
  # Identical on prefix masks (rows 0, 1, 3).
  np.testing.assert_allclose(np.asarray(reset)[[0, 1, 3]], np.asarray(adv)[[0, 1, 3]], rtol=1e-6)


def test_seq_mean_token_sum_norm_with_verls_normaliser():
  loss = np.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 9.0, 6.0], [7.0, 8.0, 9.0]])
  total = (loss * MASK).sum()  # 36
  spec = obj.aggregate(jnp.float32(loss), jnp.float32(MASK), "seq_mean_token_sum_norm", max_len=3)
  verl = obj.aggregate(
    jnp.float32(loss),
    jnp.float32(MASK),
    "seq_mean_token_sum_norm",
    max_len=3,
    sum_norm_sequences=False,
  )
  np.testing.assert_allclose(spec, total / (4 * 3), rtol=1e-6)
  np.testing.assert_allclose(verl, total / 3, rtol=1e-6)  # B' times the spec's value


@pytest.mark.parametrize("x", [25.0, -25.0])
def test_k1_and_k2_are_not_clamped(x):
  """x = ℓ^ref − ℓ beyond the ±20 exp clamp: k1 = −x, k2 = x²/2, with their gradients."""
  ref = jnp.float32([[x - 1.0]])
  lp = jnp.float32([[-1.0]])
  for est, value, grad in (("k1", -x, 1.0), ("k2", 0.5 * x * x, -x)):
    f = lambda logp, est=est: obj.kl_penalty(logp, ref, estimator=est).sum()  # noqa: E731
    v, g = jax.value_and_grad(f)(lp)
    np.testing.assert_allclose(v, value, rtol=1e-6)
    np.testing.assert_allclose(g, [[grad]], rtol=1e-6)
  k3 = obj.kl_penalty(lp, ref, estimator="k3")
  assert np.isfinite(np.asarray(k3)).all()  # the clamp stays inside exp


def test_k3_value_clamp_like_verls_low_var_kl():
  lp = jnp.float32([[-1.0, -1.0]])
  ref = lp + jnp.float32([[3.0, 1.0]])  # k3(3) = 16.09 > 10, k3(1) = 0.718
  f = lambda logp, c: obj.kl_penalty(logp, ref, estimator="k3", k3_clamp=c).sum()  # noqa: E731
  v, g = jax.value_and_grad(f)(lp, 10.0)
  np.testing.assert_allclose(v, 10.0 + np.e - 2.0, rtol=1e-6)
  # dk3/dℓ = 1 − e^x; the clamped token has none.
  np.testing.assert_allclose(g, [[0.0, 1.0 - np.e]], rtol=1e-5)
  v0, g0 = jax.value_and_grad(f)(lp, 0.0)  # off (the spec): 16.09 with its gradient
  np.testing.assert_allclose(v0, np.exp(3.0) - 4.0 + np.e - 2.0, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g0)[0, 0], 1.0 - np.exp(3.0), rtol=1e-5)
