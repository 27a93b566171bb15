# Sourced by each study's run.sh: HERE is the study folder, the working directory becomes the
# repository root, outputs go under $ROOT (default /tmp/jaxrl_experiments/<study>; a relative
# one is read from the caller's directory), and a
# persistent XLA cache beside it lets later seeds reuse the first seed's compiled programs
# (results unchanged). CONFIRM other than 0 or 1 (below) is one `error:` line and exit 2.
case ${CONFIRM:-0} in
  0 | 1) ;;
  *)
    echo "error: CONFIRM=$CONFIRM; allowed: 0 | 1 (1: also the confirmation on fresh seeds)" >&2
    exit 2 ;;
esac
HERE=$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)
case ${ROOT:-/} in  # a relative ROOT is the caller's, before the cd below
  /*) ;;
  *) ROOT=$PWD/$ROOT ;;
esac
cd "$HERE/../.."
ROOT=${ROOT:-/tmp/jaxrl_experiments/$(basename "$HERE")}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$ROOT.jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5
mkdir -p "$(dirname "$ROOT")"  # its logs and cache lie beside it
# CONFIRM=1 (each run.sh): the study also trains the arms its claims.json names on fresh seeds
# 100-123 and writes confirmation.md. Unset, it runs its 8 exploration seeds only (the 15-minute
# CPU setting). The 32-seed "headline" runs that pooled the exploration seeds were withdrawn:
# a verdict comes only from seeds its claims did not see.

# tool_arms TOOL SEEDS ROOT (the tool studies): the two packs of SEEDS under ROOT on the
# countdown testbed, without a tool (sampling.tool=none: $COMMON) and with TOOL ($COMMON and
# $TOOL, the study's settings), each pack's output in ROOT.<tool>.log.
tool_arms() {
  local tool sets
  for tool in none "$1"; do
    sets=(--set="$COMMON")
    [ "$tool" = none ] || sets+=(--set="$TOOL")
    python tools/sweep.py --config=configs/countdown.py --root="$3/sampling.tool=$tool" --packed \
      --seeds="$2" "${sets[@]}" > "$3.$tool.log" 2>&1
  done
}

# write_if_ok FILE COMMAND...: COMMAND's output becomes FILE only when COMMAND succeeds; where it
# fails, FILE (a committed table) is kept as it was, and its exit status is returned.
write_if_ok() {
  local out=$1 rc=0
  shift
  "$@" > "$out.tmp" || rc=$?
  if [ "$rc" -eq 0 ]; then
    mv "$out.tmp" "$out"
  else
    rm -f "$out.tmp"
    echo "error: $out kept as it was: the command that writes it failed (exit $rc)" >&2
  fi
  return "$rc"
}
