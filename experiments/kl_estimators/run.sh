#!/usr/bin/env bash
# kl_estimators: Part A (exact, seconds): bias and variance of each KL estimator's gradient under a
# mismatched behaviour policy, by enumeration over a categorical policy. Part B (training): an int8
# sampler, kl.beta=0.1, kl.name=k3 vs k3_is, plus a kl.beta=0 reference, 3 seeds, 400 RL updates.
# Outputs go under $ROOT (default /tmp/jaxrl_experiments/kl_estimators); figures here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
mkdir -p "$ROOT"

# Part A
python experiments/kl_estimators/exact_bias.py --instances=200 | tee "$HERE/exact_bias.md"

# Part B
COMMON=sampling.param_dtype=int8,train.num_steps=400,train.eval_every=50,train.log_every=10
python tools/sweep.py --config=configs/default.py --root="$ROOT/beta0.1" --parallel=2 \
  --grid=seed=0,1,2 --grid=kl.name=k3,k3_is --set=kl.beta=0.1 --set=$COMMON
python tools/sweep.py --config=configs/default.py --root="$ROOT/beta0" --parallel=2 \
  --grid=seed=0,1,2 --set=kl.beta=0.0 --set=$COMMON

G=kl.beta,kl.name
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/training.csv" \
  --cols=eval/accuracy@100,eval/accuracy@200,eval/accuracy@final,kl/ref_kl@100,kl/ref_kl@200,kl/ref_kl@final,kl/ref_kl@avg,policy/entropy@final,behaviour/kl_k3@avg
python tools/plot.py curves "$ROOT" --group_by=$G --band=std --size=9x3.6 --dpi=70 \
  --tags=eval/accuracy,kl/ref_kl --out="$HERE/training.png"
