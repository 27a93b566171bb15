"""KL estimators (objectives.md §4), including the exact-enumeration gradient test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from jaxrl_llm.objectives import kl_penalty

jax.config.update("jax_enable_x64", False)

RTOL, ATOL = 1e-5, 1e-6
ESTIMATORS = ["k1", "k2", "k3", "k3_is"]


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  mask = np.arange(6)[None] < np.array([6, 2, 0, 4])[:, None]
  r = lambda x: np.float64(np.float32(x))  # noqa: E731
  old = r(-rng.uniform(0.1, 3.0, mask.shape))
  logp = r(old + 0.3 * rng.normal(size=mask.shape))
  ref_logp = r(old + 0.5 * rng.normal(size=mask.shape))
  return logp, ref_logp, old, mask


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_value_and_gradient_match_reference(estimator):
  logp, ref_logp, old, mask = _batch()

  def f(x):
    return kl_penalty(x, jnp.float32(ref_logp), jnp.float32(old), estimator=estimator, mask=mask)

  want = np.where(mask, ref.kl(logp, ref_logp, old, estimator), 0)
  np.testing.assert_allclose(f(jnp.float32(logp)), want, rtol=RTOL, atol=ATOL)
  c = np.random.default_rng(1).normal(size=mask.shape)
  g = jax.grad(lambda x: jnp.sum(jnp.float32(c) * f(x)))(jnp.float32(logp))
  g_ref = ref.fd_grad(lambda x: np.sum(c * ref.kl(x, ref_logp, old, estimator)), logp, mask)
  np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL)


def test_k3_is_needs_old_logp():
  with pytest.raises(ValueError, match="old_logp"):
    kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), estimator="k3_is")
  with pytest.raises(ValueError, match="k1, k2, k3, k3_is"):
    kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), estimator="k4")


def test_padding_garbage():
  logp, ref_logp, old, mask = _batch(2)
  for est in ESTIMATORS:
    f = lambda x, r_, o, e=est: kl_penalty(x, r_, o, estimator=e, mask=mask).sum()  # noqa: E731
    v0, g0 = jax.value_and_grad(f)(jnp.float32(logp), jnp.float32(ref_logp), jnp.float32(old))
    v1, g1 = jax.value_and_grad(f)(
      jnp.float32(np.where(mask, logp, 1e9)),
      jnp.float32(np.where(mask, ref_logp, -np.inf)),
      jnp.float32(np.where(mask, old, np.nan)),
    )
    np.testing.assert_array_equal(v0, v1)
    np.testing.assert_array_equal(g0, g1)


def _expected_grad(theta, pi_ref, sample_logits, estimator):
  """∇_θ E_{a ~ sg[π_sample]}[k(a)] by exact enumeration over a categorical policy."""

  def objective(th):
    logp = jax.nn.log_softmax(th)[None, :]  # every action as one "token" position [1, V]
    old = jax.nn.log_softmax(sample_logits)[None, :]
    k = kl_penalty(logp, jnp.log(pi_ref)[None, :], old, estimator=estimator)
    probs = jax.lax.stop_gradient(jnp.exp(old[0]))
    return jnp.sum(probs * k[0])

  return jax.grad(objective)(theta)


def _true_kl_grad(theta, pi_ref):
  def kl(th):
    logp = jax.nn.log_softmax(th)
    return jnp.sum(jnp.exp(logp) * (logp - jnp.log(pi_ref)))

  return jax.grad(kl)(theta)


def test_k3_is_has_the_true_kl_gradient_and_naive_k3_does_not():
  rng = np.random.default_rng(3)
  v = 5
  theta = jnp.float32(rng.normal(size=v))
  pi_ref = jnp.float32(rng.dirichlet(np.ones(v)))
  old_logits = theta + jnp.float32(0.7 * rng.normal(size=v))  # off-policy samples
  true = np.asarray(_true_kl_grad(theta, pi_ref))

  # k3_is under samples from π_old (off-policy) and from π_θ itself (on-policy)
  for sample_logits in (old_logits, theta):
    got = _expected_grad(theta, pi_ref, sample_logits, "k3_is")
    np.testing.assert_allclose(got, true, rtol=1e-4, atol=1e-6)

  # naive on-policy k3 (and k1) used as a loss: biased
  naive_k3 = np.asarray(_expected_grad(theta, pi_ref, theta, "k3"))
  naive_k1 = np.asarray(_expected_grad(theta, pi_ref, theta, "k1"))
  assert np.abs(naive_k3 - true).max() > 1e-2
  assert np.abs(naive_k1).max() < 1e-6  # E_π[∇ log π] = 0: no signal at all
  # the naive k3 gradient is the gradient of the reverse KL(π_ref‖π_θ)
  rev = jax.grad(lambda th: jnp.sum(pi_ref * (jnp.log(pi_ref) - jax.nn.log_softmax(th))))(theta)
  np.testing.assert_allclose(naive_k3, rev, rtol=1e-4, atol=1e-6)
  # while its value is unbiased: E_π[k3] = KL(π‖π_ref)
  p = jax.nn.softmax(theta)
  k3 = kl_penalty(jnp.log(p)[None], jnp.log(pi_ref)[None], estimator="k3")[0]
  np.testing.assert_allclose(jnp.sum(p * k3), jnp.sum(p * jnp.log(p / pi_ref)), rtol=1e-5)
