#!/usr/bin/env bash
# Every GPU figure of docs/performance.md, in one invocation on a GPU machine,
# each step under its own time limit and within an overall deadline:
#
#   bash tools/gpu_card.sh wheels                  # here, beforehand: the wheels the image lacks
#   bash tools/gpu_card.sh rehearse [STEP ...]     # here, beforehand: the steps on this CPU
#   BUDGET_S=540 bash tools/gpu_card.sh [STEP ... | all]   # on the GPU machine
#
# `rehearse` runs the steps' own command lines at tiny shapes (bench's `tiny`, a pack of 2, a
# small grouped matmul) under the GPU image's versions (the venv `tools/gpu_smollm2.sh venv`
# makes), with the wheels installed from $WHEELS as there and the TRL peer in this machine's
# Python (torch is not in that venv), into /tmp/gpu_card_rehearse: what a jax, flax or TRL release
# of the image breaks shows here before device time is spent. Compile-only steps need a GPU.
#
# Steps run in the order given (default: preflight grouped pack16 decode256_only
# decode256_pallas qwen15_auto qwen05_static_trl, the order of value for one 9-minute invocation;
# `all`: every step):
#   preflight       imports every module a step needs (a missing wheel stops nothing else)
#   pack16          tools/bench_pack.py: a pack of 16 default-config runs against 16 alone
#   decode256_only  qwen2.5-0.5b at 256 sequences, the sampler alone (bench --sample_only) with
#                   einsum attention (model.attention=einsum: `auto` would pick Pallas): the
#                   decode goal's shape, without compiling the fused step
#   decode256_pallas the same with the Pallas decode kernel over filled slots
#                   (model.attention=pallas; the einsum step is decode256_only)
#   qwen15_auto     qwen2.5-1.5b with learner slices sized by the device (rl.microbatch_tokens=auto)
#   qwen05_static_trl qwen2.5-0.5b against the stronger peer: TRL with transformers'
#                   static-cache compiled generation, bfloat16 storage on both sides
#   checks          tools/device_check.py: every fast path `auto` may choose, against its reference
#   grouped         the grouped matmul at E=64, M=16,384, K=1024, N=384, timed back to back and by
#                   CUPTI (the 2026-11-26 figures waited for every call: host time included)
#   grouped_sweep   the three Mosaic kernels over block sizes at that shape, each setting's time
#                   and error against `jax.lax.ragged_dot` (the sizes in use were tuned at
#                   M=137,728 on an H100)
#   moe_plan        compile-only plan on this GPU (tools/memory_table.py --targets=gpu:1) of
#                   dense-e64-twin and moe-e64: their peaks side by side, no step run (XLA's
#                   autotuning off, so it runs beside a timed step without touching the card)
#   pack_plan       likewise, Qwen2.5-7B with an int8 base and rank-16 adapters, a pack of 2 runs
#                   of 64 x (512 + 4,096) tokens: the adapter pack's 80 GB claim on a GPU compiler
#   guard_plan      likewise, Qwen2.5-7B at that length in float32 with the non-finite guard's
#                   update held for its check and computed twice (--guard=held,twice): which form
#                   the GPU compiler plans less for (optim.RECOMPUTE_ON; docs/cpu_runs/guard_memory)
#   pack_medium     tools/bench_pack.py --shape=medium --runs=8: a pack of 8 against 8 runs alone,
#                   all at once and 2 at a time (mesh.runs_at_once)
#   pack_qwen05     the same at qwen2.5-0.5b, a pack of 4 (three compiles: give it half an invocation)
#   moe, dense_twin tools/bench.py at moe-e64 (Mosaic grouped matmuls) and its dense twin
#   decode256       qwen2.5-0.5b at 256 sequences (rl.num_prompts=32): the decode goal's shape
#   decode256_kv0   the same with the whole-cache decode (sampling.kv_block=0): the staged
#                   decode's before
#   qwen15_trl      qwen2.5-1.5b against TRL
#   lora15_trl      qwen2.5-1.5b with rank-16 adapters against TRL + PEFT
#   qwen15_noremat  qwen2.5-1.5b with rl.remat=none: the learner's FLOP/s without recomputation
#   qwen05_bf16_trl qwen2.5-0.5b with bfloat16 storage on both sides (model.param_dtype): the
#                   peak-memory ratio where weights and Adam state are not already 0.65x of TRL's
#   qwen05, qwen15  (measured once) qwen2.5-0.5b against TRL with a profile of one warm step;
#                   qwen2.5-1.5b
# Wheels in $WHEELS (default .whl/, ignored by git: name it in the call's carry) that the machine
# lacks go to $SITE first, once per machine (tools/gpu_wheels.sh: a copy beside waits for the
# other's install); gather them beforehand with `bash tools/gpu_card.sh wheels` (or
# `bash tools/gpu_smollm2.sh prepare`, which pins the versions installed here)
# (grain 0.2.18 and datasets 5.2 with what they need that the 2026-11 CUDA image lacks; peft,
# torch and transformers are in it).
# An invocation may run 10 minutes and the machine is held 15 in all: compile-only steps can run in
# a second copy beside the timed ones (with its own OUT), e.g.
#   (OUT=$OUT/a bash tools/gpu_card.sh moe_plan pack_plan > /dev/null 2>&1) &
#   OUT=$OUT/b bash tools/gpu_card.sh preflight checks decode256 qwen15_trl; wait
# Results go to $OUT (or /tmp/gpu_card): the step running writes its stdout (a bench's raw JSON)
# into $OUT/NAME.json and its stderr into $OUT/NAME.log as it runs; once it ends they move into
# $OUT/card.tgz (rewritten after every step) and one line goes to $OUT/steps.txt. So $OUT holds at
# most 4 files whatever the steps (a call brings back 8: room for a second copy in $OUT/a), and a
# call cut off keeps every finished step and the running one's output so far. Unpack card.tgz
# and commit it raw under docs/gpu_runs/.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = wheels ]; then  # on a machine with the package index, before the GPU invocation
  # the pinned versions for the image's Python (3.12), whatever this machine's Python is
  exec bash tools/gpu_smollm2.sh prepare
