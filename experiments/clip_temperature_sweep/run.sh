#!/usr/bin/env bash
# clip_temperature_sweep: objective.clip_high {0.2, 0.28, 0.4} x sampling.temperature
# {0.7, 1.0, 1.3} x 3 seeds on the default config, shortened to 200 RL updates.
# Outputs go under $ROOT (default /tmp/jaxrl_experiments/clip_temperature_sweep); figures here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo

python tools/sweep.py --config=configs/default.py --root="$ROOT" --parallel=2 \
  --grid=seed=0,1,2 --grid=objective.clip_high=0.2,0.28,0.4 --grid=sampling.temperature=0.7,1.0,1.3 \
  --set=train.num_steps=200,train.eval_every=50,train.log_every=10

G=objective.clip_high,sampling.temperature
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/final.csv" \
  --cols=eval/accuracy@0,eval/accuracy@100,eval/accuracy@final,eval/pass@4@final,policy/entropy@final,policy/clip_frac_high@avg,policy/clip_frac_low@avg
python tools/plot.py heatmap "$ROOT" --tag=eval/accuracy --x=objective.clip_high \
  --y=sampling.temperature --size=5.5x3.6 --dpi=70 --out="$HERE/heatmap_accuracy.png"
python tools/plot.py heatmap "$ROOT" --tag=policy/entropy --x=objective.clip_high \
  --y=sampling.temperature --size=5.5x3.6 --dpi=70 --out="$HERE/heatmap_entropy.png"
