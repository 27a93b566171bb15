"""Accuracy against generated tokens for the dynamic-sampling study (table + figure).

  python experiments/dynamic_sampling/tokens.py --root=/tmp/jaxrl_experiments/dynamic_sampling \\
      --out=experiments/dynamic_sampling/accuracy_vs_tokens.png

Each run's generated tokens are rebuilt from its event file and config:
  sampled completions per RL step = ceil(k·P)·G with dynamic sampling (k = filtering.oversample),
  P·G without; exact.
  generated tokens per step = perf/generated_tokens, the lengths of every sampled row, the
  groups that filtering discards included. Logged every train.log_every steps; the value at a
  logged step stands for the steps since the previous one.
  For comparison, the estimate used before the trainer counted discarded groups:
  rollout/length_mean (the kept rows) x sampled rows, i.e. discarded completions assumed as
  long as kept ones.
Arms: (filtering.name, train.num_steps). Cells: mean [t 95% interval] over seeds.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import seed_table
import study_stats


def run_tokens(cfg, scalars):
  """(eval steps, eval accuracy, cumulative generated tokens at those steps, sampled rows/step)."""
  p, g = cfg["rl.num_prompts"], cfg["sampling.group_size"]
  if cfg["filtering.name"] == "dynamic_sampling":
    sampled = math.ceil(cfg["filtering.oversample"] * p)
  else:
    sampled = p
  gen = scalars["perf/generated_tokens"]
  steps = np.array([0] + [s for s, _ in gen], dtype=np.float64)
  per_step = np.array([v for _, v in gen])
  cum = np.concatenate([[0.0], np.cumsum(per_step * np.diff(steps))])
  ev = scalars["eval/accuracy"]
  es = np.array([s for s, _ in ev], dtype=np.float64)
  acc = np.array([v for _, v in ev])
  return es, acc, np.interp(es, steps, cum), sampled * g


def run_lengths(cfg, scalars, rows):
  """(generated tokens per logged update, per sampled completion, mean kept length, exact/est)."""
  gen = np.array([v for _, v in scalars["perf/generated_tokens"]])
  kept = np.array([v for _, v in scalars["rollout/length_mean"]])
  steps = np.array([0] + [s for s, _ in scalars["perf/generated_tokens"]], dtype=np.float64)
  w = np.diff(steps)
  return gen.mean(), gen.mean() / rows, kept.mean(), (gen * w).sum() / (kept * rows * w).sum()


def first_reach(x, acc, level):
  """The first x at which accuracy `acc` reaches `level` (None if it never does)."""
  hit = np.nonzero(acc >= level)[0]
  return float(x[hit[0]]) if hit.size else None


def ms(xs, digits="{:.3f}"):
  """Mean over seeds and its t 95% interval (`study_stats.interval`)."""
  xs = [x for x in xs if x is not None]
  if not xs:
    return "not reached"
  iv = study_stats.interval(xs)
  if len(xs) < study_stats.MIN_SEEDS:
    return f"{digits.format(iv.mean)} (n={len(xs)}: no interval)"
  return f"{digits.format(iv.mean)} [{digits.format(iv.low)}, {digits.format(iv.high)}]"


def main():
  """Prints accuracy against generated tokens for the runs under --root (and draws --out)."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--root", required=True)
  p.add_argument("--out", default=None, help="figure path (PNG)")
  p.add_argument("--budgets", default="0.5,1,1.5,2,3", help="token budgets in millions")
  p.add_argument("--levels", default="0.5,0.8", help="accuracy levels for tokens-to-reach")
  args = p.parse_args()
  budgets = [float(b) * 1e6 for b in args.budgets.split(",")]
  levels = [float(x) for x in args.levels.split(",")]
  arms: dict[tuple, list] = {}
  lengths: dict[tuple, list] = {}
  for d in seed_table.find_runs(args.root):
    cfg, scalars = seed_table.load(d)
    key = (cfg["filtering.name"], cfg["train.num_steps"])
    arms.setdefault(key, []).append(run_tokens(cfg, scalars))
    lengths.setdefault(key, []).append(run_lengths(cfg, scalars, arms[key][-1][3]))
  arms = dict(sorted(arms.items()))

  print(
    "held-out greedy accuracy at a generated-token budget (interpolated between evals; "
    "'-' past an arm's last eval), mean [t 95% interval] over seeds\n"
  )
  cols = [f"{b / 1e6:g}M tokens" for b in budgets]
  print(
    "| filtering | RL steps | n | sampled completions / step | "
    + " | ".join(cols)
    + " | total tokens (M) |"
  )
  print("|" + "---|" * (5 + len(cols)))
  for (name, steps), runs in arms.items():
    cells = []
    for b in budgets:
      vals = [float(np.interp(b, x, acc)) for _, acc, x, _ in runs if x[-1] >= b]
      cells.append(ms(vals) if len(vals) == len(runs) else "-")
    tot = ms([x[-1] / 1e6 for _, _, x, _ in runs], "{:.2f}")
    print(f"| {name} | {steps} | {len(runs)} | {runs[0][3]} | " + " | ".join(cells) + f" | {tot} |")

  print(
    "\ngenerated tokens (millions) and RL steps until held-out accuracy first reaches a "
    "level (first eval at or above it), mean [t 95% interval] over the seeds that reached it\n"
  )
  print(
    "| filtering | RL steps | "
    + " | ".join(f"tokens to {lv:g} | steps to {lv:g} | reached {lv:g}" for lv in levels)
    + " |"
  )
  print("|" + "---|" * (2 + 3 * len(levels)))
  for (name, steps), runs in arms.items():
    cells = []
    for lv in levels:
      toks = [first_reach(x, acc, lv) for _, acc, x, _ in runs]
      stp = [first_reach(es, acc, lv) for es, acc, _, _ in runs]
      cells += [
        ms([t / 1e6 if t is not None else None for t in toks], "{:.2f}"),
        ms(stp, "{:.0f}"),
        f"{sum(t is not None for t in toks)}/{len(runs)}",
      ]
    print(f"| {name} | {steps} | " + " | ".join(cells) + " |")

  print(
    "\ngenerated tokens per RL update (mean over logged updates), per sampled completion, "
    "mean length of the kept completions (rollout/length_mean), and exact total / the "
    "kept-length estimate (kept mean length x sampled rows), mean [t 95% interval] over seeds\n"
  )
  print(
    "| filtering | RL steps | tokens / update | tokens / sampled completion | "
    "kept completion length | exact / estimate |"
  )
  print("|" + "---|" * 6)
  for key in arms:
    cols = list(zip(*lengths[key], strict=True))
    fmts = ("{:.0f}", "{:.3f}", "{:.3f}", "{:.4f}")
    print(
      f"| {key[0]} | {key[1]} | "
      + " | ".join(ms(list(c), f) for c, f in zip(cols, fmts, strict=True))
      + " |"
    )

  if args.out:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=70, layout="constrained")
    for (name, steps), runs in arms.items():
      label = f"{name}, {steps} steps (n={len(runs)})"
      es = runs[0][0]
      n = min(len(r[0]) for r in runs)
      acc = np.array([r[1][:n] for r in runs])
      x = np.array([r[2][:n] for r in runs]).mean(0) / 1e6
      m, s = acc.mean(0), acc.std(0, ddof=1) if len(runs) > 1 else np.zeros(n)
      for ax, xx in ((axes[0], x), (axes[1], es[:n])):
        (line,) = ax.plot(xx, m, label=label, linewidth=1.5)
        ax.fill_between(xx, m - s, m + s, color=line.get_color(), alpha=0.2, linewidth=0)
    axes[0].set_xlabel("generated tokens (millions, cumulative)")
    axes[1].set_xlabel("RL step")
    for ax in axes:
      ax.set_ylabel("held-out greedy accuracy")
      ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("mean over seeds, band ±1 std", fontsize=9)
    fig.savefig(args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