fi
REHEARSE=""
if [ "${1:-}" = rehearse ]; then  # here, on this CPU: the steps' own command lines at tiny shapes
  shift
  HOST_PY=$(command -v python3)  # the TRL peer's Python: torch is not in the image's venv here
  VENV=$(bash tools/gpu_smollm2.sh venv) || exit 2
  export PATH="$VENV/bin:$PATH"
  REHEARSE=1 OUT=${OUT:-/tmp/gpu_card_rehearse} SITE=${SITE:-/tmp/gpu_card_rehearse/site}
fi
OUT=${OUT:-/tmp/gpu_card}
BUDGET_S=${BUDGET_S:-540}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/jaxrl_llm_site}
DONE=${DONE:-/tmp/gpu_card_done/$$}  # the finished steps' files, archived into $OUT/card.tgz
mkdir -p "$OUT" "$DONE"
START=$(date +%s)
# No preallocation: the TRL peer shares the card with our process, and the peaks are real use.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false XLA_PYTHON_CLIENT_PREALLOCATE=false
source tools/gpu_wheels.sh
install_wheels >&2
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# step NAME LIMIT_S[:NEED_S] CMD...: runs CMD with its stdout straight into $OUT/NAME.json (a
# bench's raw JSON, written as the step runs) and its stderr into $OUT/NAME.log, under
# min(LIMIT_S, what is left of BUDGET_S); prints how it ended, appends it to $OUT/steps.txt, then
# archives them. A step is skipped when less than NEED_S (default 20) is left: one that would be
# cut before it prints anything (a peer comparison) leaves the time to the next invocation.
step() {
  local name=$1 limit=${2%%:*} need=20
  [ "$2" != "$limit" ] && need=${2#*:} && need=${need:-20}
  shift 2
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt "$need" ]; then
    echo "== $name: skipped, ${left}s left (it needs ${need}s)" | tee -a "$OUT/steps.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
  local rc=$?
  echo "== $name: rc=$rc in $(($(date +%s) - t0))s (limit ${limit}s)" | tee -a "$OUT/steps.txt"
  tail -c 1500 "$OUT/$name.json"
  [ "$rc" -ne 0 ] && grep -v '^    @' "$OUT/$name.log" | tail -n 8
  archive
}

