#!/usr/bin/env bash
# kl_estimators: Part A (exact, seconds): bias and variance of each KL estimator's gradient under a
# mismatched behaviour policy, by enumeration over a categorical policy. Part B (training): an int8
# sampler, kl.beta=0.1, kl.name=k3 vs k3_is, plus a kl.beta=0 reference, 8 seeds, 300 RL updates.
# Outputs go under $ROOT (default /tmp/jaxrl_experiments/kl_estimators); figures here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)
mkdir -p "$ROOT"

# Part A
python experiments/kl_estimators/exact_bias.py --instances=200 | tee "$HERE/exact_bias.md"

# Part B: on the countdown testbed (configs/countdown.py), an int8 sampler, kl.beta=0.1 with k3
# or k3_is, and a kl.beta=0 reference, 8 seeds each, 300 RL updates; each arm its own pack.
for arm in 0.1:k3 0.1:k3_is 0.0:k3; do
  beta=${arm%%:*} est=${arm##*:}
  python tools/sweep.py --config=configs/countdown.py --root="$ROOT/$beta,$est" --packed \
    --seeds=0,1,2,3,4,5,6,7 --set=kl.beta=$beta,kl.name=$est,sampling.param_dtype=int8 \
    --set=train.num_steps=300 > "$ROOT.$beta,$est.log" 2>&1
done

G=kl.beta,kl.name
COLS=eval/accuracy@0,eval/accuracy@150,eval/accuracy@final,kl/ref_kl@150,kl/ref_kl@final
COLS=$COLS,kl/ref_kl@avg,policy/entropy@final,behaviour/kl_k3@avg
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/training.csv" \
  --cols=$COLS --baseline=0.1,k3 --per_seed --expect=kl/ref_kl@final:-
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  for est in k3 k3_is; do
    python tools/sweep.py --config=configs/countdown.py --root="$ROOT.confirm/0.1,$est" \
      --packed --seeds=$CONFIRM_SEEDS --set=kl.beta=0.1,kl.name=$est,sampling.param_dtype=int8 \
      --set=train.num_steps=300 > "$ROOT.confirm.0.1,$est.log" 2>&1
  done
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=$G --band=ci --size=9x3.6 --dpi=70 \
  --tags=eval/accuracy,kl/ref_kl --out="$HERE/training.png" > /dev/null
python tools/plot.py passk "$ROOT" --group_by=$G --dpi=70 --out="$HERE/passk.png" > /dev/null
