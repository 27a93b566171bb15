#!/usr/bin/env bash
# tool_calculator: 3-digit addition (task.name=addition, task.digits=3) with the calculator
# (sampling.tool=calculator: the policy writes `a+b=`, the program appends the sum and `,`, the
# policy then writes its answer) against the same setting without the tool, 8 seeds each, with
# the testbed's CPU policy (configs/countdown.py: 2 layers, d_model 64, a 1000-step warm start
# on traces 30% wrong) at the calibrated clip_higher settings (learning rate 1e-4, 16 optimiser
# steps per update, 200 updates). The tool arm's warm start calls the tool in half of its traces
# (task.tool_traces=0.5: `12+35=47,47`) and answers at once in the other half; the no-tool arm's
# traces all answer at once. Both arms' traces are 30% wrong alike (the second operand misread).
# The arms change the program, so each is its own pack. Prints the tables (tables.md); figures
# here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)
COMMON=task.name=addition,task.digits=3,train.num_steps=200,optim.learning_rate=0.0001
COMMON=$COMMON,rl.num_epochs=4,rl.num_minibatches=4
TOOL=sampling.tool=calculator,task.tool_traces=0.5,sampling.max_turns=2,sampling.max_new_tokens=24

tool_arms calculator 0,1,2,3,4,5,6,7 "$ROOT"  # tool_arms: study_env.sh

COLS=eval/accuracy@0,eval/accuracy@50,eval/accuracy@final,eval/pass@16@0,eval/pass@16@final
COLS=$COLS,rollout/length_mean@final,tool/used_frac@final,tool/error_frac@final
python experiments/seed_table.py --root="$ROOT" --group_by=sampling.tool --cols=$COLS \
  --baseline=none --per_seed --csv="$ROOT/table.csv" \
  --expect=eval/accuracy@final:+
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  tool_arms calculator "$CONFIRM_SEEDS" "$ROOT.confirm"
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=sampling.tool --band=ci --size=9x5.4 --dpi=70 \
  --tags=eval/accuracy,eval/pass@16,rollout/length_mean,tool/used_frac --out="$HERE/curves.png" \
  > /dev/null
python tools/plot.py passk "$ROOT" --group_by=sampling.tool --dpi=70 --out="$HERE/passk.png" > /dev/null
