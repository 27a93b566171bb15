#!/usr/bin/env bash
# The runs of real_calc_collapse.md: configs/smollm2_arith.py:calc at 30 updates, with the format
# reward (task.reward_weights.answer_line_format 0.2, the setting's) and without it (0.0), at
# the declared fresh seeds 8-31, then the declared claim's table (experiments/seed_table.py
# --claims=experiments/tool_use/real_calc_collapse.claims.json).
#
#   bash experiments/tool_use/real_calc_collapse.sh          # this CPU: one run at a time
#   SEEDS="8 9" bash experiments/tool_use/real_calc_collapse.sh
#   TABLES_ONLY=1 bash experiments/tool_use/real_calc_collapse.sh
#
# Runs go one after another, seed by seed, the format term's arm first (python
# tools/get_smollm2.py first); each alone took 487-966 s on a 2-core CPU, longer where the
# completions are longer. A run that ended (exit 0) is kept and skipped when the script is
# started again; one that did not is started afresh. Each run's exit status and seconds are
# appended to $ROOT.queue.txt. Outputs under $ROOT (default
# /tmp/calc_collapse), a compilation cache beside it, the tables on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=${ROOT:-/tmp/calc_collapse}
SEEDS=${SEEDS:-$(seq 8 31)}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$ROOT.jax_cache}
mkdir -p "$ROOT"
if [ "${TABLES_ONLY:-0}" != 1 ]; then
  for seed in $SEEDS; do
    for w in 0.2 0.0; do
      name=fmt${w}_s$seed
      grep -q "^$name rc=0 " "$ROOT.queue.txt" 2>/dev/null && continue
      rm -rf "${ROOT:?}/$name"
      start=$(date +%s)
      rc=0
      python -m jaxrl_llm.main --config=configs/smollm2_arith.py:calc --workdir="$ROOT/$name" \
        --config.seed="$seed" --config.train.num_steps=30 \
        --config.task.reward_weights.answer_line_format="$w" > "$ROOT/$name.log" 2>&1 || rc=$?
      echo "$name rc=$rc $(($(date +%s) - start))s $(date -u +%H:%M:%S)" >> "$ROOT.queue.txt"
    done
  done
fi
COLS=eval/accuracy@0,eval/accuracy@final,eval/reward/answer_line_format@final
COLS=$COLS,tool/used_frac@avg,tool/used_frac@final,tool/error_frac@avg,rollout/accuracy@avg
COLS=$COLS,rollout/length_mean@final
python experiments/seed_table.py --root="$ROOT" --per_seed --cols=$COLS \
  --claims=experiments/tool_use/real_calc_collapse.claims.json
