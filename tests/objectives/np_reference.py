"""NumPy float64 references written from the formulas of objectives.md, plus test inputs.

Stop-gradients are modelled the way the spec defines them: sg[x] is x evaluated at the base
point and held constant, so a central finite difference of a reference built that way is the
reference gradient.
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------------------------
# inputs


def ragged_batch(seed: int, lengths=(7, 3, 5, 1, 0, 6), t: int = 7, scale: float = 0.3):
  """ℓ, ℓ^old, A [B], mask [B, T] bool with ragged lengths (one empty row); float64."""
  rng = np.random.default_rng(seed)
  lengths = np.asarray(lengths)
  b = len(lengths)
  mask = np.arange(t)[None, :] < lengths[:, None]
  old = -rng.uniform(0.05, 3.0, (b, t))
  logp = old + scale * rng.normal(size=(b, t))
  adv = rng.normal(size=b)
  adv[0] = abs(adv[0]) + 0.1  # both signs present
  adv[1] = -abs(adv[1]) - 0.1
  return logp, old, adv, mask


def fd_grad(f, x: np.ndarray, where: np.ndarray | None = None, h: float = 1e-6) -> np.ndarray:
  """Central finite-difference gradient of scalar f at x (float64); 0 outside `where`."""
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  where = np.ones(x.shape, bool) if where is None else where
  for idx in zip(*np.nonzero(where)):
    e = np.zeros_like(x)
    e[idx] = h
    g[idx] = (f(x + e) - f(x - e)) / (2 * h)
  return g


# ---------------------------------------------------------------------------------------------
# §5 aggregation


def aggregate(loss: np.ndarray, mask: np.ndarray, mode: str, max_len: int | None = None) -> float:
  """§5 table, sequences with |o_i| = 0 dropped from B."""
  m = mask.astype(np.float64)
  lengths = m.sum(-1)
  keep = lengths > 0
  b = keep.sum()
  per_seq = (m * loss).sum(-1)
  if mode == "token_mean":
    return (m * loss).sum() / m.sum()
  if mode in ("seq_mean_token_mean", "seq_mean"):
    return (per_seq[keep] / lengths[keep]).sum() / b
  if mode == "seq_mean_token_sum":
    return per_seq[keep].sum() / b
  if mode == "seq_mean_token_sum_norm":
    lmax = max_len if max_len is not None else mask.shape[1]
    return per_seq[keep].sum() / lmax / b
  raise ValueError(mode)


# ---------------------------------------------------------------------------------------------
# §1 advantages


def group_stats(rewards: np.ndarray, g: int):
  r = rewards.reshape(-1, g)
  mean = r.mean(1, keepdims=True)
  std = r.std(1, ddof=1, keepdims=True)
  return r, mean, std


def adv_grpo(rewards, g, eps=1e-6):
  r, mean, std = group_stats(rewards, g)
  return ((r - mean) / (std + eps)).ravel()


def adv_mean_only(rewards, g):
  r, mean, _ = group_stats(rewards, g)
  return (r - mean).ravel()


def adv_rloo(rewards, g):
  r = rewards.reshape(-1, g)
  loo = (r.sum(1, keepdims=True) - r) / (g - 1)  # (1/(G−1)) Σ_{j≠i} R_j
  return (r - loo).ravel()


def adv_batch_std(rewards, g, valid=None, eps=1e-6):
  valid = np.ones(rewards.shape, bool) if valid is None else valid
  r, mean, _ = group_stats(rewards, g)
  std = rewards[valid].std(ddof=1)
  return np.where(valid, ((r - mean) / (std + eps)).ravel(), 0.0)


def adv_reinforce_baseline(rewards, g, valid=None):
  del g
  valid = np.ones(rewards.shape, bool) if valid is None else valid
  return np.where(valid, rewards - rewards[valid].mean(), 0.0)


def gae(rewards, values, mask, gamma, lam):
  """δ_t = r_t + γV_{t+1} − V_t (V = 0 after the last token), A_t = Σ_k (γλ)^k δ_{t+k}."""
  b, t = rewards.shape
  adv = np.zeros((b, t))
  for i in range(b):
    n = int(mask[i].sum())
    v = np.append(values[i, :n], 0.0)
    delta = rewards[i, :n] + gamma * v[1:] - v[:-1]
    for s in range(n):
      adv[i, s] = sum((gamma * lam) ** k * delta[s + k] for k in range(n - s))
  ret = np.where(mask, adv + values, 0.0)
  return adv, ret


# ---------------------------------------------------------------------------------------------
# §2 policy objectives (per-token J [B, T] or per-sequence J [B]); masked entries are 0


def _adv_tok(adv, mask):
  return np.broadcast_to(adv[:, None], mask.shape) if adv.ndim == 1 else adv


def j_ppo_clip(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None):
  a = _adv_tok(adv, mask)
  r = np.exp(logp - old)
  j = np.minimum(r * a, np.clip(r, 1 - clip_low, 1 + clip_high) * a)
  if dual_clip is not None:
    j = np.where(a < 0, np.maximum(j, dual_clip * a), j)
  return np.where(mask, j, 0.0)


def j_pg(logp, old, adv, mask):
  return np.where(mask, np.exp(logp - old) * _adv_tok(adv, mask), 0.0)


def seq_ratio(logp, old, mask):
  n = mask.sum(-1)
  return np.exp(np.where(mask, logp - old, 0.0).sum(-1) / np.maximum(n, 1))


def j_gspo(logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4):
  s = seq_ratio(logp, old, mask)
  j = np.minimum(s * adv, np.clip(s, 1 - clip_low, 1 + clip_high) * adv)
  return np.where(mask.sum(-1) > 0, j, 0.0)


def j_gspo_token(logp, old, adv, mask, base_logp, clip_low=3e-4, clip_high=4e-4):
  """s_{i,t} = sg[s_i]·exp(ℓ − sg[ℓ]); sg[·] held at base_logp."""
  a = _adv_tok(adv, mask)
  s = seq_ratio(base_logp, old, mask)[:, None] * np.exp(logp - base_logp)
  j = np.minimum(s * a, np.clip(s, 1 - clip_low, 1 + clip_high) * a)
  return np.where(mask, j, 0.0)


def j_gmpo(logp, old, adv, mask, clip_log=0.4):
  d = logp - old
  dc = np.clip(d, -clip_log, clip_log)
  c = np.where((adv > 0)[:, None], np.minimum(d, dc), np.maximum(d, dc))
  n = mask.sum(-1)
  j = adv * np.exp(np.where(mask, c, 0.0).sum(-1) / np.maximum(n, 1))
  return np.where(n > 0, j, 0.0)


def j_gmpo_closed_form(logp, old, adv, mask, clip_log=0.4):
  """sgn(A)·(Π_t |min(rA, clip(r, e^−δ, e^δ)A)|)^{1/|o|}."""
  out = np.zeros(len(adv))
  for i in range(len(adv)):
    n = int(mask[i].sum())
    if n == 0:
      continue
    r = np.exp(logp[i, :n] - old[i, :n])
    terms = np.minimum(r * adv[i], np.clip(r, np.exp(-clip_log), np.exp(clip_log)) * adv[i])
    out[i] = np.sign(adv[i]) * np.prod(np.abs(terms)) ** (1.0 / n)
  return out


def j_cispo(
  logp,
  old,
  adv,
  mask,
  base_logp,
  is_clip_low=1.0,
  is_clip_high=0.28,
  clip_low=0.2,
  clip_high=0.28,
  cispo_mask=False,
):
  """sg[clip(r, 1 - eps_IS_low, 1 + eps_IS_high)]·A·ℓ with sg held at base_logp; the optional
  token mask uses the other pair of widths (§2.6)."""
  a = _adv_tok(adv, mask)
  r0 = np.exp(base_logp - old)
  j = np.clip(r0, 1 - is_clip_low, 1 + is_clip_high) * a * logp
  if cispo_mask:
    drop = ((a > 0) & (r0 > 1 + clip_high)) | ((a < 0) & (r0 < 1 - clip_low))
    j = np.where(drop, 0.0, j)
  return np.where(mask, j, 0.0)


def j_sapo(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
  a = _adv_tok(adv, mask)
  r = np.exp(logp - old)
  tau = np.where(a > 0, tau_pos, tau_neg)
  j = 4.0 / tau / (1.0 + np.exp(-tau * (r - 1.0))) * a
  return np.where(mask, j, 0.0)


def value_loss(values, old_values, returns, mask, clip_value):
  v_clip = np.clip(values, old_values - clip_value, old_values + clip_value)
  loss = 0.5 * np.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
  return np.where(mask, loss, 0.0)


# ---------------------------------------------------------------------------------------------
# §3 corrections, §4 KL


def behaviour_weight(old, beh, mask, name, cap=2.0, geo_low=0.0, geo_high=None):
  d = np.where(mask, old - beh, 0.0)
  rho = np.exp(d)
  seq = d.sum(-1, keepdims=True) * np.ones_like(d)
  base, _, geo = name.partition("+")
  if base == "geo_mask":
    base, geo = "none", "geo_mask"
  if base == "none":
    w = np.ones_like(d)
  elif base == "tis_token":
    w = np.minimum(rho, cap)
  elif base == "tis_seq":
    w = np.minimum(np.exp(seq), cap)
  elif base == "mis_token":
    w = rho * (rho <= cap)
  elif base == "mis_seq":
    w = np.exp(seq) * (np.exp(seq) <= cap)
  else:
    raise ValueError(base)
  if geo:
    gm = np.exp(seq / np.maximum(mask.sum(-1, keepdims=True), 1))
    high = cap if geo_high is None else geo_high
    w = w * ((gm >= geo_low) & (gm <= high))
  return np.where(mask, w, 0.0)


def kl(logp, ref, old, estimator):
  x = ref - logp
  if estimator == "k1":
    return -x
  if estimator == "k2":
    return 0.5 * x**2
  k3 = np.exp(x) - x - 1
  if estimator == "k3":
    return k3
  return np.exp(logp - old) * k3
