"""The learner's loss on hand-made scores (no model): rejected tokens, sequence weights (§3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.config import default_config, parse, recipes
from jaxrl_llm.rl import Settings, stages
from jaxrl_llm.rl import loss as rl_loss
from jaxrl_llm.sampling import Scores
from jaxrl_llm.types import PolicyBatch


def _settings(recipe: str | None = None, **overrides) -> Settings:
  c = recipes.get_config(recipe) if recipe else default_config()
  recipes.apply(c, overrides)
  return parse(c).learner


def _loss(settings, logp, logits, old, mu, adv, mask, ref=None):
  """(loss, metrics) of one minibatch with minibatch-level normalisers, like the learner."""
  weight, _ = stages.behaviour_weight(old, mu, mask, settings.correction)
  b, t = mask.shape
  mb = PolicyBatch(
    prompt_tokens=jnp.zeros((b, 1), jnp.int32),
    prompt_mask=jnp.ones((b, 1), bool),
    tokens=jnp.zeros((b, t), jnp.int32),
    loss_mask=mask,
    old_logp=old,
    adv=adv,
    weight=weight,
    ref_logp=ref,
  )
  norms = rl_loss.normalizers(mb, settings, t)
  entropy = objectives.entropy_from_logits(logits)
  sc = Scores(logp=logp, entropy=entropy, values=None, logits=logits)
  return rl_loss.loss_from_scores(sc, mb, norms, settings=settings, max_len=t)


def test_rejected_tokens_leave_the_kl_term_deepseek_v32():
  """Issue reproduction: k3_is, β 0.01, geo-mask ≤ 2 rejects row 1 (spec §3, §4)."""
  s = _settings("deepseek_v32")
  assert (s.kl.name, s.kl.beta, s.correction.geo_high) == ("k3_is", 0.01, 2.0)
  mask = jnp.ones((2, 2), jnp.float32)
  old = jnp.full((2, 2), -1.0)
  mu = old - jnp.array([[0.0], [1.0]])  # row 1: geometric ratio e > 2 -> rejected
  ref = old + jnp.array([[0.5], [1.0]])
  adv = jnp.array([1.0, -1.0])
  logits = jnp.zeros((2, 2, 3))
  f = lambda lp: _loss(s, lp, logits, old, mu, adv, mask, ref)[0]  # noqa: E731
  value, grad = jax.value_and_grad(f)(old)
  # Row 0 (ratio 1, advantage 1, k3 = e^0.5 − 0.5 − 1 a token): the policy term is the token
  # mean over all 4 tokens, −2/4; the KL term β·k3 is averaged over row 0's 2 kept tokens.
  k3 = np.exp(0.5) - 1.5
  np.testing.assert_allclose(value, -2 / 4 + 0.01 * k3, atol=1e-6)
  # d/dℓ of ρ·k3 with ρ = e^(ℓ − ℓ^μ) = 1 here: k3 + (1 − e^0.5) = −0.5 a token, / 2 tokens.
  g = -1 / 4 + 0.01 * (k3 + 1 - np.exp(0.5)) / 2
  np.testing.assert_allclose(grad, [[g, g], [0.0, 0.0]], atol=1e-6)
  _, m = _loss(s, old, logits, old, mu, adv, mask, ref)
  np.testing.assert_allclose(m["kl/loss"], np.exp(0.5) - 1.5, atol=1e-6)  # row 0 only


def test_rejected_tokens_leave_the_entropy_term_cispo():
  """Issue reproduction: cispo, entropy 0.01, geo-mask ≤ 2, T = 1, row 1 rejected (§3, §8)."""
  s = _settings(
    "cispo", **{"correction.name": "geo_mask", "correction.geo_high": 2.0, "rl.entropy_coef": 0.01}
  )
  mask = jnp.ones((2, 1), jnp.float32)
  old = jnp.full((2, 1), -1.0)
  mu = old - jnp.array([[0.0], [1.0]])
  adv = jnp.array([1.0, -1.0])
  logits = jnp.array([[[0.0, 0.0, 0.0]], [[3.0, 0.0, 0.0]]])
  f = lambda lg: _loss(s, old, lg, old, mu, adv, mask)[0]  # noqa: E731
  value, grad = jax.value_and_grad(f)(logits)
  np.testing.assert_allclose(value, 0.5 - 0.01 * np.log(3.0), atol=1e-5)  # 0.489014
  np.testing.assert_array_equal(np.asarray(grad)[1], 0.0)  # nothing reaches the rejected row


def test_no_rejection_leaves_every_term_on_the_plain_mask():
  s = _settings("grpo", **{"rl.entropy_coef": 0.01})
  rng = np.random.default_rng(0)
  mask = jnp.asarray(np.array([[1, 1, 0], [1, 0, 0]], np.float32))
  logits = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
  lp = jax.nn.log_softmax(logits)[..., 0]
  _, m = _loss(s, lp, logits, lp, lp, jnp.array([1.0, -1.0]), mask, lp - 0.3)
  h = -(jax.nn.softmax(logits) * jax.nn.log_softmax(logits)).sum(-1)
  np.testing.assert_allclose(m["policy/entropy"], (h * mask).sum() / mask.sum(), rtol=1e-5)
  k3 = np.exp(-0.3) + 0.3 - 1
  np.testing.assert_allclose(m["kl/loss"], k3, rtol=1e-5)


@pytest.mark.parametrize("objective", ["gspo", "gmpo"])
@pytest.mark.parametrize("correction", ["tis_token", "mis_token"])
def test_a_per_token_correction_weights_a_sequence_objective_by_its_masked_mean(
  objective, correction
):
  """§3: for gspo / gmpo / rspo the sequence weight is the masked mean of w over o_i."""
  s = _settings(objective, **{"correction.name": correction, "correction.cap": 1.5})
  rng = np.random.default_rng(1)
  mask = jnp.asarray(np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32))
  old = jnp.asarray(rng.normal(-1.0, 0.3, (3, 4)), jnp.float32)
  mu = old - jnp.asarray(rng.uniform(-0.3, 0.3, (3, 4)), jnp.float32)
  mu = mu.at[0, 1].set(old[0, 1] - 1.0)  # ρ = e > C: truncated (tis) or rejected (mis)
  lp = old + jnp.asarray(rng.normal(0, 0.1, (3, 4)), jnp.float32)
  adv = jnp.array([1.0, -0.5, 2.0])
  logits = jnp.zeros((3, 4, 2))
  loss, _ = _loss(s, lp, logits, old, mu, adv, mask)
  w, _ = stages.behaviour_weight(old, mu, mask, s.correction)
  if correction == "mis_token":
    assert float((np.asarray(w) * np.asarray(mask) == 0).sum()) > float(
      (np.asarray(mask) == 0).sum()
    )
  w_seq = (np.asarray(w) * np.asarray(mask)).sum(-1) / np.asarray(mask).sum(-1)
  spec = s.objective.spec
  j, _ = spec.fn(lp, old, adv, mask, **s.objective.hyperparameters)
  np.testing.assert_allclose(loss, -np.mean(w_seq * np.asarray(j)), rtol=1e-5)
