#!/usr/bin/env bash
# dynamic_sampling: filtering.name=dynamic_sampling (k = 2: 64 prompt groups sampled, the first
# 32 with reward spread kept) for 300 RL updates, against no filtering for 300 updates (the same
# number of updates) and for 600 updates (about the same number of generated tokens), 3 seeds.
# Outputs go under $ROOT (default /tmp/jaxrl_experiments/dynamic_sampling); figures here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
LOG=train.eval_every=25,train.log_every=5

python tools/sweep.py --config=configs/default.py --root="$ROOT/dynamic_sampling" --parallel=2 \
  --grid=seed=0,1,2 --set=filtering.name=dynamic_sampling,train.num_steps=300 --set=$LOG
python tools/sweep.py --config=configs/default.py --root="$ROOT/none" --parallel=2 \
  --grid=seed=0,1,2 --grid=train.num_steps=600,300 --set=filtering.name=none --set=$LOG

python experiments/dynamic_sampling/tokens.py --root="$ROOT" --out="$HERE/accuracy_vs_tokens.png" --budgets=0.15,0.3,0.45,0.6,0.75,0.88
python experiments/seed_table.py --root="$ROOT" --group_by=filtering.name,train.num_steps \
  --csv="$ROOT/steps.csv" \
  --cols=eval/accuracy@100,eval/accuracy@200,eval/accuracy@300,eval/accuracy@final,filter/zero_std_frac@avg:1-100,filter/zero_std_frac@avg:200-300,rollout/zero_std_group_frac@avg:1-100,rollout/zero_std_group_frac@avg:200-300
python tools/plot.py curves "$ROOT" --group_by=filtering.name,train.num_steps --band=std \
  --size=9x3.6 --dpi=70 --tags=rollout/zero_std_group_frac,filter/zero_std_frac \
  --out="$HERE/zero_std.png"
