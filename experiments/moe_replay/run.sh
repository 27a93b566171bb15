#!/usr/bin/env bash
# moe_replay: on the countdown testbed's MoE twin (configs/countdown.py:moe, 4 experts top-2),
# GRPO with routing replay (R3: the learner routes each token through the experts the sampler
# chose) vs without, float32 sampler (sampler and learner route alike on the first minibatch)
# and 4 minibatch updates per rollout (the later ones off-policy, where the learner's routing
# drifts from the rollout's), 8 seeds each, 300 RL updates; one pack per arm. Prints the tables
# (tables.md); figure here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)

for replay in none r3; do
  python tools/sweep.py --config=configs/countdown.py:moe --root="$ROOT/$replay" --packed \
    --seeds=0,1,2,3,4,5,6,7 --set=replay.name=$replay,rl.num_minibatches=4 \
    --set=train.num_steps=300 > "$ROOT.$replay.log" 2>&1
done

COLS=eval/accuracy@0,eval/accuracy@150,eval/accuracy@final,policy/ratio_var@avg
COLS=$COLS,policy/clip_frac@avg,moe/route_disagree_old@avg,moe/router_prefers_other@avg
python experiments/seed_table.py --root="$ROOT" --group_by=replay.name --cols=$COLS --per_seed \
  --baseline=none --csv="$ROOT/table.csv" --expect=policy/ratio_var@avg:-,eval/accuracy@final:+
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  for replay in none r3; do
    python tools/sweep.py --config=configs/countdown.py:moe --root="$ROOT.confirm/$replay" \
      --packed --seeds=$CONFIRM_SEEDS --set=replay.name=$replay,rl.num_minibatches=4 \
      --set=train.num_steps=300 > "$ROOT.confirm.$replay.log" 2>&1
  done
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=replay.name --band=ci --size=9x3.6 --dpi=70 \
  --tags=eval/accuracy,policy/ratio_var --out="$HERE/curves.png" > /dev/null
python tools/plot.py passk "$ROOT" --group_by=replay.name --dpi=70 --out="$HERE/passk.png" > /dev/null
