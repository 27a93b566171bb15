"""RSPO (objectives.md §2.8): value and gradient against a float64 reference; γ properties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np

from jaxrl_llm.objectives import policy


def j_rspo_ref(logp, old, adv, mask, gamma, clip_low=0.2, clip_high=0.2):
  """Spec §2.8 written directly: W = min(r^s, clip(r^s, 1-εl, 1+εh)), S = (Π Wγ)^(s/|o|)."""
  out = np.zeros(len(adv))
  for i in range(len(adv)):
    m = mask[i]
    if not m.any():
      continue
    s = np.sign(adv[i])
    rs = np.exp(logp[i] - old[i]) ** s
    w = np.minimum(rs, np.clip(rs, 1 - clip_low, 1 + clip_high))
    prod = np.prod((w * gamma[i])[m])
    out[i] = prod ** (s / m.sum()) * adv[i]
  return out


def gamma_ref(cur, old, gamma_min):
  return np.maximum(gamma_min, np.exp(-np.mean(np.abs(cur - old), axis=(-2, -1))))


def _inputs(seed=0):
  logp, old, adv, mask = ref.ragged_batch(seed, scale=0.3)
  rng = np.random.default_rng(seed + 1)
  b, t = mask.shape
  old_r = -rng.uniform(0.1, 2.0, (b, t, 3, 2))
  cur_r = old_r + 0.2 * rng.normal(size=old_r.shape)
  r32 = lambda x: np.asarray(np.float32(x), np.float64)  # noqa: E731
  return r32(logp), r32(old), r32(adv), mask, r32(cur_r), r32(old_r)


def test_rspo_value_and_gradient_match_reference():
  logp, old, adv, mask, cur_r, old_r = _inputs()
  gamma = np.asarray(
    policy.router_shift_gamma(jnp.float32(cur_r), jnp.float32(old_r), gamma_min=0.3), np.float64
  )
  np.testing.assert_allclose(gamma, gamma_ref(cur_r, old_r, 0.3), rtol=1e-5)

  router = dict(router_logp=jnp.float32(cur_r), old_router_logp=jnp.float32(old_r), gamma_min=0.3)

  def loss(lp):
    j, _ = policy.rspo(lp, jnp.float32(old), jnp.float32(adv), mask, **router)
    return jnp.sum(j)

  j, diag = policy.rspo(jnp.float32(logp), jnp.float32(old), jnp.float32(adv), mask, **router)
  np.testing.assert_allclose(np.asarray(diag["router_gamma"])[mask], gamma[mask], rtol=1e-6)
  want = j_rspo_ref(logp, old, adv, mask, gamma)
  np.testing.assert_allclose(np.asarray(j), want, rtol=1e-5, atol=1e-6)
  grad = np.asarray(jax.grad(loss)(jnp.float32(logp)))
  want_g = ref.fd_grad(lambda x: j_rspo_ref(x, old, adv, mask, gamma).sum(), logp, mask)
  np.testing.assert_allclose(grad, want_g, rtol=1e-4, atol=1e-5)
  assert np.all(grad[~mask] == 0)


def test_gamma_properties():
  *_, old_r = _inputs(3)
  same = np.asarray(policy.router_shift_gamma(jnp.float32(old_r), jnp.float32(old_r)))
  np.testing.assert_array_equal(same, 1.0)  # unchanged router
  far = np.asarray(
    policy.router_shift_gamma(jnp.float32(old_r + 50.0), jnp.float32(old_r), gamma_min=0.25)
  )
  np.testing.assert_allclose(far, 0.25)  # floor γ_min
  shifted = old_r.copy()
  shifted[0, 2] += 1.0  # only token (0, 2) changes routing probabilities
  g = np.asarray(policy.router_shift_gamma(jnp.float32(shifted), jnp.float32(old_r)))
  assert g[0, 2] < 1.0 and np.sum(g < 1.0) == 1


def test_rspo_with_unit_gamma_and_no_clipping_is_a_geometric_mean():
  logp, old, adv, mask, _, _ = _inputs(5)
  same = jnp.zeros((*mask.shape, 2, 2), jnp.float32)  # unchanged router: γ = 1
  j, _ = policy.rspo(
    jnp.float32(logp),
    jnp.float32(old),
    jnp.float32(adv),
    mask,
    router_logp=same,
    old_router_logp=same,
    clip_low=0.99,
    clip_high=1e6,
  )
  lens = mask.sum(-1)
  geo = np.exp(np.where(mask, logp - old, 0).sum(-1) / np.maximum(lens, 1))
  np.testing.assert_allclose(np.asarray(j)[lens > 0], (geo * adv)[lens > 0], rtol=1e-5)
