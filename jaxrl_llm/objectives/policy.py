"""Policy surrogates J to maximise (objectives.md §2).

Every objective takes (logp, old_logp, adv, mask): ℓ [B, T] (differentiable), ℓ^old [B, T]
(stop-gradient), advantages [B] or [B, T] (a [B] advantage is broadcast over T) and the loss
mask [B, T] (bool or float). It returns (J, diagnostics): J is [B, T] for token objectives and
[B] for sequence objectives (`gspo`, `gmpo`, `rspo`), 0 on masked tokens / empty sequences.

The diagnostics are stop-gradient float32 arrays that metrics reduce over the mask:
  ratio            [B, T]  r = exp(Δ), Δ = ℓ − ℓ^old (clamped to ±20; 1 on padding)
  log_ratio        [B, T]  Δ (0 on padding)
  is_clipped_low   [B, T]  1 where the surrogate is clipped with r below 1 − ε_low and A < 0
  is_clipped_high  [B, T]  1 where the surrogate is clipped with r above 1 + ε_high and A > 0
plus objective-specific entries (seq_ratio [B], is_weight, gate_weight, is_dual_clipped).
For sequence objectives the clip flags are the sequence's flag broadcast over its tokens.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.objectives._common import (
  LOG_CLAMP,
  broadcast_adv,
  check_float,
  check_mask,
  masked_log_ratio,
  seq_adv,
)
from jaxrl_llm.objectives.registry import in_range, register_objective

sg = jax.lax.stop_gradient


def _prepare(logp, old_logp, mask):
  """Checks ℓ, ℓ^old, mask; returns (float mask, Δ [B, T])."""
  chex.assert_rank([logp, old_logp], 2)
  check_float(logp, old_logp)
  m = check_mask(mask, 2)
  chex.assert_equal_shape([logp, old_logp, m])
  return m, masked_log_ratio(logp, sg(old_logp), m)


def _diag(delta, m, low, high, **extra):
  out = {
    "ratio": jnp.exp(delta),
    "log_ratio": delta,
    "is_clipped_low": (low & (m > 0)).astype(jnp.float32),
    "is_clipped_high": (high & (m > 0)).astype(jnp.float32),
  }
  out.update(extra)
  return {k: sg(v.astype(jnp.float32)) for k, v in out.items()}


def _no_clip(m):
  return jnp.zeros(m.shape, bool)


def _seq_mean_log(x: jax.Array, m: jax.Array) -> jax.Array:
  """(1/|o_i|) Σ_t m x per sequence, clamped to ±LOG_CLAMP; 0 for empty sequences."""
  mean = jnp.where(m > 0, x, 0.0).sum(-1) / jnp.maximum(m.sum(-1), 1.0)
  return jnp.clip(mean, -LOG_CLAMP, LOG_CLAMP)


def _errors(*messages):
  return [m for m in messages if m]


def check_clip(h) -> list[str]:
  """Range checks of ε_low, ε_high in (0, 1) and of an optional dual clip c > 1."""
  dual = h.get("dual_clip")
  return _errors(
    in_range("clip_low", h["clip_low"], 0.0, 1.0),
    in_range("clip_high", h["clip_high"], 0.0, 1.0),
    f"objective.dual_clip={dual} must be > 1 (unset or 0 = off)" if dual and dual <= 1 else None,
  )


def _clipped(r: jax.Array, a: jax.Array, clip_low: float, clip_high: float):
  """min(r A, clip(r, 1−ε_low, 1+ε_high) A) and its low / high clip flags (§2.1, §2.3, §2.4)."""
  j = jnp.minimum(r * a, jnp.clip(r, 1.0 - clip_low, 1.0 + clip_high) * a)
  return j, (r < 1.0 - clip_low) & (a < 0), (r > 1.0 + clip_high) & (a > 0)


@register_objective(
  "ppo_clip",
  check=check_clip,
  docs={
    "clip_low": "ε_low: the ratio is clipped below at 1 − ε_low",
    "clip_high": "ε_high: the ratio is clipped above at 1 + ε_high (clip-higher: > ε_low)",
    "dual_clip": "dual-clip c > 1 bounding the loss for A < 0 (unset = off)",
  },
)
def ppo_clip(
  logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array, *,
  clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:  # fmt: skip
  """PPO/GRPO clipped surrogate min(rA, clip(r, 1−ε_low, 1+ε_high)A) (objectives.md §2.1).

  ε_high > ε_low is DAPO's clip-higher. dual_clip = c > 1 bounds J below by c·A where A < 0
  (None or 0: off).
  """
  m, delta = _prepare(logp, old_logp, mask)
  a = broadcast_adv(adv, m)
  j, low, high = _clipped(jnp.exp(delta), a, clip_low, clip_high)
  extra = {}
  if dual_clip:  # None or 0: off
    if dual_clip <= 1.0:
      raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    dual = (a < 0) & (j < dual_clip * a)
    j = jnp.where(a < 0, jnp.maximum(j, dual_clip * a), j)
    extra["is_dual_clipped"] = (dual & (m > 0)).astype(jnp.float32)
  j = jnp.where(m > 0, j, 0.0)
  return j, _diag(delta, m, low, high, **extra)


@register_objective("pg")
def pg(
  logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Unclipped importance-weighted policy gradient J = r·A (objectives.md §2.2)."""
  m, delta = _prepare(logp, old_logp, mask)
  a = broadcast_adv(adv, m)
  j = jnp.where(m > 0, jnp.exp(delta) * a, 0.0)
  return j, _diag(delta, m, _no_clip(m), _no_clip(m))


