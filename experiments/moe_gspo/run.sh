#!/usr/bin/env bash
# moe_gspo: on the countdown testbed's MoE twin (configs/countdown.py:moe, 4 experts top-2),
# GRPO without routing replay vs GSPO without replay vs GRPO with R3, with a bfloat16 sampler
# (routing mismatch) and 4 minibatch updates per rollout (3 of them off-policy), 8 seeds each,
# 300 RL updates. Each arm changes the program, so each is its own pack of 8 seeds. Prints the
# tables (tables.md); figure here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)
COMMON=sampling.param_dtype=bfloat16,rl.num_minibatches=4,train.num_steps=300
GSPO=objective.name=gspo,objective.clip_low=3e-4,objective.clip_high=4e-4,aggregation.name=seq_mean

for arm in grpo,none grpo,r3 gspo,none; do
  objective=${arm%%,*} replay=${arm##*,}
  extra=objective.name=ppo_clip
  [ "$objective" = gspo ] && extra=$GSPO
  python tools/sweep.py --config=configs/countdown.py:moe --root="$ROOT/$arm" --packed \
    --seeds=0,1,2,3,4,5,6,7 --set=replay.name=$replay,$extra --set=$COMMON \
    > "$ROOT.$arm.log" 2>&1
done

G=objective.name,replay.name
COLS=eval/accuracy@0,eval/accuracy@150,eval/accuracy@final,eval/pass@4@final
COLS=$COLS,policy/ratio_var@avg,policy/ratio_max@avg,policy/clip_frac@avg
COLS=$COLS,moe/route_disagree_sampler@avg,moe/route_disagree_old@avg,optim/grad_norm@avg
python experiments/seed_table.py --root="$ROOT" --group_by=$G --cols=$COLS --per_seed \
  --baseline=ppo_clip,none --csv="$ROOT/table.csv" \
  --expect=eval/accuracy@final:+,policy/ratio_var@avg:-
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  for arm in grpo,none gspo,none; do
    extra=objective.name=ppo_clip
    [ "${arm%%,*}" = gspo ] && extra=$GSPO
    python tools/sweep.py --config=configs/countdown.py:moe --root="$ROOT.confirm/$arm" \
      --packed --seeds=$CONFIRM_SEEDS --set=replay.name=none,$extra --set=$COMMON \
      > "$ROOT.confirm.$arm.log" 2>&1
  done
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=$G --band=ci --size=9x6.5 --dpi=70 \
  --tags=eval/accuracy,policy/ratio_var,moe/route_disagree_sampler,moe/route_disagree_old \
  --out="$HERE/curves.png" > /dev/null
python tools/plot.py passk "$ROOT" --group_by=$G --dpi=70 --out="$HERE/passk.png" > /dev/null
