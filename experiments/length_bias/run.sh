#!/usr/bin/env bash
# length_bias: GRPO (grpo advantage, seq_mean_token_mean) vs Dr. GRPO (mean_only,
# seq_mean_token_sum_norm) vs DAPO's token_mean (grpo advantage), 8 seeds each, on the countdown
# testbed (configs/countdown.py) with a 12-token completion budget (the longest correct answer
# is 5 tokens + eos), so that completions can run on. The arms change the program (advantage,
# aggregation), so each is its own pack of 8 seeds. Prints the tables (tables.md); figure here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)
COMMON=sampling.max_new_tokens=12,train.num_steps=300

for arm in grpo:seq_mean_token_mean mean_only:seq_mean_token_sum_norm grpo:token_mean; do
  adv=${arm%%:*} agg=${arm##*:}
  python tools/sweep.py --config=configs/countdown.py --root="$ROOT/$adv,$agg" --packed \
    --seeds=0,1,2,3,4,5,6,7 --set=advantage.name=$adv,aggregation.name=$agg --set=$COMMON \
    > "$ROOT.$adv,$agg.log" 2>&1
done

G=advantage.name,aggregation.name
COLS=rollout/length_incorrect_mean@10,rollout/length_incorrect_mean@avg:140-160
COLS=$COLS,rollout/length_incorrect_mean@avg:280-300,rollout/length_correct_mean@avg:280-300
COLS=$COLS,rollout/truncated_frac@avg:280-300,eval/accuracy@0,eval/accuracy@final
python experiments/seed_table.py --root="$ROOT" --group_by=$G --cols=$COLS --csv="$ROOT/table.csv" \
  --baseline=mean_only,seq_mean_token_sum_norm --per_seed \
  --expect=rollout/length_incorrect_mean@avg:280-300:+
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  for arm in grpo:seq_mean_token_mean mean_only:seq_mean_token_sum_norm; do
    adv=${arm%%:*} agg=${arm##*:}
    python tools/sweep.py --config=configs/countdown.py --root="$ROOT.confirm/$adv,$agg" \
      --packed --seeds=$CONFIRM_SEEDS --set=advantage.name=$adv,aggregation.name=$agg \
      --set=$COMMON > "$ROOT.confirm.$adv,$agg.log" 2>&1
  done
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=$G --band=ci --size=9x6.5 --dpi=70 \
  --smooth=0.6 --out="$HERE/curves.png" > /dev/null \
  --tags=rollout/length_incorrect_mean,rollout/length_correct_mean,rollout/truncated_frac,eval/accuracy
python tools/plot.py passk "$ROOT" --group_by=$G --dpi=70 --out="$HERE/passk.png" > /dev/null