# archive: every file the finished step left in $OUT (its JSON and log, a tool's own output file)
# moves into $DONE, and $OUT/card.tgz is rewritten from it (a new file, then renamed: a call cut
# off mid-write keeps the previous archive).
archive() {
  find "$OUT" -maxdepth 1 -type f ! -name card.tgz ! -name steps.txt ! -name '.*' \
    -exec mv -t "$DONE" {} +
  tar czf "$OUT/.card.tgz" -C "$DONE" . && mv "$OUT/.card.tgz" "$OUT/card.tgz"
}

STEPS=("$@")
# The machine first, into steps.txt too (a copy run beside needs no file for its stdout).
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -n 1
} | tee -a "$OUT/steps.txt"
# XLA's GPU autotuning results, kept per fusion as each is tuned: a step cut off while compiling
# leaves them for the next invocation on the same machine (timings do not depend on it). Set only
# where this XLA knows the flag (an unknown flag stops every program).
TUNE="--xla_gpu_per_fusion_autotune_cache_dir=${AUTOTUNE_DIR:-/tmp/gpu_card_autotune}"
if XLA_FLAGS="${XLA_FLAGS:-} $TUNE" python3 -c "import jax; jax.jit(lambda x: x + 1)(1.0)" \
  >/dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} $TUNE"
  echo "autotune cache: ${TUNE#*=}"
fi
# JAX's persistent compilation cache: a step cut off after compiling skips its compile when run
# again on the same machine (its bench JSON's compile_s is then the cache's load time).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/gpu_card_jax_cache}
# Compile-only steps run beside timed ones: with autotuning off they run nothing on the card.
NOTUNE=""
if XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  python3 -c "import jax; jax.jit(lambda x: x + 1)(1.0)" >/dev/null 2>&1; then
  NOTUNE="--xla_gpu_autotune_level=0"
fi
PLAN=(env "XLA_FLAGS=${XLA_FLAGS:-} $NOTUNE" python3 tools/memory_table.py --targets=gpu:1)
LONG=(--prompt_len=512 --new_tokens=4096 --set=model.scan_layers=true
  --set=sampling.param_dtype=bfloat16 --set=model.param_dtype=bfloat16)
B05=(--shape=qwen2.5-0.5b --steps=2)
B15=(--shape=qwen2.5-1.5b --steps=2)
B256=("${B05[@]}" --set=rl.num_prompts=32)  # 256 sequences
GROUPED=(--rows=16384 --k=1024 --n=384 --experts=64)
PACK16=(--shape=default --runs=16 --steps=3)
PEER=()
if [ -n "$REHEARSE" ]; then  # the same command lines at sizes this CPU runs in seconds
  B05=(--shape=tiny --steps=2)
  B15=("${B05[@]}")
  B256=("${B05[@]}" --set=rl.num_prompts=4)
  GROUPED=(--rows=512 --k=64 --n=32 --experts=4)
  PACK16=(--shape=default --runs=2 --steps=2)
  PEER=(--peer_python="$HOST_PY")
