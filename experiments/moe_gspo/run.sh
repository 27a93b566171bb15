#!/usr/bin/env bash
# moe_gspo: on the 4-expert top-2 MoE policy, GRPO without routing replay vs GSPO without replay
# vs GRPO with R3, with a bfloat16 sampler (routing mismatch) and 4 minibatch updates per rollout
# (3 of them off-policy), 3 seeds, 400 RL updates.
# Outputs go under $ROOT (default /tmp/jaxrl_experiments/moe_gspo); figures here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
COMMON=sampling.param_dtype=bfloat16,rl.num_minibatches=4,train.num_steps=400,train.eval_every=50,train.log_every=10

# GRPO (configs/moe_default.py: grpo advantage, ppo_clip 0.2/0.2, seq_mean_token_mean) with
# replay none and r3; GSPO (configs/moe_gspo.py: gspo 3e-4/4e-4, seq_mean) with replay none.
python tools/sweep.py --config=configs/moe_default.py --root="$ROOT/grpo" --parallel=2 \
  --grid=seed=0,1,2 --grid=replay.name=none,r3 --set=$COMMON
python tools/sweep.py --config=configs/moe_gspo.py --root="$ROOT/gspo" --parallel=2 \
  --grid=seed=0,1,2 --set=replay.name=none --set=$COMMON

G=objective.name,replay.name
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/accuracy.csv" \
  --cols=eval/accuracy@0,eval/accuracy@100,eval/accuracy@200,eval/accuracy@300,eval/accuracy@final,eval/pass@4@final
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/ratios.csv" \
  --cols=policy/ratio_var@avg,policy/ratio_max@avg,policy/clip_frac@avg,policy/seq_ratio_mean@avg,moe/route_disagree_sampler@avg,moe/route_disagree_old@avg,moe/router_prefers_other@avg,optim/grad_norm@avg
python tools/plot.py curves "$ROOT" --group_by=$G --band=std --size=9x6.5 --dpi=70 \
  --tags=eval/accuracy,policy/ratio_var,moe/route_disagree_sampler,moe/route_disagree_old \
  --out="$HERE/curves.png"
