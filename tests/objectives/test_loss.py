"""policy_loss (objectives.md §2, §3, §5, §11) and the name registry (§10)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest

from jaxrl_llm import objectives as obj

jax.config.update("jax_enable_x64", False)

RTOL, ATOL = 1e-5, 1e-6
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def _batch(seed=0, scale=0.4):
  logp, old, adv, mask = ref.ragged_batch(seed, scale=scale)
  r = lambda x: np.float64(np.float32(x))  # noqa: E731
  w = r(np.where(mask, np.random.default_rng(seed + 100).uniform(0, 2, mask.shape), 0))
  return r(logp), r(old), r(adv), mask, w


def _ref_loss(objective, lp, old, adv, mask, w, mode, **kw):
  """aggregate(−w·J) from the float64 references (sequence terms: w's sequence mean)."""
  if objective == "ppo_clip":
    return ref.aggregate(-w * ref.j_ppo_clip(lp, old, adv, mask, **kw), mask, mode, 16)
  if objective == "gspo":
    j = ref.j_gspo(lp, old, adv, mask, **kw)
  else:
    j = ref.j_gmpo(lp, old, adv, mask, **kw)
  if mode == "seq_mean":
    n = mask.sum(-1)
    w_seq = (w * mask).sum(-1) / np.maximum(n, 1)
    return -(w_seq * j)[n > 0].sum() / (n > 0).sum()
  return ref.aggregate(-w * j[:, None], mask, mode, 16)


@pytest.mark.parametrize(
  ("objective", "kwargs", "mode"),
  [("ppo_clip", dict(clip_low=0.2, clip_high=0.28), m) for m in MODES]
  + [("gspo", dict(clip_low=0.1, clip_high=0.1), m) for m in ("seq_mean", "token_mean")]
  + [("gmpo", {}, m) for m in ("seq_mean", "seq_mean_token_mean")],
)
def test_policy_loss_value_and_gradient(objective, kwargs, mode):
  lp, old, adv, mask, w = _batch(1)

  def loss(x):
    kw = dict(objective=objective, aggregation=mode, behaviour_weight=jnp.float32(w), max_len=16)
    return obj.policy_loss(x, jnp.float32(old), jnp.float32(adv), mask, **kw, **kwargs)

  (v, metrics), g = jax.value_and_grad(loss, has_aux=True)(jnp.float32(lp))
  want = _ref_loss(objective, lp, old, adv, mask, w, mode, **kwargs)
  np.testing.assert_allclose(v, want, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(metrics["policy/loss"], v)
  g_ref = ref.fd_grad(
    lambda x: _ref_loss(objective, x, old, adv, mask, w, mode, **kwargs), lp, mask
  )
  np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL)


def test_policy_loss_metrics():
  lp, old, adv, mask, _ = _batch(2, scale=0.5)
  kw = dict(objective="ppo_clip", aggregation="token_mean", clip_low=0.1, clip_high=0.25)
  _, m = obj.policy_loss(jnp.float32(lp), jnp.float32(old), jnp.float32(adv), mask, **kw)
  r = np.exp(lp - old)[mask]
  a = np.broadcast_to(adv[:, None], mask.shape)[mask]
  want = {
    "policy/clip_frac_low": np.mean((r < 0.9) & (a < 0)),
    "policy/clip_frac_high": np.mean((r > 1.25) & (a > 0)),
    "policy/clip_frac": np.mean(((r < 0.9) & (a < 0)) | ((r > 1.25) & (a > 0))),
    "policy/ratio_mean": r.mean(),
    "policy/ratio_min": r.min(),
    "policy/ratio_max": r.max(),
    "policy/approx_kl": np.mean(-(lp - old)[mask]),
  }
  for k, v in want.items():
    np.testing.assert_allclose(m[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
  assert want["policy/clip_frac_low"] > 0 and want["policy/clip_frac_high"] > 0
  assert all(v.shape == () for v in m.values())


ALL = ["ppo_clip", "pg", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "ppo_critic"]


@pytest.mark.parametrize(
  ("objective", "mode"),
  [(o, m) for o in ALL for m in MODES] + [("gspo", "seq_mean"), ("gmpo", "seq_mean")],
)
def test_microbatches_give_the_minibatch_gradient(objective, mode):
  lp, old, adv, mask, w = _batch(3)

  def loss(x, sl, n=None):
    kw = dict(objective=objective, aggregation=mode, max_len=9, normalizer=n)
    o, a, ww = jnp.float32(old[sl]), jnp.float32(adv[sl]), jnp.float32(w[sl])
    return obj.policy_loss(x, o, a, mask[sl], behaviour_weight=ww, **kw)[0]

  full, g_full = jax.value_and_grad(loss)(jnp.float32(lp), slice(None))
  n = obj.normalizer(mask, mode, max_len=9)
  total, grads = 0.0, []
  for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):  # k = 3 uneven microbatches
    v, g = jax.value_and_grad(loss)(jnp.float32(lp[sl]), sl, n)
    total += v
    grads.append(g)
  np.testing.assert_allclose(total, full, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(np.concatenate(grads), g_full, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("objective", ALL)
def test_policy_loss_padding_garbage(objective):
  lp, old, adv, mask, w = _batch(4)

  def run(x, o, ww):
    def f(y):
      kw = dict(objective=objective, aggregation="seq_mean_token_mean", behaviour_weight=ww)
      return obj.policy_loss(y, o, jnp.float32(adv), mask, **kw)

    return jax.value_and_grad(f, has_aux=True)(x)

  (v0, m0), g0 = run(jnp.float32(lp), jnp.float32(old), jnp.float32(w))
  (v1, m1), g1 = run(
    jnp.float32(np.where(mask, lp, 1e9)),
    jnp.float32(np.where(mask, old, -1e9)),
    jnp.float32(np.where(mask, w, np.nan)),
  )
  np.testing.assert_array_equal(v0, v1)
  np.testing.assert_array_equal(g0, g1)
  for k in m0:
    np.testing.assert_array_equal(m0[k], m1[k], err_msg=k)


def test_policy_loss_with_correction_jits():
  lp, old, adv, mask, _ = _batch(5)
  beh = jnp.float32(old + 0.1)

  @jax.jit
  def step(x):
    w, wm = obj.behaviour_weight(jnp.float32(old), beh, mask, name="tis_token+geo_mask")
    kw = dict(objective="ppo_clip", aggregation="seq_mean_token_mean", behaviour_weight=w)
    loss, m = obj.policy_loss(x, jnp.float32(old), jnp.float32(adv), mask, **kw)
    k3 = obj.kl_penalty(x, jnp.float32(old), estimator="k3", mask=mask)
    kl = obj.aggregate(k3, mask, "seq_mean_token_mean")
    return loss + 0.04 * kl, {**m, **wm}

  g, metrics = jax.grad(step, has_aux=True)(jnp.float32(lp))
  assert np.all(np.isfinite(np.asarray(g)))
  assert "behaviour/ess" in metrics and "policy/clip_frac_high" in metrics


def test_registry():
  names = {"ppo_clip", "pg", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "ppo_critic", "rspo"}
  assert set(obj.OBJECTIVES) == names
  assert obj.get_advantage("grpo") is obj.grpo
  assert obj.get_objective("ppo_critic").fn is obj.ppo_clip
  with pytest.raises(ValueError, match=r"valid names: .*ppo_clip"):
    obj.get_objective("ppo")
  with pytest.raises(ValueError, match=r"valid names: .*mean_only"):
    obj.get_advantage("drgrpo")
  assert obj.get_objective("rspo").fn is obj.rspo
  assert obj.get_objective("rspo").inputs == ("router_logp", "old_router_logp")
  assert obj.get_objective("gspo").hyperparameters == {"clip_low": 3e-4, "clip_high": 4e-4}
  assert obj.get_objective("cispo").resolve({"clip_high": None, "is_clip_low": 0.5}) == {
    "is_clip_low": 0.5,
    "is_clip_high": 0.28,
    "clip_low": 0.2,
    "clip_high": 0.28,
    "cispo_mask": False,
  }
  obj.validate("correction", "mis_seq+geo_mask")
  obj.validate("kl", "k3_is")
  obj.validate("aggregation", "seq_mean")
  with pytest.raises(ValueError, match="k3_is"):
    obj.validate("kl", "k5")
  with pytest.raises(ValueError, match="valid names"):
    z = jnp.zeros((1, 2))
    obj.policy_loss(z, z, jnp.zeros(1), z + 1, objective="ppo_clip", aggregation="mean")
