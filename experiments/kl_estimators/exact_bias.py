"""Part A of the KL-estimator study: exact bias and variance of KL-gradient estimates.

A categorical policy π_θ = softmax(θ) over V tokens, a reference π_ref, and a behaviour
(sampler) policy μ = softmax(θ + σ·z) that differs from π_θ by a logit perturbation of scale σ
(σ = 0: on-policy). Each estimator k(a) of `jaxrl_llm.objectives.kl_penalty` (docs/objectives.md
§4) is used as a loss on a token a ~ μ, exactly as the trainer does; its per-sample gradient
g(a) = ∇_θ k(a) is compared with the exact ∇_θ KL(π_θ‖π_ref):

  bias      = ‖E_{a~μ}[g(a)] − ∇KL‖ / ‖∇KL‖            (exact: a sum over the V tokens)
  std       = sqrt(E_{a~μ}‖g(a) − E g‖²) / ‖∇KL‖       (per-sample spread, exact)

A Monte-Carlo check draws batches of N tokens from μ and reports the relative RMSE of the
batch-mean gradient, which must equal sqrt(bias² + std²/N).

Variants (what `ℓ^old` is for k3_is):
  k3_is (old = π_θ)   the trainer's case: ℓ^old is the learner's own old pass, so under a
                      mismatched sampler the ratio π_θ/π_old does not see μ
  k3_is (old = μ)     the ratio taken against the sampler's log-probs instead
  k3_is · min(ρ, 2)   the trainer's case times a truncated behaviour weight ρ = π_old/μ
                      (what `tis_token` applies to the policy term, here applied to the KL term)

  python experiments/kl_estimators/exact_bias.py [--instances=200] [--vocab=6]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.objectives import kl_penalty

jax.config.update("jax_enable_x64", False)

VARIANTS = (
  "k1",
  "k2",
  "k3",
  "k3_is (old = π_θ)",
  "k3_is (old = μ)",
  "k3_is (old = π_θ) · min(ρ, 2)",
)


def per_token_loss(theta, ref_logp, mu_logp, variant):
  """[V] loss of each token a (as if sampled), differentiable in θ."""
  logp = jax.nn.log_softmax(theta)[None, :]  # every token as one position of a [1, V] batch
  ref = ref_logp[None, :]
  pi_old = jax.lax.stop_gradient(logp)
  if variant in ("k1", "k2", "k3"):
    return kl_penalty(logp, ref, estimator=variant)[0]
  if variant == "k3_is (old = π_θ)":
    return kl_penalty(logp, ref, pi_old, estimator="k3_is")[0]
  if variant == "k3_is (old = μ)":
    return kl_penalty(logp, ref, mu_logp[None, :], estimator="k3_is")[0]
  if variant == "k3_is (old = π_θ) · min(ρ, 2)":
    rho = jnp.minimum(jnp.exp(pi_old - mu_logp[None, :]), 2.0)
    return (rho * kl_penalty(logp, ref, pi_old, estimator="k3_is"))[0]
  raise ValueError(variant)


def true_kl_grad(theta, ref_logp):
  """The exact gradient of KL(π_θ || π_ref) with respect to the logits `theta`."""

  def kl(th):
    logp = jax.nn.log_softmax(th)
    return jnp.sum(jnp.exp(logp) * (logp - ref_logp))

  return jax.grad(kl)(theta)


def per_sample_grads(theta, ref_logp, mu_logp, variant):
  """[V, V]: row a = ∇_θ of the loss on token a."""
  return jax.jacrev(per_token_loss)(theta, ref_logp, mu_logp, variant)


def instance(rng, vocab, ref_scale):
  """One random draw: logits θ, log π_ref at `ref_scale` from them, and a noise vector z."""
  theta = rng.normal(size=vocab).astype(np.float32)
  ref_logits = theta + ref_scale * rng.normal(size=vocab).astype(np.float32)
  z = rng.normal(size=vocab).astype(np.float32)
  return jnp.asarray(theta), jax.nn.log_softmax(jnp.asarray(ref_logits)), jnp.asarray(z)


def main():
  """Prints each variant's exact bias and spread over random instances, and the MC check."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--instances", type=int, default=200, help="random (θ, π_ref, z) draws")
  p.add_argument("--vocab", type=int, default=6)
  p.add_argument("--ref_scale", type=float, default=1.0, help="logit distance of π_ref from π_θ")
  p.add_argument(
    "--sigmas", default="0,0.033,0.05,0.1,0.3,1.0", help="behaviour perturbation scales"
  )
  p.add_argument("--mc_n", type=int, default=64, help="tokens per Monte-Carlo batch")
  p.add_argument("--mc_reps", type=int, default=4000, help="Monte-Carlo batches (instance 0)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  sigmas = [float(s) for s in args.sigmas.split(",")]
  rng = np.random.default_rng(args.seed)
  insts = [instance(rng, args.vocab, args.ref_scale) for _ in range(args.instances)]
  grads = jax.jit(per_sample_grads, static_argnums=3)

  print(
    f"V = {args.vocab} tokens, {args.instances} random instances (π_ref logits = θ + "
    f"{args.ref_scale}·N(0,1)), μ logits = θ + σ·N(0,1)."
  )
  print("Cells: median over instances [10th–90th percentile] of ‖E_μ g − ∇KL‖/‖∇KL‖ (bias)")
  print("and of sqrt(E_μ‖g − E_μ g‖²)/‖∇KL‖ (per-sample std), both exact by enumeration.\n")
  kl_mu = {}
  rows = {v: {} for v in VARIANTS}
  for sigma in sigmas:
    kls = []
    per_variant = {v: ([], []) for v in VARIANTS}
    for theta, ref_logp, z in insts:
      mu_logp = jax.nn.log_softmax(theta + sigma * z)
      mu = jnp.exp(mu_logp)
      pi_logp = jax.nn.log_softmax(theta)
      kls.append(float(jnp.sum(mu * (mu_logp - pi_logp))))
      true = true_kl_grad(theta, ref_logp)
      norm = float(jnp.linalg.norm(true))
      for v in VARIANTS:
        g = grads(theta, ref_logp, mu_logp, v)  # [V tokens, V params]
        mean = mu @ g
        var = float(jnp.sum(mu * jnp.sum((g - mean) ** 2, axis=1)))
        per_variant[v][0].append(float(jnp.linalg.norm(mean - true)) / norm)
        per_variant[v][1].append(np.sqrt(var) / norm)
    kl_mu[sigma] = np.median(kls)
    for v in VARIANTS:
      rows[v][sigma] = tuple(np.asarray(x) for x in per_variant[v])

  def cell(x):
    lo, med, hi = np.percentile(x, [10, 50, 90])
    return f"{med:.3g} [{lo:.2g}–{hi:.2g}]"

  header = "| estimator | " + " | ".join(f"σ = {s:g}" for s in sigmas) + " |"
  print("KL(μ‖π_θ) per token, median: " + ", ".join(f"σ={s:g}: {kl_mu[s]:.2g}" for s in sigmas))
  for what, idx in (("bias (relative)", 0), ("per-sample std (relative)", 1)):
    print(f"\n{what}\n\n{header}\n|---|" + "---|" * len(sigmas))
    for v in VARIANTS:
      print(f"| {v} | " + " | ".join(cell(rows[v][s][idx]) for s in sigmas) + " |")

  # Monte-Carlo check on instance 0: batches of N tokens drawn from μ.
  theta, ref_logp, z = insts[0]
  true = np.asarray(true_kl_grad(theta, ref_logp))
  norm = np.linalg.norm(true)
  key = jax.random.PRNGKey(args.seed)
  print(
    f"\nMonte-Carlo check (instance 0, {args.mc_reps} batches of N = {args.mc_n} tokens from μ): "
    "relative RMSE of the batch-mean gradient, measured / predicted sqrt(bias² + std²/N)\n"
  )
  print(header + "\n|---|" + "---|" * len(sigmas))
  for v in VARIANTS:
    cells = []
    for sigma in sigmas:
      mu_logp = jax.nn.log_softmax(theta + sigma * z)
      g = np.asarray(grads(theta, ref_logp, mu_logp, v))
      key, sub = jax.random.split(key)
      tokens = np.asarray(jax.random.categorical(sub, mu_logp, shape=(args.mc_reps, args.mc_n)))
      est = g[tokens].mean(axis=1)  # [reps, V]
      rmse = np.sqrt(np.mean(np.sum((est - true) ** 2, axis=1))) / norm
      mu = np.exp(np.asarray(mu_logp))
      mean = mu @ g
      var = np.sum(mu * np.sum((g - mean) ** 2, axis=1))
      pred = np.sqrt(np.sum((mean - true) ** 2) + var / args.mc_n) / norm
      cells.append(f"{rmse:.3g} / {pred:.3g}")
    print(f"| {v} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
