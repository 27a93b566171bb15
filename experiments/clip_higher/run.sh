#!/usr/bin/env bash
# clip_higher: objective.clip_high 0.2 (symmetric) vs 0.28 (DAPO clip-higher) vs 0.4, 8 seeds
# each, one pack of 24 runs on the countdown testbed (configs/countdown.py), 200 RL updates of
# 16 optimiser steps each (4 epochs x 4 minibatches) at learning rate 1e-4 (calibrated on seeds
# 0-3: calibration.md), where the symmetric clip's entropy falls and accuracy still rises. Prints the tables (tables.md); figure here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)

SET=train.num_steps=200,optim.learning_rate=0.0001,rl.num_epochs=4,rl.num_minibatches=4
python tools/sweep.py --config=configs/countdown.py --root="$ROOT" --packed \
  --seeds=0,1,2,3,4,5,6,7 --grid=objective.clip_high=0.2,0.28,0.4 --set=$SET \
  > "$ROOT.sweep.log" 2>&1

COLS=policy/entropy@10,policy/entropy@50,policy/entropy@100,policy/entropy@final,eval/accuracy@0,eval/accuracy@50
COLS=$COLS,eval/accuracy@final,eval/pass@4@final,policy/clip_frac_high@avg
python experiments/seed_table.py --root="$ROOT" --group_by=objective.clip_high --cols=$COLS \
  --baseline=0.2 --expect=policy/entropy@50:+,policy/entropy@final:+,eval/accuracy@final:+ \
  --per_seed --csv="$ROOT/table.csv"
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  python tools/sweep.py --config=configs/countdown.py --root="$ROOT.confirm" --packed \
    --seeds=$CONFIRM_SEEDS --grid=objective.clip_high=0.2,0.28 --set=$SET \
    > "$ROOT.confirm.log" 2>&1
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=objective.clip_high --band=ci --size=9x5.4 \
  --dpi=70 --tags=policy/entropy,eval/accuracy,policy/clip_frac_high,rollout/length_mean \
  --out="$HERE/curves.png" > /dev/null
python tools/plot.py passk "$ROOT" --group_by=objective.clip_high --dpi=70 --out="$HERE/passk.png" > /dev/null
