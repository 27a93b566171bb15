"""Advantage estimators (objectives.md §1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from jaxrl_llm.objectives import advantages

jax.config.update("jax_enable_x64", False)

RTOL, ATOL = 1e-5, 1e-6
G = 4
NAMES = ["grpo", "mean_only", "rloo", "batch_std", "reinforce_baseline"]


def _rewards(seed=0, p=3):
  r = np.random.default_rng(seed).normal(size=p * G)
  return np.float64(np.float32(r))


REFS = {
  "grpo": ref.adv_grpo,
  "mean_only": ref.adv_mean_only,
  "rloo": ref.adv_rloo,
  "batch_std": ref.adv_batch_std,
  "reinforce_baseline": ref.adv_reinforce_baseline,
}


@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name):
  r = _rewards()
  out = getattr(advantages, name)(jnp.float32(r), G)
  assert out.shape == r.shape and out.dtype == jnp.float32
  np.testing.assert_allclose(out, REFS[name](r, G), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["batch_std", "reinforce_baseline"])
def test_invalid_groups_excluded_from_batch_statistics(name):
  r = _rewards(1)
  valid = np.repeat([True, False, True], G)
  r_garbage = np.where(valid, r, 1e6)  # masked-out group with wild rewards
  out = getattr(advantages, name)(jnp.float32(r_garbage), G, valid=valid)
  np.testing.assert_allclose(out, REFS[name](r, G, valid), rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(out)[~valid] == 0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -3.7, 1e-8])
def test_identical_rewards_give_exactly_zero(name, value):
  # group estimators: one flat group among varied ones; batch baseline: the whole batch flat
  r = _rewards(2)
  r[:G] = value
  if name == "reinforce_baseline":
    r[:] = value
  out = np.asarray(getattr(advantages, name)(jnp.float32(r), G))
  assert np.all(np.isfinite(out))
  assert np.all(out[:G] == 0.0)


def test_identical_rewards_zero_under_jit():
  r = jnp.full((2 * G,), 0.1, jnp.float32)
  for name in ["grpo", "mean_only", "rloo", "batch_std"]:
    out = jax.jit(getattr(advantages, name), static_argnums=1)(r, G)
    assert np.all(np.asarray(out) == 0.0)


def test_dr_grpo_bounded_as_std_vanishes_grpo_is_not():
  base = np.array([0.0, 1.0, 0.0, 1.0])
  for spread in [1e-1, 1e-3, 1e-5]:
    r = jnp.float32(0.5 + spread * base)
    centred = np.abs(np.asarray(r) - np.asarray(r).mean())
    a_mean = np.abs(np.asarray(advantages.mean_only(r, G)))
    a_grpo = np.abs(np.asarray(advantages.grpo(r, G)))
    assert np.all(a_mean <= spread)  # |A| ≤ reward spread → 0
    # GRPO divides by std: advantages stay O(1) however small the spread, i.e. the gain
    # |A| / |R − mean| ~ 1/std grows without bound
    assert a_grpo.max() > 0.3
    assert (a_grpo / np.maximum(centred, 1e-30)).max() > 0.3 / spread


def test_rloo_is_leave_one_out():
  r = _rewards(3)
  out = advantages.rloo(jnp.float32(r), G)
  rr = r.reshape(-1, G)
  loo = np.stack([rr[:, i] - np.delete(rr, i, axis=1).mean(1) for i in range(G)], 1).ravel()
  np.testing.assert_allclose(out, loo, rtol=RTOL, atol=ATOL)


def test_whiten():
  rng = np.random.default_rng(4)
  x = np.float64(np.float32(rng.normal(size=(3, 5)) * 3 + 1))
  mask = np.arange(5)[None] < np.array([5, 2, 3])[:, None]
  out = np.asarray(advantages.whiten(jnp.float32(x), mask))
  sel = x[mask]
  np.testing.assert_allclose(out[mask], (sel - sel.mean()) / (sel.std() + 1e-6), rtol=1e-4)
  assert np.all(out[~mask] == 0)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference(gamma, lam):
  rng = np.random.default_rng(5)
  mask = np.arange(6)[None] < np.array([6, 3, 1, 0])[:, None]
  rew = np.zeros(mask.shape)
  lengths = mask.sum(-1)
  for i, n in enumerate(lengths):  # terminal reward, minus a per-token KL term
    if n:
      rew[i, n - 1] = rng.normal()
  rew = np.float64(np.float32(rew - 0.05 * rng.uniform(size=mask.shape) * mask))
  values = np.float64(np.float32(rng.normal(size=mask.shape)))
  values_garbage = np.where(mask, values, 1e6)
  adv, ret = advantages.gae(jnp.float32(rew), jnp.float32(values_garbage), mask, gamma, lam)
  want_adv, want_ret = ref.gae(rew, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, want_adv, rtol=RTOL, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret, rtol=RTOL, atol=1e-5)


def test_gae_is_a_scan_and_jits():
  jaxpr = jax.make_jaxpr(lambda r, v, m: advantages.gae(r, v, m, 0.99, 0.95))(
    jnp.zeros((2, 64)), jnp.zeros((2, 64)), jnp.ones((2, 64), bool)
  )
  assert "scan" in str(jaxpr) and len(str(jaxpr)) < 5000  # no per-step unrolling


def test_bad_group_size():
  with pytest.raises(ValueError, match="group_size"):
    advantages.grpo(jnp.zeros(6), 4)
  with pytest.raises(ValueError, match="rloo"):
    advantages.rloo(jnp.zeros(6), 1)


@pytest.mark.parametrize("name", ["grpo", "mean_only", "rloo", "batch_std"])
def test_rows_outside_the_statistics_are_ignored_within_a_group(name):
  """§6 `overlong_in_group_stats=False`: an invalid row leaves its group's statistics, as if
  the group had only its valid rows (n in the mean, n − 1 in the std, n/(n−1) for RLOO)."""
  rewards = np.array([1.0, 0.0, 5.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # groups of 4
  valid = np.array([1, 1, 0, 1, 1, 1, 1, 0], bool)
  fn = getattr(advantages, name)
  got = np.asarray(fn(jnp.float32(rewards), 4, valid=jnp.asarray(valid)))
  assert np.all(got[~valid] == 0)
  for g in range(2):
    rows = np.arange(4 * g, 4 * g + 4)[valid[4 * g : 4 * g + 4]]
    r = rewards[rows]
    c = r - r.mean()
    want = {
      "grpo": c / (r.std(ddof=1) + 1e-6),
      "mean_only": c,
      "rloo": c * len(r) / (len(r) - 1),
    }.get(name)
    if name == "batch_std":
      want = c / (rewards[valid].std(ddof=1) + 1e-6)
    np.testing.assert_allclose(got[rows], want, rtol=1e-5, atol=1e-6)


def test_a_group_with_one_row_in_the_statistics_gets_zero():
  rewards = jnp.float32([1.0, 0.0, 3.0, 2.0])
  valid = jnp.asarray([True, False, True, True])
  for name in ("grpo", "mean_only", "rloo"):
    got = np.asarray(getattr(advantages, name)(rewards, 2, valid=valid))
    assert got[0] == 0.0 and got[1] == 0.0 and np.all(np.isfinite(got)), name
