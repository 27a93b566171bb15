#!/usr/bin/env bash
# mismatch_corrections: an int8 sampler (sampling.param_dtype=int8) with correction.name
# none | tis_token | mis_seq | mis_seq+geo_mask, a bfloat16 sampler without correction, and a
# float32-sampler reference (no mismatch),
# 3 seeds each, default task and model, 400 RL updates.
# Outputs go under $ROOT (default /tmp/jaxrl_experiments/mismatch_corrections); figures here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
STEPS=train.num_steps=400,train.eval_every=50,train.log_every=10

python tools/sweep.py --config=configs/default.py --root="$ROOT/int8" --parallel=2 \
  --grid=seed=0,1,2 --grid=correction.name=none,tis_token,mis_seq,mis_seq+geo_mask \
  --set=sampling.param_dtype=int8 --set=$STEPS
python tools/sweep.py --config=configs/default.py --root="$ROOT/uncorrected" --parallel=2 \
  --grid=seed=0,1,2 --grid=sampling.param_dtype=float32,bfloat16 --set=correction.name=none --set=$STEPS

G=sampling.param_dtype,correction.name
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/accuracy.csv" \
  --cols=eval/accuracy@0,eval/accuracy@100,eval/accuracy@200,eval/accuracy@300,eval/accuracy@final,eval/pass@4@final
python experiments/seed_table.py --root="$ROOT" --group_by=$G --csv="$ROOT/behaviour.csv" \
  --cols=behaviour/kl_k3@avg,behaviour/mismatch_max@avg,behaviour/rho_mean@avg,behaviour/rho_max@avg,behaviour/frac_truncated@avg,behaviour/frac_masked_seqs@avg,behaviour/ess@avg,policy/ratio_var@avg
python tools/plot.py curves "$ROOT" --group_by=$G --band=std --size=9x6.5 --dpi=70 \
  --tags=eval/accuracy,behaviour/kl_k3,behaviour/rho_max,behaviour/frac_masked_seqs \
  --out="$HERE/curves.png"
