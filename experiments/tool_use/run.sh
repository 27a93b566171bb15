#!/usr/bin/env bash
# tool_use: countdown with its checking tool (sampling.tool=countdown: the policy writes an
# expression and `=`, the program appends its value, the policy answers) against the same
# setting without the tool, 8 seeds each, on the countdown testbed (configs/countdown.py) at
# the calibrated clip_higher settings (learning rate 1e-4, 16 optimiser steps per update, 200
# updates). The tool arm's warm start imitates traces that call the tool first
# (task.tool_traces=1: `5*3+8=23,5*3+8`); both arms' traces are 30% wrong alike. The arms
# change the program, so each is its own pack. Prints the tables (tables.md); figures here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)
COMMON=train.num_steps=200,optim.learning_rate=0.0001,rl.num_epochs=4,rl.num_minibatches=4
TOOL=sampling.tool=countdown,task.tool_traces=1,sampling.max_turns=2,sampling.max_new_tokens=24

tool_arms countdown 0,1,2,3,4,5,6,7 "$ROOT"  # tool_arms: study_env.sh

COLS=eval/accuracy@0,eval/accuracy@100,eval/accuracy@final,eval/pass@16@0,eval/pass@16@final
COLS=$COLS,rollout/length_mean@final,tool/used_frac@final,tool/error_frac@final
python experiments/seed_table.py --root="$ROOT" --group_by=sampling.tool --cols=$COLS \
  --baseline=none --per_seed --csv="$ROOT/table.csv" \
  --expect=eval/accuracy@final:+,eval/pass@16@final:+
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  tool_arms countdown "$CONFIRM_SEEDS" "$ROOT.confirm"
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=sampling.tool --band=ci --size=9x5.4 --dpi=70 \
  --tags=eval/accuracy,eval/pass@16,rollout/length_mean,tool/used_frac --out="$HERE/curves.png" \
  > /dev/null
python tools/plot.py passk "$ROOT" --group_by=sampling.tool --dpi=70 --out="$HERE/passk.png" > /dev/null
