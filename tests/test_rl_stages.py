"""The learner's stages on small hand-made arrays (no model is built)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm.config import default_config, parse
from jaxrl_llm.rl import Settings, init_reference, stages, update
from jaxrl_llm.rl import metrics as rl_metrics
from jaxrl_llm.sampling import Scores
from jaxrl_llm.types import Rollout, TrainState

G, T = 2, 4


def _settings(**overrides) -> Settings:
  c = default_config()
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  return parse(c).learner


def _rollout(lengths, truncated=None) -> Rollout:
  lengths = np.asarray(lengths, np.int32)
  b = len(lengths)
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  return Rollout(
    prompt_tokens=jnp.arange(b * 3, dtype=jnp.int32).reshape(b, 3),
    prompt_mask=jnp.ones((b, 3), bool),
    tokens=jnp.arange(b * T, dtype=jnp.int32).reshape(b, T),
    loss_mask=jnp.asarray(mask),
    lengths=jnp.asarray(lengths),
    truncated=jnp.asarray(truncated if truncated is not None else lengths == T),
    logprobs=jnp.asarray(-mask),
    decode_steps=jnp.int32(T),
  )


def test_total_reward_weights_terms_and_adds_the_soft_overlong_term():
  r = _rollout([1, 3, 4, 2])  # T = 4, cache 2: lengths 3 -> -0.5, 4 (truncated) -> -1
  terms = {"correct": jnp.array([1.0, 0.0, 1.0, 1.0]), "format": jnp.array([1.0, 1.0, 0.0, 0.0])}
  s = _settings(**{"shaping.name": "soft_overlong", "shaping.cache_len": 2, "shaping.weight": 0.5})
  weights = (("correct", 1.0), ("format", 0.25))
  reward, out = stages.total_reward(r, terms, s.shaping, weights, T)
  np.testing.assert_allclose(out["overlong"], [0.0, -0.5, -1.0, 0.0])
  np.testing.assert_allclose(reward, [1.25, 0.25 - 0.25, 1.0 - 0.5, 1.0])
  reward, out = stages.total_reward(r, terms, _settings().shaping, (("correct", 1.0),), T)
  assert "overlong" not in out and reward.dtype == jnp.float32
  np.testing.assert_allclose(reward, terms["correct"])


def test_filter_groups_dynamic_sampling_gathers_groups_with_spread():
  r = _rollout([1, 2, 3, 4, 1, 2])  # 3 groups of G = 2
  reward = jnp.array([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # group 0 has no spread
  s = _settings(**{"filtering.name": "dynamic_sampling"})
  out, rew, terms, valid, m = stages.filter_groups(
    r, reward, {"correct": reward}, s.filtering, G, 2
  )
  np.testing.assert_array_equal(out.lengths, [3, 4, 1, 2])  # groups 1 and 2, in order
  np.testing.assert_array_equal(rew, [0.0, 1.0, 0.0, 1.0])
  np.testing.assert_array_equal(terms["correct"], rew)
  assert valid.all() and float(m["filter/fill_frac"]) == 1.0


def test_filter_groups_reinforce_rej_keeps_shapes_and_marks_zero_spread_groups():
  r = _rollout([1, 2, 3, 4])
  reward = jnp.array([1.0, 1.0, 0.0, 1.0])
  s = _settings(**{"filtering.name": "reinforce_rej"})
  out, _, _, valid, m = stages.filter_groups(r, reward, {}, s.filtering, G, 2)
  assert out is r
  np.testing.assert_array_equal(valid, [False, False, True, True])
  assert float(m["filter/zero_std_frac"]) == 0.5
  _, _, _, valid, m = stages.filter_groups(r, reward, {}, _settings().filtering, G, 2)
  assert valid.all() and m == {}


def test_loss_mask_drops_filtered_groups_and_truncated_completions():
  r = _rollout([1, 4, 2, 4])
  valid = jnp.array([True, True, False, False])
  m = stages.loss_mask(r, valid, _settings().shaping)
  np.testing.assert_array_equal(m.sum(-1), [1, 4, 0, 0])
  m = stages.loss_mask(r, valid, _settings(**{"shaping.overlong_filter": True}).shaping)
  np.testing.assert_array_equal(m.sum(-1), [1, 0, 0, 0])


def test_stats_rows_drop_truncated_completions_only_when_configured():
  r = _rollout([1, 4, 2, 4])  # rows 1 and 3 truncated
  valid = jnp.array([True, True, True, False])
  keep = stages.stats_rows(r, valid, _settings(**{"shaping.overlong_filter": True}).shaping)
  np.testing.assert_array_equal(keep, [True, True, True, False])  # default: stay in the stats
  s = _settings(**{"shaping.overlong_filter": True, "shaping.overlong_in_group_stats": False})
  np.testing.assert_array_equal(stages.stats_rows(r, valid, s.shaping), [True, False, True, False])
  s = _settings(**{"shaping.overlong_in_group_stats": False})  # no overlong filtering: no-op
  np.testing.assert_array_equal(stages.stats_rows(r, valid, s.shaping), valid)
  # The advantage of the kept row of group 0 then ignores the truncated one.
  reward = jnp.array([1.0, 0.0, 0.0, 1.0])
  s = _settings(**{"advantage.name": "mean_only", "shaping.overlong_filter": True})
  s2 = _settings(
    **{
      "advantage.name": "mean_only",
      "shaping.overlong_filter": True,
      "shaping.overlong_in_group_stats": False,
    }
  )
  mask = stages.loss_mask(r, jnp.ones(4, bool), s.shaping)
  adv, _ = stages.advantages(
    reward,
    r,
    mask,
    stages.stats_rows(r, jnp.ones(4, bool), s.shaping),
    None,
    None,
    s.advantage,
    s.kl,
    G,
  )
  np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5])
  adv, _ = stages.advantages(
    reward,
    r,
    mask,
    stages.stats_rows(r, jnp.ones(4, bool), s2.shaping),
    None,
    None,
    s2.advantage,
    s2.kl,
    G,
  )
  np.testing.assert_allclose(adv, [0.0, 0.0, 0.0, 0.0])


def test_advantages_group_relative_with_kl_in_the_reward():
  r = _rollout([2, 2, 1, 3])
  mask = r.loss_mask
  reward = jnp.array([1.0, 0.0, 0.5, 0.5])
  kl_tok = jnp.full((4, T), 0.1)
  s = _settings(**{"advantage.name": "mean_only", "kl.beta": 2.0, "kl.placement": "reward"})
  adv, returns = stages.advantages(
    reward, r, mask, jnp.ones(4, bool), None, kl_tok, s.advantage, s.kl, G
  )
  assert returns is None
  shaped = np.array([1.0, 0.0, 0.5, 0.5]) - 2.0 * 0.1 * np.array([2, 2, 1, 3])
  want = shaped - np.repeat(shaped.reshape(2, 2).mean(1), 2)
  np.testing.assert_allclose(adv, want, rtol=1e-6)
  s = _settings(**{"advantage.name": "mean_only", "kl.beta": 2.0})  # KL in the loss: R unchanged
  adv, _ = stages.advantages(reward, r, mask, jnp.ones(4, bool), None, kl_tok, s.advantage, s.kl, G)
  np.testing.assert_allclose(adv, [0.5, -0.5, 0.0, 0.0])


def test_advantages_gae_puts_the_reward_on_the_last_token_and_whitens():
  r = _rollout([2, 3, 1, 4])
  reward = jnp.array([1.0, -1.0, 0.5, 2.0])
  values = jnp.zeros((4, T))
  s = _settings(**{"advantage.name": "gae", "advantage.gamma": 1.0, "advantage.lam": 1.0})
  adv, returns = stages.advantages(
    reward, r, r.loss_mask, jnp.ones(4, bool), values, None, s.advantage, s.kl, G
  )
  # γ = λ = 1, V = 0: every token's advantage is the sequence reward.
  np.testing.assert_allclose(adv, r.loss_mask * reward[:, None])
  np.testing.assert_allclose(returns, adv)
  s = _settings(**{"advantage.name": "grpo", "advantage.whiten": True})
  adv, _ = stages.advantages(
    reward, r, r.loss_mask, jnp.ones(4, bool), None, None, s.advantage, s.kl, G
  )
  assert abs(float(adv.mean())) < 1e-6 and abs(float(adv.std()) - 1.0) < 1e-4


def test_terminal_rewards_one_hot_on_the_last_generated_token():
  out = stages.terminal_rewards(jnp.array([2.0, 3.0]), jnp.array([1, 4]), T)
  np.testing.assert_array_equal(out, [[2, 0, 0, 0], [0, 0, 0, 3]])


def test_policy_batch_fields_are_none_when_unused():
  r = _rollout([1, 2, 3, 4])
  old = Scores(logp=jnp.zeros((4, T)), entropy=jnp.zeros((4, T)), values=jnp.ones((4, T)))
  kw = dict(returns=None, replay="none", ref_logp=None)
  b = stages.policy_batch(r, r.loss_mask, old, jnp.ones(4), jnp.ones((4, T)), **kw)
  assert b.ref_logp is None and b.old_values is None and b.replay is None
  assert len(jax.tree.leaves(b)) == 7
  b = stages.policy_batch(
    r, r.loss_mask, old, jnp.ones(4), jnp.ones((4, T)), **{**kw, "returns": old.logp}
  )
  assert b.old_values is old.values
  # Minibatching is a tree map over rows.
  part = jax.tree.map(lambda x: x[jnp.array([3, 0])], b)
  np.testing.assert_array_equal(part.tokens, r.tokens[jnp.array([3, 0])])


def test_behaviour_weight_uses_the_configured_correction():
  old = jnp.zeros((2, T))
  beh = jnp.full((2, T), -1.0)  # ρ = e on every token
  mask = jnp.ones((2, T))
  w, m = stages.behaviour_weight(
    old, beh, mask, _settings(**{"correction.name": "tis_token"}).correction
  )
  np.testing.assert_allclose(w, 2.0)  # capped at C = 2
  assert float(m["behaviour/frac_truncated"]) == 1.0


def test_minibatch_order_is_one_permutation_per_epoch():
  rl = _settings(**{"rl.num_epochs": 3, "rl.num_minibatches": 2}).rl
  order = np.asarray(update.minibatch_order(jax.random.PRNGKey(0), 8, rl))
  assert order.shape == (6, 4)
  for epoch in order.reshape(3, 8):
    assert sorted(epoch) == list(range(8))


def test_microbatch_metrics_sum_losses_and_average_the_rest():
  stacked = {"policy/loss": jnp.array([1.0, 2.0]), "policy/entropy": jnp.array([1.0, 3.0])}
  out = rl_metrics.microbatch_mean(stacked, 2)
  assert float(out["policy/loss"]) == 3.0 and float(out["policy/entropy"]) == 2.0
  split = update.split_leading({"x": jnp.arange(12).reshape(6, 2)}, 3)
  assert split["x"].shape == (3, 2, 2)
  np.testing.assert_array_equal(split["x"][0], [[0, 1], [6, 7]])  # rows 0 and 3: strided


def test_a_slice_that_trained_no_token_does_not_count_as_zero():
  """Token means are weighted by the tokens of their slices: a microbatch or minibatch that
  dynamic sampling or the overlong filter left empty (its masked means 0) halved the step's
  entropy and set ratio_min = ratio_max = 0.5; with no token at all they are NaN, not 0."""
  T, K = rl_metrics.TOKENS, rl_metrics.KEPT
  micro = {
    "policy/loss": jnp.array([1.0, 0.0]),
    "policy/entropy": jnp.array([3.0, 0.0]),
    "policy/ratio_min": jnp.array([0.9, 0.0]),
    "policy/ratio_max": jnp.array([1.1, 0.0]),
    "policy/clip_frac_low": jnp.array([0.25, 0.0]),
    "policy/clip_frac_high": jnp.array([0.5, 0.0]),
    T: jnp.array([6.0, 0.0]),
    K: jnp.array([4.0, 0.0]),
  }
  mb = rl_metrics.microbatch_mean(micro, 2)
  assert float(mb["policy/loss"]) == 1.0 and float(mb["policy/entropy"]) == 3.0
  assert (float(mb["policy/ratio_min"]), float(mb["policy/ratio_max"])) == (
    pytest.approx(0.9),
    pytest.approx(1.1),
  )
  empty = jax.tree.map(jnp.zeros_like, mb)
  other = {**mb, "policy/entropy": jnp.float32(1.0), "policy/clip_frac_low": jnp.float32(0.0)}
  other |= {T: jnp.float32(2.0), K: jnp.float32(12.0)}
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), mb, empty, other)
  out = rl_metrics.update_summary({**stacked, "optim/skipped_updates": jnp.zeros(3)})
  assert float(out["policy/entropy"]) == pytest.approx((3.0 * 4 + 1.0 * 12) / 16)  # over m'
  assert float(out["policy/clip_frac_low"]) == pytest.approx(0.25 * 6 / 8)  # over m
  assert float(out["policy/ratio_min"]) == pytest.approx(0.9)
  assert rl_metrics.TOKENS not in out and rl_metrics.KEPT not in out
  none = rl_metrics.update_summary(
    {**jax.tree.map(lambda x: x[1:2], stacked), "optim/skipped_updates": jnp.zeros(1)}
  )
  assert np.isnan(float(none["policy/entropy"])) and np.isnan(float(none["policy/ratio_max"]))
  assert float(none["policy/loss"]) == 0.0  # the loss of no token is 0


def test_auto_microbatches_and_remat_are_resolved_from_the_shape():
  rl = _settings(**{"rl.microbatch_tokens": 1000}).rl
  assert (rl.num_microbatches, rl.remat) == (0, "auto")
  r = rl.resolved(rows_per_device=64, seq_len=100, num_params=10_000)
  assert (r.num_microbatches, r.remat) == (8, "none")  # 8 rows x 100 tokens <= 1000
  r = rl.resolved(rows_per_device=6, seq_len=400, num_params=2 * 10**8)
  assert (r.num_microbatches, r.remat) == (3, "full")  # 2 rows x 400 tokens
  r = rl.resolved(rows_per_device=6, seq_len=2000, num_params=1)
  assert r.num_microbatches == 6  # one row per slice even past the budget
  explicit = _settings(**{"rl.num_microbatches": 2, "rl.remat": "dots_saveable"}).rl
  assert explicit.resolved(rows_per_device=64, seq_len=100, num_params=1) == explicit


def _state(step: int = 0):
  params = {"w": jnp.ones(3)}
  tx = optax.adam(1.0)
  state = TrainState(
    step=jnp.int32(step),
    params=params,
    opt_state=tx.init(params),
    ref_params=None,
    rng=jax.random.PRNGKey(0),
  )
  return state, tx


def test_reference_policy_init_frozen_ema_and_reset():
  state, tx = _state()
  assert init_reference(state, 0.0).ref_params is None
  state = init_reference(state, 0.1)
  np.testing.assert_array_equal(state.ref_params["w"], 1.0)
  new = {"w": jnp.full(3, 3.0)}
  kl = _settings().kl
  ref, _ = update.update_reference(state, new, state.opt_state, kl=kl, optimizer=tx)
  np.testing.assert_array_equal(ref["w"], 1.0)  # frozen
  kl = dataclasses.replace(kl, reference="ema", ema=0.25)
  ref, _ = update.update_reference(state, new, state.opt_state, kl=kl, optimizer=tx)
  np.testing.assert_allclose(ref["w"], 0.25 * 3 + 0.75 * 1)
  kl = dataclasses.replace(kl, reference="reset_every", reset_every=2, reset_optimizer=True)
  moved = tx.update(new, state.opt_state)[1]  # an optimiser state after one update
  for step, resets in ((0, False), (1, True)):
    s = state.replace(step=jnp.int32(step))
    ref, opt = update.update_reference(s, new, moved, kl=kl, optimizer=tx)
    np.testing.assert_array_equal(ref["w"], 3.0 if resets else 1.0)
    fresh = jax.tree.leaves(tx.init(new))
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(opt), fresh))
    assert same == resets


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_init_reference_is_idempotent(beta):
  state, _ = _state()
  once = init_reference(state, beta)
  assert init_reference(once, beta) is once
