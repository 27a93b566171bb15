"""What each logged metric means: its direction (higher better, lower better or neither) and the
names TRL's GRPOTrainer and verl give the same quantity.

One table serves `tools/compare.py` ("best" only where a direction is better), the HParams
metrics each run declares, and the README's mapping table. Kept free of JAX so tools import it
cheaply.
"""

from __future__ import annotations

import dataclasses
import fnmatch

MAX, MIN = "max", "min"  # directions; None: neither is better in general


@dataclasses.dataclass(frozen=True)
class MetricInfo:
  """One metric family: a tag glob, its direction, a one-line meaning and peer names."""

  pattern: str  # a tag or fnmatch glob, e.g. "eval/pass@*"
  direction: str | None  # MAX, MIN or None
  meaning: str  # one line, shown in TensorBoard's HParams view and the README
  trl: str = ""  # TRL GRPOTrainer's name for the same quantity ("" when it logs none)
  verl: str = ""  # verl's name for the same quantity ("" when it logs none)


METRICS: tuple[MetricInfo, ...] = (
  MetricInfo("eval/accuracy", MAX, "greedy accuracy on the held-out set"),
  MetricInfo("eval/pass@*", MAX, "pass@k on the held-out set (k samples per prompt)"),
  MetricInfo("eval/sample_accuracy", MAX, "accuracy of sampled held-out completions"),
  MetricInfo("eval/length_mean", None, "mean length of greedy held-out completions"),
  MetricInfo(
    "rollout/reward_mean", MAX, "mean reward of the sampled group", "reward", "critic/score/mean"
  ),
  MetricInfo("rollout/reward_std", None, "std of rewards over the batch", "reward_std"),
  MetricInfo("rollout/accuracy", MAX, "fraction of sampled completions judged correct"),
  MetricInfo(
    "rollout/length_mean",
    None,
    "mean completion length",
    "completions/mean_length",
    "response_length/mean",
  ),
  MetricInfo(
    "rollout/length_max",
    None,
    "longest completion",
    "completions/max_length",
    "response_length/max",
  ),
  MetricInfo(
    "rollout/length_min",
    None,
    "shortest completion",
    "completions/min_length",
    "response_length/min",
  ),
  MetricInfo("rollout/length_correct_mean", None, "mean length of correct completions"),
  MetricInfo("rollout/length_incorrect_mean", None, "mean length of incorrect completions"),
  MetricInfo(
    "rollout/truncated_frac",
    MIN,
    "fraction of completions cut at the length limit",
    "completions/clipped_ratio",
    "response_length/clip_ratio",
  ),
  MetricInfo(
    "rollout/zero_std_group_frac",
    MIN,
    "fraction of groups whose rewards are all equal (no signal)",
    "frac_reward_zero_std",
  ),
  MetricInfo("rollout/decode_steps", None, "decode loop iterations this step"),
  MetricInfo("reward/*", MAX, "mean of one reward term", "rewards/<func>/mean"),
  MetricInfo("adv/mean", None, "mean advantage", "", "critic/advantages/mean"),
  MetricInfo("adv/std", None, "std of advantages"),
  MetricInfo("adv/abs_max", None, "largest absolute advantage", "", "critic/advantages/max"),
  MetricInfo("policy/loss", None, "policy loss (objective only)", "loss", "actor/pg_loss"),
  MetricInfo("policy/total_loss", None, "loss with KL and regularisers"),
  MetricInfo(
    "policy/entropy", None, "mean token entropy of the policy", "entropy", "actor/entropy"
  ),
  MetricInfo(
    "policy/clip_frac",
    None,
    "fraction of tokens clipped (low or high)",
    "clip_ratio/region_mean",
    "actor/pg_clipfrac",
  ),
  MetricInfo(
    "policy/clip_frac_low",
    None,
    "tokens clipped below (r < 1-eps_low, A < 0)",
    "clip_ratio/low_mean",
  ),
  MetricInfo(
    "policy/clip_frac_high",
    None,
    "tokens clipped above (r > 1+eps_high, A > 0)",
    "clip_ratio/high_mean",
  ),
  MetricInfo("policy/clip_frac_first_minibatch", None, "clip fraction of the first minibatch"),
  MetricInfo("policy/ratio_*", None, "importance ratio statistics (new / old policy)"),
  MetricInfo(
    "policy/approx_kl", None, "k1 KL of old to new policy over the update", "", "actor/ppo_kl"
  ),
  MetricInfo("policy/*_mean", None, "objective-specific means (seq ratio, IS weight, gates)"),
  MetricInfo("behaviour/kl_k3", MIN, "k3 KL between the sampler and the learner"),
  MetricInfo(
    "behaviour/mismatch_*",
    MIN,
    "absolute log-prob difference of learner and sampler per token (verl: in probabilities)",
    "sampling/sampling_logp_difference/*",
    "training/rollout_probs_diff_*",
  ),
  MetricInfo(
    "behaviour/rho_*",
    None,
    "behaviour importance ratio statistics",
    "sampling/importance_sampling_ratio/*",
  ),
  MetricInfo("behaviour/*", None, "behaviour correction statistics (§3)"),
  MetricInfo("kl/ref_kl", MIN, "k1 KL to the reference policy", "kl", "actor/kl_loss"),
  MetricInfo("kl/loss", None, "the configured KL estimator's value"),
  MetricInfo("filter/*", None, "dynamic sampling statistics (§7)"),
  MetricInfo("value/loss", MIN, "critic loss (PPO)", "", "critic/vf_loss"),
  MetricInfo("value/*", None, "critic statistics (PPO)", "", "critic/values/mean"),
  MetricInfo("moe/route_disagree_*", MIN, "share of routing choices that differ between passes"),
  MetricInfo("moe/*", None, "router statistics"),
  MetricInfo("optim/grad_norm", None, "global gradient norm", "grad_norm", "actor/grad_norm"),
  MetricInfo("optim/learning_rate", None, "learning rate", "learning_rate", "actor/lr"),
  MetricInfo("optim/skipped_updates", MIN, "non-finite updates skipped so far"),
  MetricInfo("verifier/errors*", MIN, "reward terms that raised"),
  MetricInfo("verifier/timeouts*", MIN, "reward terms that hit the time limit"),
  MetricInfo("verifier/*", None, "verifier statistics"),
  MetricInfo("data/*", None, "data loading statistics"),
  MetricInfo("perf/step_time_s", MIN, "seconds per RL update", "step_time", "timing_s/step"),
  MetricInfo("perf/*_per_s", MAX, "throughput", "", "perf/throughput"),
  MetricInfo("perf/*", None, "token counts", "num_tokens", "perf/total_num_tokens"),
  MetricInfo("sft/loss", MIN, "supervised warm-start loss (its own run: <workdir>/sft)"),
  MetricInfo("sft/*", None, "supervised warm-start statistics"),
)