@register_objective("gspo", check=check_clip)
def gspo(
  logp: jax.Array,
  old_logp: jax.Array,
  adv: jax.Array,  # [B] (a [B, T] advantage is reduced to its masked mean)
  mask: jax.Array,
  *,
  clip_low: float = 3e-4,
  clip_high: float = 4e-4,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GSPO sequence surrogate min(s A, clip(s) A), s = exp(mean_t Δ) (objectives.md §2.3).

  Returns J [B] (0 for empty sequences); a [B, T] advantage is reduced to its masked mean.
  """
  m, delta = _prepare(logp, old_logp, mask)
  a = seq_adv(adv, m)
  s = jnp.exp(_seq_mean_log(delta, m))
  j, low, high = _clipped(s, a, clip_low, clip_high)
  j = jnp.where(m.sum(-1) > 0, j, 0.0)
  return j, _diag(delta, m, low[:, None], high[:, None], seq_ratio=s)


@register_objective("gspo_token", check=check_clip)
def gspo_token(
  logp: jax.Array,
  old_logp: jax.Array,
  adv: jax.Array,  # [B] or token-level [B, T]
  mask: jax.Array,
  *,
  clip_low: float = 3e-4,
  clip_high: float = 4e-4,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GSPO-token surrogate with s_{i,t} = sg[s_i]·exp(ℓ − sg[ℓ]) (objectives.md §2.4).

  Token-level advantages allowed; aggregate with `seq_mean_token_mean` to match §2.3.
  """
  m, delta = _prepare(logp, old_logp, mask)
  a = broadcast_adv(adv, m)
  s_seq = sg(jnp.exp(_seq_mean_log(delta, m)))
  lp = logp.astype(jnp.float32)
  s = s_seq[:, None] * jnp.exp(jnp.where(m > 0, lp - sg(lp), 0.0))
  j, low, high = _clipped(s, a, clip_low, clip_high)
  j = jnp.where(m > 0, j, 0.0)
  return j, _diag(delta, m, low, high, seq_ratio=s_seq)


@register_objective(
  "gmpo",
  check=lambda h: _errors(in_range("clip_log", h["clip_log"], 0.0, float("inf"))),
  docs={"clip_log": "δ_c: log-space clip width of the geometric-mean ratio"},
)
def gmpo(
  logp: jax.Array,
  old_logp: jax.Array,
  adv: jax.Array,
  mask: jax.Array,
  *,
  clip_log: float = 0.4,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GMPO geometric-mean surrogate A_i·exp(mean_t c_{i,t}), log-space clip δ_c (§2.5).

  c = min(Δ, clip(Δ, −δ_c, δ_c)) if A_i > 0 else max(Δ, clip(Δ, −δ_c, δ_c)). Returns J [B];
  a [B, T] advantage is reduced to its masked mean.
  """
  m, delta = _prepare(logp, old_logp, mask)
  a = seq_adv(adv, m)
  clipped = jnp.clip(delta, -clip_log, clip_log)
  pos = (a > 0)[:, None]
  c = jnp.where(pos, jnp.minimum(delta, clipped), jnp.maximum(delta, clipped))
  j = a * jnp.exp(_seq_mean_log(c, m))
  j = jnp.where(m.sum(-1) > 0, j, 0.0)
  low = (delta < -clip_log) & (a < 0)[:, None]
  high = (delta > clip_log) & pos
  return j, _diag(delta, m, low, high, seq_ratio=jnp.exp(_seq_mean_log(delta, m)))


def router_shift_gamma(
  router_logp: jax.Array, old_router_logp: jax.Array, *, gamma_min: float = 0.1
) -> jax.Array:
  """RSPO router-shift weight γ [B, T] (objectives.md §2.8), stop-gradient.

  router_logp / old_router_logp: [B, T, L, K] log p^l(e^{l,k}) of the old policy's top-K experts
  under the current and the old router. γ = max(γ_min, exp(−mean_{l,k} |Δ log p|)): 1 when the
  router is unchanged, smaller where routing shifted, never below γ_min.
  """
  chex.assert_rank([router_logp, old_router_logp], 4)
  chex.assert_equal_shape([router_logp, old_router_logp])
  shift = jnp.mean(jnp.abs(router_logp - old_router_logp).astype(jnp.float32), axis=(-2, -1))
  return sg(jnp.maximum(gamma_min, jnp.exp(-shift)))


def _check_rspo(h) -> list[str]:
  return _errors(*check_clip(h), in_range("gamma_min", h["gamma_min"], 0.0, 1.0, high_open=False))


@register_objective(
  "rspo",
  inputs=("router_logp", "old_router_logp"),
  check=_check_rspo,
  docs={"gamma_min": "γ_min: floor of the router-shift weight"},
)
def rspo(
  logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array, *,
  router_logp: jax.Array, old_router_logp: jax.Array,
  clip_low: float = 0.2, clip_high: float = 0.2, gamma_min: float = 0.1,
) -> tuple[jax.Array, dict[str, jax.Array]]:  # fmt: skip
  """RSPO router-shift-aware sequence surrogate J_i = S_i·A_i (objectives.md §2.8).

  W = min(r^{sgn A}, clip(r^{sgn A}, 1 − ε_low, 1 + ε_high)), S_i = (Π_t W γ)^{sgn(A_i)/|o_i|}
  computed in log space, γ = `router_shift_gamma(router_logp, old_router_logp, gamma_min)`
  [B, T] (stop-gradient) from the router log-probs [B, T, Lm, K] of the old policy's experts at
  each token's logits position. Returns J [B]; a [B, T] advantage is reduced to its masked mean.
  """
  m, delta = _prepare(logp, old_logp, mask)
  router_gamma = router_shift_gamma(router_logp, old_router_logp, gamma_min=gamma_min)
  chex.assert_equal_shape([router_gamma, m])
  a = seq_adv(adv, m)
  sgn = jnp.sign(a)[:, None]
  x = sgn * delta  # log r^{sgn A}
  no_floor = clip_low >= 1  # ε_low >= 1: no lower clip (may be a per-run traced value)
  lo = jnp.where(no_floor, -LOG_CLAMP, jnp.log1p(-jnp.where(no_floor, 0.0, clip_low)))
  hi = jnp.log1p(clip_high)
  log_w = jnp.minimum(x, jnp.clip(x, lo, hi))
  log_gamma = jnp.log(jnp.where(m > 0, router_gamma, 1.0))
  s_log = jnp.sign(a) * _seq_mean_log(log_w + log_gamma, m)
  j = jnp.where(m.sum(-1) > 0, a * jnp.exp(s_log), 0.0)
  low = (x < lo) & (sgn < 0)
  high = (x > hi) & (sgn > 0)
  return j, _diag(
    delta, m, low, high, seq_ratio=jnp.exp(s_log), router_gamma=jnp.where(m > 0, router_gamma, 0.0)
  )


def _check_cispo(h) -> list[str]:
  return _errors(
    in_range("is_clip_low", h["is_clip_low"], 0.0, 1.0, high_open=False),
    in_range("is_clip_high", h["is_clip_high"], 0.0, float("inf")),
    in_range("clip_low", h["clip_low"], 0.0, 1.0, high_open=False),
    in_range("clip_high", h["clip_high"], 0.0, float("inf")),
  )


_CISPO_DOCS = {
  "is_clip_low": "ε^IS_low of CISPO's clipped IS weight (1.0 = no floor)",
  "is_clip_high": "ε^IS_high of CISPO's clipped IS weight",
  "cispo_mask": "drop tokens outside CISPO's token-mask widths clip_low / clip_high",
}


@register_objective("cispo", check=_check_cispo, docs=_CISPO_DOCS)
def cispo(
  logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array, *,
  is_clip_low: float = 1.0, is_clip_high: float = 0.28, clip_low: float = 0.2,
  clip_high: float = 0.28, cispo_mask: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:  # fmt: skip
  """CISPO: J = sg[clip(r, 1−ε^IS_low, 1+ε^IS_high)]·A·ℓ, every token keeps its gradient (§2.6).

  Two pairs of widths, as in the spec: ε^IS clips the importance weight (default ε^IS_low = 1,
  no lower bound, and ε^IS_high = 0.28: MiniMax-M1 tunes only the upper one); ε_low / ε_high
  (0.2 / 0.28) define the unified token mask, which drops tokens with A > 0 ∧ r > 1+ε_high or
  A < 0 ∧ r < 1−ε_low when cispo_mask=True. The clip-fraction metrics count those tokens
  (§11), whether or not they are dropped.
  """
  m, delta = _prepare(logp, old_logp, mask)
  a = broadcast_adv(adv, m)
  r = jnp.exp(delta)
  w = sg(jnp.clip(r, 1.0 - is_clip_low, 1.0 + is_clip_high))
  lp = jnp.where(m > 0, logp.astype(jnp.float32), 0.0)
  j = w * a * lp
  low = (r < 1.0 - clip_low) & (a < 0)
  high = (r > 1.0 + clip_high) & (a > 0)
  if cispo_mask:
    j = jnp.where(low | high, 0.0, j)
  j = jnp.where(m > 0, j, 0.0)
  return j, _diag(delta, m, low, high, is_weight=jnp.where(m > 0, w, 0.0))


MIN_SAPO_TAU = 0.01  # SAPO's temperature floor: its loss scales as 4/τ


def _sapo_tau(name: str, value: float) -> str | None:
  """An error message if SAPO's temperature `name` is below `MIN_SAPO_TAU`."""
  if value >= MIN_SAPO_TAU:
    return None
  return (
    f"objective.{name}={value} must be >= {MIN_SAPO_TAU} (the loss scales as 4/τ: below the "
    "floor it swamps float32, and at 1e-38 it is inf with NaN gradients)"
  )


@register_objective(
  "sapo",
  check=lambda h: _errors(_sapo_tau("tau_pos", h["tau_pos"]), _sapo_tau("tau_neg", h["tau_neg"])),
  docs={
    "tau_pos": "soft-gate temperature of SAPO for A > 0 (>= 0.01)",
    "tau_neg": "soft-gate temperature of SAPO for A <= 0 (>= 0.01)",
  },
)
def sapo(
  logp: jax.Array,
  old_logp: jax.Array,
  adv: jax.Array,
  mask: jax.Array,
  *,
  tau_pos: float = 1.0,
  tau_neg: float = 1.05,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """SAPO soft gate J = (4/τ)·σ(τ(r − 1))·A, τ = τ_pos if A > 0 else τ_neg (§2.7).

  Gradient weight dJ/dr / A = sech²(τ(r − 1)/2), reported as `gate_weight`.
  """
  m, delta = _prepare(logp, old_logp, mask)
  a = broadcast_adv(adv, m)
  r = jnp.exp(delta)
  tau = jnp.where(a > 0, tau_pos, tau_neg)
  gate = jax.nn.sigmoid(tau * (r - 1.0))
  j = jnp.where(m > 0, (4.0 / tau) * gate * a, 0.0)
  weight = jnp.where(m > 0, 4.0 * gate * (1.0 - gate), 0.0)
  return j, _diag(delta, m, _no_clip(m), _no_clip(m), gate_weight=weight)


# PPO with a critic (§2.9): the §2.1 surrogate for the policy; the value loss is added by the
# learner whenever the policy has a value head (the config check ties the head to this name).
register_objective("ppo_critic", check=check_clip)(ppo_clip)


def value_loss(
  values: jax.Array,
  old_values: jax.Array,
  returns: jax.Array,
  mask: jax.Array,
  clip_value: float | None,
) -> jax.Array:
  """Clipped critic loss ½·max((V − G)², (clip(V, V_old ± ε_v) − G)²) per token (§2.9).

  clip_value None gives the unclipped ½(V − G)². Returns [B, T], 0 on masked positions.
  """
  chex.assert_rank([values, old_values, returns], 2)
  check_float(values, old_values, returns)
  m = check_mask(mask, 2)
  chex.assert_equal_shape([values, old_values, returns, m])
  v = jnp.where(m > 0, values.astype(jnp.float32), 0.0)
  v_old = jnp.where(m > 0, sg(old_values).astype(jnp.float32), 0.0)
  g = jnp.where(m > 0, sg(returns).astype(jnp.float32), 0.0)
  loss = (v - g) ** 2
  if clip_value is not None:
    v_clip = jnp.clip(v, v_old - clip_value, v_old + clip_value)
    loss = jnp.maximum(loss, (v_clip - g) ** 2)
  return jnp.where(m > 0, 0.5 * loss, 0.0)
