#!/usr/bin/env bash
# Ours vs TRL's GRPOTrainer at Qwen2.5 shapes on one GPU, in one command from the repo root:
#
#   bash tools/gpu_bench.sh [SHAPE ...]        # default: qwen2.5-0.5b qwen2.5-1.5b
#
# For a machine with jax (CUDA), flax, optax, orbax, chex, torch and transformers installed. It
# first installs, from the wheel folder $WHEELS (default .whl/), only the wheels whose
# distribution is not installed yet, into $SITE (default /tmp/jaxrl_llm_site, put on PYTHONPATH;
# no index, no dependencies: the machine's own packages are neither replaced nor touched),
# then runs `tools/bench.py --shape=SHAPE --peer=trl` for each shape. Each shape's JSON goes to
# stdout (and to $OUT/bench_SHAPE.json when $OUT is set); logs go to stderr.
# Environment: STEPS (warm steps, default 3), PEER_TIMEOUT_S (default 420), WHEELS, OUT, and
# EXTRA (more bench.py flags, e.g. "--hbm_bytes_per_s=3.0e12 --peak_flops=8.0e14").
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
STEPS=${STEPS:-3}
PEER_TIMEOUT_S=${PEER_TIMEOUT_S:-420}
SITE=${SITE:-/tmp/jaxrl_llm_site}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
SHAPES=("$@")
[ ${#SHAPES[@]} -eq 0 ] && SHAPES=(qwen2.5-0.5b qwen2.5-1.5b)

if [ -d "$WHEELS" ]; then
  missing=$(python3 - "$WHEELS" <<'PY'
import glob, importlib.metadata as md, os, re, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
  name = re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()
  try:
    md.version(name)
  except md.PackageNotFoundError:
    print(path)
PY
)
  if [ -n "$missing" ]; then
    echo "installing:" $missing >&2
    # shellcheck disable=SC2086
    python3 -m pip install --quiet --no-deps --no-index --target "$SITE" $missing >&2
  fi
fi
python3 - >&2 <<'PY'
import importlib.metadata as md
names = ["jax", "jaxlib", "flax", "optax", "torch", "transformers", "trl", "datasets",
         "accelerate", "grain", "ml_collections", "tensorboard", "pyarrow", "huggingface-hub"]
found = {}
for n in names:
  try:
    found[n] = md.version(n)
  except md.PackageNotFoundError:
    found[n] = None
print("versions:", found)
PY
for shape in "${SHAPES[@]}"; do
  echo "== $shape" >&2
  # shellcheck disable=SC2086
  result=$(python3 tools/bench.py --shape="$shape" --peer=trl --steps="$STEPS" \
    --peer_timeout_s="$PEER_TIMEOUT_S" ${EXTRA:-})
  echo "$result"
  if [ -n "${OUT:-}" ]; then
    echo "$result" >"$OUT/bench_$shape.json"
  fi
done