# Metrics the HParams view lists for every run (tag, display name).
HPARAMS_METRICS: tuple[tuple[str, str], ...] = (
  ("eval/accuracy", "eval accuracy"),
  ("rollout/reward_mean", "reward"),
  ("rollout/accuracy", "train accuracy"),
  ("policy/entropy", "entropy"),
  ("rollout/length_mean", "length"),
  ("policy/clip_frac", "clip fraction"),
  ("kl/ref_kl", "KL to reference"),
  ("behaviour/kl_k3", "sampler KL"),
)


def info(tag: str) -> MetricInfo | None:
  """The first entry of `METRICS` whose pattern matches `tag`, or None."""
  for entry in METRICS:
    if fnmatch.fnmatchcase(tag, entry.pattern):
      return entry
  return None


def direction(tag: str) -> str | None:
  """'max' (higher is better), 'min' (lower is better) or None (neither, or unknown)."""
  entry = info(tag)
  return entry.direction if entry else None


def mapping_table() -> str:
  """The README's markdown table: each metric with a peer name, its direction and meaning."""
  arrow = {MAX: "higher", MIN: "lower", None: "neither"}
  rows = [
    "| this project | TRL GRPOTrainer | verl | better | meaning |",
    "|---|---|---|---|---|",
  ]
  for m in METRICS:
    if m.trl or m.verl:
      trl, verl = (f"`{n}`" if n else "-" for n in (m.trl, m.verl))
      rows.append(f"| `{m.pattern}` | {trl} | {verl} | {arrow[m.direction]} | {m.meaning} |")
  return "\n".join(rows)
