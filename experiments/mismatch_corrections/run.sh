#!/usr/bin/env bash
# mismatch_corrections: an int4 sampler (sampling.param_dtype=int4) without correction and with
# tis_token, against a float32 sampler (no mismatch), 8 seeds each, on the countdown testbed
# (configs/countdown.py), 300 RL updates; the exploration adds the sequence-level corrections
# tis_seq and mis_seq (mis_seq also confirmed). Each arm changes the program (sampler dtype,
# correction), so it is its own pack of 8 seeds. Prints the tables (tables.md); figure here.
set -euo pipefail
source "$(dirname "$0")/../study_env.sh"  # HERE, ROOT, the XLA cache; cd to the repo
CONFIRM=${CONFIRM:-0}  # 1: also train the arms claims.json names on fresh seeds (confirmation.md)
CONFIRM_SEEDS=$(seq -s, 100 123)

for arm in float32:none int4:none int4:tis_token int4:tis_seq int4:mis_seq; do
  dtype=${arm%%:*} corr=${arm##*:}
  python tools/sweep.py --config=configs/countdown.py --root="$ROOT/$dtype,$corr" --packed \
    --seeds=0,1,2,3,4,5,6,7 --set=sampling.param_dtype=$dtype,correction.name=$corr \
    --set=train.num_steps=300 > "$ROOT.$dtype,$corr.log" 2>&1
done

G=sampling.param_dtype,correction.name
COLS=eval/accuracy@0,eval/accuracy@150,eval/accuracy@final,eval/pass@4@final
COLS=$COLS,behaviour/kl_k3@avg,behaviour/rho_max@avg,behaviour/frac_truncated@avg
COLS=$COLS,behaviour/frac_masked_seqs@avg
python experiments/seed_table.py --root="$ROOT" --group_by=$G --cols=$COLS --csv="$ROOT/table.csv" \
  --baseline=int4,none --per_seed --expect=eval/accuracy@final:+
if [ "$CONFIRM" = 1 ]; then  # claims.json on fresh seeds 100-123 (confirmation.md)
  for arm in float32:none int4:none int4:tis_token int4:mis_seq; do
    dtype=${arm%%:*} corr=${arm##*:}
    python tools/sweep.py --config=configs/countdown.py --root="$ROOT.confirm/$dtype,$corr" \
      --packed --seeds=$CONFIRM_SEEDS --set=sampling.param_dtype=$dtype,correction.name=$corr \
      --set=train.num_steps=300 > "$ROOT.confirm.$dtype,$corr.log" 2>&1
  done
  write_if_ok "$HERE/confirmation.md" python experiments/seed_table.py --root="$ROOT.confirm" \
    --claims="$HERE/claims.json" \
    --per_seed
fi
python tools/plot.py curves "$ROOT" --group_by=$G --band=ci --size=9x6.5 --dpi=70 \
  --tags=eval/accuracy,behaviour/kl_k3,behaviour/rho_max,behaviour/frac_truncated \
  --out="$HERE/curves.png" > /dev/null
python tools/plot.py passk "$ROOT" --group_by=$G --dpi=70 --out="$HERE/passk.png" > /dev/null
