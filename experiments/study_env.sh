# Sourced by each study's run.sh: HERE is the study folder, the working directory becomes the
# repository root, outputs go under $ROOT (default /tmp/jaxrl_experiments/<study>), and a
# persistent XLA cache beside it lets later seeds reuse the first seed's compiled programs
# (results unchanged).
HERE=$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)
cd "$HERE/../.."
ROOT=${ROOT:-/tmp/jaxrl_experiments/$(basename "$HERE")}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$ROOT.jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5
mkdir -p "$(dirname "$ROOT")"  # its logs and cache lie beside it
# HEADLINE=1: the study also runs its headline comparison's arms on seeds 8-31, under
# $ROOT.headline (so 32 seeds each with the 8 under $ROOT), and writes that comparison's tables
# to its headline.md. Unset, it runs its 8 seeds only (the 15-minute CPU setting).
HEADLINE=${HEADLINE:-0}
HEADLINE_SEEDS=$(seq -s, 8 31)
