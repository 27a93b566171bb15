#!/usr/bin/env bash
# dynamic_sampling: filtering.name=dynamic_sampling (k = 2: twice the prompt groups sampled, the
# first P with reward spread kept) for 150 RL updates, against no filtering for 150 updates (the
# same number of updates) and for 300 updates (about the same number of generated tokens), 8
# seeds each, on 3-digit addition with the testbed's CPU policy (configs/countdown.py with
# task.name=addition, task.digits=3: the no-tool setting of tool_calculator, learning rate 1e-4,
# 16 optimiser steps per update), where groups whose 8 completions all succeed become common as
# RL sharpens the policy (calibration.md). The arms change the program, so each is its own pack
# of 8 seeds. Prints the tables (tables.md); figures here. (The first exploration, on countdown:
# tables_countdown.md.)
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)
SEEDS=0,1,2,3,4,5,6,7
COMMON=task.name=addition,task.digits=3,optim.learning_rate=0.0001,rl.num_epochs=4
COMMON=$COMMON,rl.num_minibatches=4,train.eval_every=25

for arm in dynamic_sampling:150 none:150 none:300; do
  name=${arm%%:*} steps=${arm##*:}
  python tools/sweep.py --config=configs/countdown.py --root="$ROOT/$name,$steps" --packed \
    --seeds=$SEEDS --set=$COMMON --set=filtering.name=$name,train.num_steps=$steps \
    > "$ROOT.$name,$steps.log" 2>&1
done

python experiments/dynamic_sampling/tokens.py --root="$ROOT" --out="$HERE/accuracy_vs_tokens.png" \
  --budgets=0.05,0.1,0.15,0.2 --levels=0.4,0.5
COLS=eval/accuracy@0,eval/accuracy@50,eval/accuracy@100,eval/accuracy@150,eval/accuracy@final
COLS=$COLS,rollout/zero_std_group_frac@avg:1-50,rollout/zero_std_group_frac@avg:100-150
COLS=$COLS,filter/zero_std_frac@avg:1-50,filter/zero_std_frac@avg:100-150
python experiments/seed_table.py --root="$ROOT" --group_by=filtering.name,train.num_steps \
  --cols=$COLS --baseline=none,150 --per_seed --csv="$ROOT/table.csv" \
  --expect=eval/accuracy@100:+,eval/accuracy@150:+
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  for name in dynamic_sampling none; do
    python tools/sweep.py --config=configs/countdown.py --root="$ROOT.confirm/$name,150" \
      --packed --seeds=$CONFIRM_SEEDS --set=$COMMON --set=filtering.name=$name,train.num_steps=150 \
      > "$ROOT.confirm.$name,150.log" 2>&1
  done
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=filtering.name,train.num_steps --band=ci \
  --size=9x3.6 --dpi=70 --tags=rollout/zero_std_group_frac,eval/accuracy \
  --out="$HERE/zero_std.png" > /dev/null
# Per generated token: dynamic sampling's 150 updates against no filter's 300 (the same tokens).
python experiments/seed_table.py --root="$ROOT" --group_by=filtering.name,train.num_steps \
  --cols=eval/accuracy@final --baseline=none,300 --expect=eval/accuracy@final:+
python tools/plot.py passk "$ROOT" --group_by=filtering.name,train.num_steps --dpi=70 --out="$HERE/passk.png" > /dev/null
