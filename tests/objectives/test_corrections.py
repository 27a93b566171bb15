"""Behaviour-policy corrections (objectives.md §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from jaxrl_llm.objectives import corrections

jax.config.update("jax_enable_x64", False)

RTOL, ATOL = 1e-5, 1e-6


def _batch(seed=0, scale=0.3):
  rng = np.random.default_rng(seed)
  mask = np.arange(7)[None] < np.array([7, 3, 5, 1, 0, 6])[:, None]
  old = np.float64(np.float32(-rng.uniform(0.05, 3.0, mask.shape)))
  beh = np.float64(np.float32(old + scale * rng.normal(size=mask.shape)))
  return old, beh, mask


NAMES = [
  ("none", {}),
  ("tis_token", {}),
  ("tis_seq", {}),
  ("mis_token", {}),
  ("mis_seq", {}),
  ("geo_mask", {}),
  ("tis_token+geo_mask", dict(geo_high=1.15)),
  ("mis_seq+geo_mask", dict(geo_low=0.9, geo_high=1.1)),
  ("geo_mask+tis_seq", dict(geo_low=0.95)),
]


@pytest.mark.parametrize(("name", "kwargs"), NAMES)
def test_weight_matches_reference(name, kwargs):
  old, beh, mask = _batch()
  w, metrics = corrections.behaviour_weight(
    jnp.float32(old), jnp.float32(beh), mask, name=name, cap=1.3, **kwargs
  )
  ref_name = "tis_seq+geo_mask" if name == "geo_mask+tis_seq" else name  # order-free
  want = ref.behaviour_weight(old, beh, mask, ref_name, cap=1.3, **kwargs)
  np.testing.assert_allclose(w, want, rtol=RTOL, atol=ATOL)
  assert all(np.isfinite(float(v)) for v in metrics.values())


def test_weight_is_stop_gradient():
  old, beh, mask = _batch(1)
  g = jax.grad(
    lambda o, b: corrections.behaviour_weight(o, b, mask, name="tis_token")[0].sum(), (0, 1)
  )(jnp.float32(old), jnp.float32(beh))
  assert all(np.all(np.asarray(x) == 0) for x in g)


def test_metrics_match_reference():
  old, beh, mask = _batch(2, scale=0.5)
  cap = 1.3
  d = (old - beh)[mask]
  rho = np.exp(d)
  args = (jnp.float32(old), jnp.float32(beh), mask)
  _, m_tis = corrections.behaviour_weight(*args, name="tis_token", cap=cap)
  w = np.minimum(rho, cap)
  mism = np.abs(np.exp(old) - np.exp(beh))[mask]
  want = {
    "behaviour/rho_mean": rho.mean(),
    "behaviour/rho_max": rho.max(),
    "behaviour/frac_truncated": (rho > cap).mean(),
    "behaviour/frac_masked_tokens": 0.0,
    "behaviour/frac_masked_seqs": 0.0,
    "behaviour/ess": w.sum() ** 2 / (len(w) * (w**2).sum()),
    "behaviour/mismatch_mean": mism.mean(),
    "behaviour/mismatch_max": mism.max(),
    "behaviour/kl_k3": (rho - d - 1).mean(),  # k3 with samples from μ: E_μ[ρ − log ρ − 1]
  }
  assert set(m_tis) == set(want)
  for k, v in want.items():
    np.testing.assert_allclose(m_tis[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
  assert want["behaviour/frac_truncated"] > 0

  _, m_mis = corrections.behaviour_weight(*args, name="mis_seq", cap=cap)
  seq = np.where(mask, old - beh, 0).sum(-1)
  nonempty = mask.sum(-1) > 0
  rejected = (np.exp(seq) > cap) & nonempty
  np.testing.assert_allclose(m_mis["behaviour/frac_masked_seqs"], rejected.sum() / nonempty.sum())
  np.testing.assert_allclose(
    m_mis["behaviour/frac_masked_tokens"], mask[rejected].sum() / mask.sum(), rtol=RTOL
  )
  assert 0 < rejected.sum() < nonempty.sum()


def test_the_sampler_kl_is_never_negative_at_a_tiny_mismatch():
  """k3 = ρ − 1 − log ρ >= 0: at bf16-like mismatches of 1e-4 nats, ρ − δ − 1 in float32 rounds
  below 0; the metric (expm1, floored) matches the float64 value and never does."""
  rng = np.random.default_rng(3)
  beh = rng.normal(-2.0, 0.5, (8, 64))
  old = beh + rng.normal(0, 1e-4, beh.shape)
  mask = np.ones(beh.shape, bool)
  _, m = corrections.behaviour_weight(jnp.float32(old), jnp.float32(beh), mask, name="none")
  d = (np.float32(old) - np.float32(beh)).astype(np.float64)
  want = (np.expm1(d) - d).mean()
  assert float(m["behaviour/kl_k3"]) >= 0
  np.testing.assert_allclose(float(m["behaviour/kl_k3"]), want, rtol=1e-2, atol=1e-12)


def test_geo_mask_is_length_independent_and_mis_seq_is_not():
  # same per-token mismatch δ^μ = 0.1 (ρ = 1.105) on a 2-token and a 40-token sequence
  t = 40
  mask = np.arange(t)[None] < np.array([2, 40])[:, None]
  beh = np.full((2, t), -1.0)
  old = beh + 0.1
  args = (jnp.float32(old), jnp.float32(beh), mask)
  w_geo, _ = corrections.behaviour_weight(*args, name="geo_mask", cap=2.0)
  w_mis, m = corrections.behaviour_weight(*args, name="mis_seq", cap=2.0)
  np.testing.assert_array_equal(np.asarray(w_geo)[mask], 1.0)  # both kept alike
  assert np.all(np.asarray(w_mis)[0, :2] > 0)  # exp(0.2) ≤ 2: short one kept
  assert np.all(np.asarray(w_mis)[1] == 0)  # exp(4.0) > 2: long one rejected
  assert float(m["behaviour/frac_masked_seqs"]) == 0.5
  # and the geometric mask rejects both alike when the per-token mismatch is too large
  w_geo_tight, _ = corrections.behaviour_weight(*args, name="geo_mask", cap=1.05)
  assert np.all(np.asarray(w_geo_tight) == 0)


def test_padding_garbage_and_long_sequences_stay_finite():
  old, beh, mask = _batch(3)
  old_g = np.where(mask, old, 1e9)
  beh_g = np.where(mask, beh, -np.inf)
  for name in ["tis_token", "tis_seq", "mis_seq+geo_mask", "mis_token"]:
    w0, m0 = corrections.behaviour_weight(jnp.float32(old), jnp.float32(beh), mask, name=name)
    w1, m1 = corrections.behaviour_weight(jnp.float32(old_g), jnp.float32(beh_g), mask, name=name)
    np.testing.assert_array_equal(w0, w1)
    for k in m0:
      np.testing.assert_array_equal(m0[k], m1[k], err_msg=k)
  big = np.full((1, 4096), 0.5)  # Σ δ = 2048: compared in log space, no overflow
  w, m = corrections.behaviour_weight(
    jnp.float32(big), jnp.zeros((1, 4096)), jnp.ones((1, 4096), bool), name="tis_seq"
  )
  np.testing.assert_allclose(w, 2.0)
  assert all(np.isfinite(float(v)) for v in m.values())


def test_unknown_name_lists_valid_names():
  with pytest.raises(ValueError, match=r"tis_token.*geo_mask"):
    corrections.behaviour_weight(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), name="tis")
  with pytest.raises(ValueError):
    corrections.parse_correction("tis_token+mis_seq")
  assert corrections.parse_correction("geo_mask") == ("none", True)
  assert corrections.parse_correction("mis_token+geo_mask") == ("mis_token", True)