fi
# run_step NAME: one step by name (the names above; anything else is refused in one line).
run_step() {
  case $1 in
    preflight) step preflight 60 python3 -c "$PREFLIGHT" "${MODULES[@]}" ;;
    pack16)
      step pack16 240 python3 tools/bench_pack.py "${PACK16[@]}" ;;
    decode256_only)  # einsum, the reference: `auto` picks the Pallas kernel where it is verified
      step decode256_only 150 python3 tools/bench.py "${B256[@]}" --sample_only \
        --set=model.attention=einsum ;;
    decode256_pallas)
      step decode256_pallas 150 python3 tools/bench.py "${B256[@]}" --sample_only \
        --set=model.attention=pallas ;;
    qwen05_static_trl)
      step qwen05_static_trl 300:240 python3 tools/bench.py "${B05[@]}" --peer=trl --peer_cache=static \
        --peer_timeout_s=200 --set=model.param_dtype=bfloat16 "${PEER[@]}" ;;
    checks) step checks 150 python3 tools/device_check.py --json="$OUT/device_checks.json" ;;
    grouped) step grouped 60 python3 tools/bench_grouped.py "${GROUPED[@]}" --iters=20 ;;
    grouped_sweep)
      step grouped_sweep 120 python3 tools/bench_grouped.py "${GROUPED[@]}" --iters=10 --sweep ;;
    moe_plan) step moe_plan 300 "${PLAN[@]}" --shapes=dense-e64-twin,moe-e64 ;;
    pack_plan)
      step pack_plan 300 "${PLAN[@]}" --shapes=qwen2.5-7b "${LONG[@]}" \
        --set=model.lora_rank=16 --set=model.lora_base_dtype=int8 --runs=2 ;;
    guard_plan)
      step guard_plan 300 "${PLAN[@]}" --shapes=qwen2.5-7b "${LONG[@]:0:4}" --guard=held,twice ;;
    pack_medium)
      step pack_medium 300 python3 tools/bench_pack.py --shape=medium --runs=8 --steps=3 \
        --at_once=0,2 ;;
    pack_qwen05)
      step pack_qwen05 420 python3 tools/bench_pack.py --shape=qwen2.5-0.5b --runs=4 --steps=2 ;;
    moe) step moe 240 python3 tools/bench.py --shape=moe-e64 --steps=2 ;;
    dense_twin) step dense_twin 120 python3 tools/bench.py --shape=dense-e64-twin --steps=2 ;;
    decode256) step decode256 300 python3 tools/bench.py "${B256[@]}" ;;
    decode256_kv0)
      step decode256_kv0 300 python3 tools/bench.py "${B256[@]}" --set=sampling.kv_block=0 ;;
    qwen15_trl)
      step qwen15_trl 360 python3 tools/bench.py "${B15[@]}" --peer=trl --peer_timeout_s=240 ;;
    lora15_trl)
      step lora15_trl 360 python3 tools/bench.py "${B15[@]}" --peer=trl --peer_timeout_s=240 \
        --set=model.lora_rank=16 ;;
    qwen15_noremat)
      step qwen15_noremat 240 python3 tools/bench.py "${B15[@]}" --set=rl.remat=none ;;
    qwen05_bf16_trl)
      step qwen05_bf16_trl 270 python3 tools/bench.py "${B05[@]}" --peer=trl \
        --peer_timeout_s=170 --set=model.param_dtype=bfloat16 ;;
    qwen05)
      step qwen05 270 python3 tools/bench.py --shape=qwen2.5-0.5b --steps=3 --peer=trl \
        --peer_timeout_s=170 --profile_dir=/tmp/profile_qwen05
      step qwen05_profile 40 python3 tools/trace_summary.py /tmp/profile_qwen05 --top=12 ;;
    qwen15) step qwen15 240 python3 tools/bench.py "${B15[@]}" ;;
    qwen15_auto)
      step qwen15_auto 300 python3 tools/bench.py "${B15[@]}" --set=rl.microbatch_tokens=auto ;;
    *) echo "== $1: no such step (steps: ${ALL[*]})" ;;
  esac
}
# Every module a step imports, before any step spends its time: a missing wheel is one line (trl
# and peft need torch, which a rehearsal's venv lacks: its peer runs in this machine's Python).
MODULES=(jaxrl_llm.run grain ml_collections trl peft datasets transformers)
[ -n "$REHEARSE" ] && MODULES=(jaxrl_llm.run grain ml_collections datasets transformers)
PREFLIGHT='
import importlib, importlib.metadata as md, sys
missing = []
for m in sys.argv[1:]:
  try:
    importlib.import_module(m)
  except ImportError as err:
    missing.append(f"{m}: {err}")
def version(name):
  try:
    return md.version(name)
  except md.PackageNotFoundError:
    return None
print({n: version(n) for n in ("jax", "grain", "trl", "peft", "datasets", "torch")})
sys.exit("cannot import " + "; ".join(missing) if missing else 0)'
# The default, in order of value for one invocation of at most 9 minutes (BUDGET_S=540): what no card
# has measured, the goals' shapes, then the stronger peer.
FIRST=(preflight grouped pack16 decode256_only decode256_pallas qwen15_auto qwen05_static_trl)
ALL=("${FIRST[@]}" qwen15 checks grouped_sweep moe_plan pack_plan guard_plan pack_medium pack_qwen05 moe
  dense_twin decode256 decode256_kv0 qwen15_trl lora15_trl qwen15_noremat qwen05_bf16_trl qwen05)
[ ${#STEPS[@]} -eq 0 ] && STEPS=("${FIRST[@]}")
[ "${STEPS[*]}" = all ] && STEPS=("${ALL[@]}")
for name in "${STEPS[@]}"; do
  run_step "$name"
done
echo "== done in $(($(date +%s) - START))s" | tee -a "$OUT/steps.txt"
