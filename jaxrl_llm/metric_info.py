"""What each logged metric means: its direction (higher better, lower better or neither) and the
names TRL's GRPOTrainer and verl give the same quantity.

One table serves `tools/compare.py` ("best" only where a direction is better), the HParams
metrics each run declares, and docs/tensorboard.md's mapping table. It also says which files are
event files, for every tool that looks for runs. Kept free of JAX so tools import it cheaply.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os

EVENT_FILE_PREFIX = "events.out.tfevents."  # the writer's file names (tensorboard's own naming)


def tag_order(tag: str) -> tuple[str, int, str]:
  """A sort key for tags with `@k` in number order (`eval/pass@2` before `eval/pass@16`): the
  tag before the `@`, then k as a number, then the rest."""
  head, _, tail = tag.partition("@")
  digits = "".join(c for c in tail if c.isdigit())
  return head, int(digits) if digits else 0, tail


def is_event_file(name: str) -> bool:
  """Whether TensorBoard's reader takes the file `name` (a name or a path) for an event file: its
  rule (`io_wrapper.IsTensorFlowEventsFile`) is "tfevents" in the base name."""
  return "tfevents" in os.path.basename(name)


MAX, MIN = "max", "min"  # directions; None: neither is better in general


@dataclasses.dataclass(frozen=True)
class MetricInfo:
  """One metric family: a tag glob, its direction, a one-line meaning and peer names."""

  pattern: str  # a tag or fnmatch glob, e.g. "eval/pass@*"
  direction: str | None  # MAX, MIN or None
  meaning: str  # one line, shown in TensorBoard's HParams view and docs/tensorboard.md
  trl: str = ""  # TRL GRPOTrainer's name for the same quantity ("" when it logs none)
  verl: str = ""  # verl's name for the same quantity ("" when it logs none)


# pattern | direction (max, min or -) | meaning | TRL's name | verl's name ("-": none)
_TABLE = """
eval/accuracy                    | max | greedy accuracy on the held-out set | - | -
eval/pass@*                      | max | pass@k on the held-out set (k samples per prompt; pass@j below k unbiased from them) | - | -
eval/sample_accuracy             | max | accuracy of sampled held-out completions | - | -
eval/length_mean                 | -   | mean length of greedy held-out completions | - | -
eval/reward/*                    | max | mean of one host reward term over greedy held-out completions | - | -
rollout/reward_mean              | max | mean reward of the sampled group | reward | critic/score/mean
rollout/reward_std               | -   | std of rewards over the batch | reward_std | -
rollout/accuracy                 | max | fraction of sampled completions judged correct | - | -
rollout/length_mean              | -   | mean completion length | completions/mean_length | response_length/mean
rollout/length_max               | -   | longest completion | completions/max_length | response_length/max
rollout/length_min               | -   | shortest completion | completions/min_length | response_length/min
rollout/length_correct_mean      | -   | mean length of correct completions (0 when none is correct) | - | -
rollout/length_incorrect_mean    | -   | mean length of incorrect completions (0 when none is) | - | -
rollout/truncated_frac           | min | fraction of completions cut at the length limit | completions/clipped_ratio | response_length/clip_ratio
rollout/zero_std_group_frac      | min | fraction of groups whose rewards are all equal (no signal) | frac_reward_zero_std | -
rollout/decode_steps             | -   | decode loop iterations this step | - | -
tool/turns_mean                  | -   | policy segments per episode (tool calls + 1; multi-turn) | - | -
tool/calls_mean                  | -   | tool calls per episode | - | -
tool/errors_mean                 | min | calls per episode the tool could not evaluate | - | -
tool/error_frac                  | min | share of tool calls the tool could not evaluate | - | -
tool/used_frac                   | -   | share of episodes that called the tool | - | -
tool/env_token_frac              | -   | share of generated tokens the tool wrote (never learned) | - | -
tool/reward_with_calls           | max | mean reward of episodes that called the tool | - | -
tool/reward_without_calls        | max | mean reward of episodes that did not | - | -
reward/*                         | max | mean of one reward term | rewards/<func>/mean | -
adv/mean                         | -   | mean advantage | - | critic/advantages/mean
adv/std                          | -   | std of advantages | - | -
adv/abs_max                      | -   | largest absolute advantage | - | critic/advantages/max
policy/loss                      | -   | policy loss (objective only) | loss | actor/pg_loss
policy/total_loss                | -   | loss with KL and regularisers | - | -
policy/entropy                   | -   | mean token entropy of the policy | entropy | actor/entropy
policy/clip_frac                 | -   | fraction of tokens clipped (low or high) | clip_ratio/region_mean | actor/pg_clipfrac
policy/clip_frac_low             | -   | tokens clipped below (r < 1-eps_low, A < 0) | clip_ratio/low_mean | -
policy/clip_frac_high            | -   | tokens clipped above (r > 1+eps_high, A > 0) | clip_ratio/high_mean | -
policy/clip_frac_first_minibatch | -   | clip fraction of the first minibatch | - | -
policy/ratio_*                   | -   | importance ratio statistics (new / old policy) | - | -
policy/approx_kl                 | -   | k1 KL of old to new policy over the update | - | actor/ppo_kl
policy/*_mean                    | -   | objective-specific means (seq ratio, IS weight, gates) | - | -
behaviour/kl_k3                  | min | k3 KL between the sampler and the learner | - | -
behaviour/mismatch_*             | min | absolute log-prob difference of learner and sampler per token (verl: in probabilities) | sampling/sampling_logp_difference/* | training/rollout_probs_diff_*
behaviour/rho_*                  | -   | behaviour importance ratio statistics | sampling/importance_sampling_ratio/* | -
behaviour/*                      | -   | behaviour correction statistics (§3) | - | -
kl/ref_kl                        | min | k1 KL to the reference policy | kl | actor/kl_loss
kl/loss                          | -   | the configured KL estimator's value | - | -
filter/*                         | -   | dynamic sampling statistics (§7) | - | -
value/loss                       | min | critic loss (PPO) | - | critic/vf_loss
value/*                          | -   | critic statistics (PPO) | - | critic/values/mean
moe/route_disagree_*             | min | share of routing choices that differ between passes | - | -
moe/*                            | -   | router statistics | - | -
optim/grad_norm                  | -   | global gradient norm | grad_norm | actor/grad_norm
optim/learning_rate              | -   | learning rate | learning_rate | actor/lr
optim/skipped_updates            | min | non-finite updates skipped so far | - | -
verifier/errors*                 | min | reward terms that raised | - | -
verifier/timeouts*               | min | reward terms that hit the time limit | - | -
verifier/*                       | -   | verifier statistics | - | -
data/*                           | -   | data loading statistics | - | -
perf/step_time_s                 | min | wall seconds per RL update since the last log (evaluations, saves, the first compilation in it) | step_time | timing_s/step
perf/*_per_s                     | max | throughput | - | perf/throughput
perf/*                           | -   | token counts | num_tokens | perf/total_num_tokens
sft/loss                         | min | supervised warm-start loss (its own run: <workdir>/sft) | - | -
sft/*                            | -   | supervised warm-start statistics | - | -
"""


def _row(line: str) -> MetricInfo:
  pattern, way, meaning, trl, verl = (cell.strip() for cell in line.split("|"))
  return MetricInfo(
    pattern, None if way == "-" else way, meaning, *("" if n == "-" else n for n in (trl, verl))
  )


METRICS: tuple[MetricInfo, ...] = tuple(_row(line) for line in _TABLE.strip().splitlines())

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
  """docs/tensorboard.md's markdown table: each metric with a peer name, its direction and meaning."""
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
