#!/usr/bin/env bash
# length_bias: GRPO (grpo advantage, seq_mean_token_mean) vs Dr. GRPO (mean_only,
# seq_mean_token_sum_norm) vs DAPO's token_mean (grpo advantage), 3 seeds, 500 RL updates, on the
# reverse task with a 16-token completion budget (the task's own is 6: answer + eos), so that
# completions can run past the answer.
# Outputs go under $ROOT (default /tmp/jaxrl_experiments/length_bias); figures here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
COMMON=sampling.max_new_tokens=16,train.num_steps=500,train.eval_every=50,train.log_every=10

for arm in grpo:seq_mean_token_mean mean_only:seq_mean_token_sum_norm grpo:token_mean; do
  adv=${arm%%:*} agg=${arm##*:}
  python tools/sweep.py --config=configs/default.py --root="$ROOT/$adv,$agg" --parallel=2 \
    --grid=seed=0,1,2 --set=advantage.name=$adv,aggregation.name=$agg --set=$COMMON
done

G=advantage.name,aggregation.name
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/length.csv" \
  --cols=rollout/length_incorrect_mean@avg:10-50,rollout/length_incorrect_mean@avg:200-250,rollout/length_incorrect_mean@avg:450-500,rollout/length_correct_mean@avg:450-500,rollout/length_max@avg:450-500,rollout/truncated_frac@avg
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/accuracy.csv" \
  --cols=eval/accuracy@0,eval/accuracy@100,eval/accuracy@200,eval/accuracy@300,eval/accuracy@final,eval/length_mean@final
python tools/plot.py curves "$ROOT" --group_by=$G --band=std --size=9x6.5 --dpi=70 --smooth=0.6 \
  --tags=rollout/length_incorrect_mean,rollout/length_correct_mean,rollout/length_max,eval/accuracy \
  --out="$HERE/curves.png"
