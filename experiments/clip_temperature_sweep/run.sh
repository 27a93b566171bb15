#!/usr/bin/env bash
# clip_temperature_sweep: objective.clip_high {0.2, 0.28} x sampling.temperature {0.7, 1.0, 1.3}
# x 8 seeds, one pack of 48 runs on the countdown testbed (configs/countdown.py), 150 RL updates
# of 8 optimiser steps each (2 epochs x 4 minibatches) at learning rate 1e-3. Prints the tables
# (tables.md: each cell's interval, its paired difference to the default cell 0.2, 1.0, and
# every run's values); heat maps and pass@k here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)

SET=train.num_steps=150,optim.learning_rate=0.001,rl.num_epochs=2,rl.num_minibatches=4
python tools/sweep.py --config=configs/countdown.py --root="$ROOT" --packed \
  --seeds=0,1,2,3,4,5,6,7 --grid=objective.clip_high=0.2,0.28 \
  --grid=sampling.temperature=0.7,1.0,1.3 \
  --set=$SET > "$ROOT.sweep.log" 2>&1

G=objective.clip_high,sampling.temperature
COLS=eval/accuracy@0,eval/accuracy@final,eval/pass@4@final,policy/entropy@final
COLS=$COLS,rollout/reward_mean@avg:130-150,policy/clip_frac_high@avg
python experiments/seed_table.py --root="$ROOT" --group_by=$G --cols=$COLS --baseline=0.2,1.0 \
  --per_seed --csv="$ROOT/table.csv"
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  python tools/sweep.py --config=configs/countdown.py --root="$ROOT.confirm" --packed \
    --seeds=$CONFIRM_SEEDS --grid=objective.clip_high=0.2,0.28 --set=sampling.temperature=1.0 \
    --set=$SET > "$ROOT.confirm.log" 2>&1
  # exploratory columns (added after the confirmation was seen; no verdict): the warm start's
  # accuracy and its fall at this learning rate, how often the clip binds
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --cols=eval/accuracy@0,eval/accuracy@50,policy/clip_frac_high@avg \
    --per_seed
fi
for tag in eval/accuracy policy/entropy; do
  python tools/plot.py heatmap "$ROOT" --tag=$tag --x=objective.clip_high \
    --y=sampling.temperature --size=5.5x3.6 --dpi=70 --out="$HERE/heatmap_${tag#*/}.png" > /dev/null
done
python tools/plot.py passk "$ROOT" --group_by=objective.clip_high,sampling.temperature --dpi=70 --out="$HERE/passk.png" > /dev/null
