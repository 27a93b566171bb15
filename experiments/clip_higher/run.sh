#!/usr/bin/env bash
# clip_higher: objective.clip_high 0.2 (symmetric) vs 0.28 (DAPO clip-higher), 3 seeds each,
# 8 optimiser updates per rollout (2 epochs x 4 minibatches) so that the clip is active.
# Outputs go under $ROOT (default /tmp/jaxrl_experiments/clip_higher); figures into this folder.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo

# seed is the outer grid axis, so every arm's first seed compiles and the later ones hit the cache
python tools/sweep.py --config=configs/default.py --root="$ROOT" --parallel=2 \
  --grid=seed=0,1,2 --grid=objective.clip_high=0.2,0.28 \
  --set=train.num_steps=500,train.eval_every=50,train.log_every=10 \
  --set=rl.num_epochs=2,rl.num_minibatches=4

python experiments/seed_table.py --root="$ROOT" --group_by=objective.clip_high \
  --cols=eval/accuracy@0,eval/accuracy@100,eval/accuracy@200,eval/accuracy@300,eval/accuracy@final,eval/pass@4@final \
  --csv="$ROOT/accuracy.csv"
python experiments/seed_table.py --root="$ROOT" --group_by=objective.clip_high \
  --cols=policy/entropy@10,policy/entropy@100,policy/entropy@200,policy/entropy@300,policy/entropy@400,policy/entropy@final,policy/clip_frac_high@avg,policy/clip_frac_low@avg \
  --csv="$ROOT/entropy.csv"
python tools/plot.py curves "$ROOT" --group_by=objective.clip_high --band=std --size=9x5.4 --dpi=70 \
  --tags=policy/entropy,eval/accuracy,policy/clip_frac_high,policy/clip_frac_low \
  --out="$HERE/curves.png"
