#!/usr/bin/env bash
# Runs every study (its sweep, tables and figures), one after the other, from the repository.
# Each study writes under $ROOT_BASE/<study> (default /tmp/jaxrl_experiments; a relative one is
# read from the directory run_all.sh is called from), its log in $ROOT_BASE.<study>.log, and puts its
# figures in its own folder; `STUDIES="clip_higher length_bias" bash experiments/run_all.sh`
# runs some of them (STUDIES unset: all; set but empty is refused). A study that fails is
# reported and the others still run. Where a study's tables.md existed, the new one is compared
# with it first (compare_tables.py: every mean within the old interval's half-width) and the
# summary line printed; `git diff` shows the rest.
# `CONFIRM=1` also runs each study's confirmation on fresh seeds 100-123 (its confirmation.md,
# the only source of a verdict; about twice a study's time again).
# A study interrupted (Ctrl-C or SIGTERM, to run_all.sh or to the study: exit 130 or 143) is
# reported as interrupted, not failed, and the studies after it do not start; run_all.sh then
# exits 130. A study killed otherwise (e.g. SIGKILL by the out-of-memory killer: exit 137) is a
# failed study: reported with its exit status, and the others still run.
# A study that exits 0 but prints no Markdown table (or one compare_tables.py cannot read) is
# failed too: its committed tables.md is kept as it was and its output is left in
# <study>/tables.md.new to look at.
# A bad input (an argument, an unknown study in STUDIES, CONFIRM other than 0 or 1, a ROOT_BASE
# it cannot create) is one `error:` line and exit 2, before any study starts.
set -uo pipefail
ROOT_BASE=${ROOT_BASE:-/tmp/jaxrl_experiments}
case $ROOT_BASE in  # a relative one is the caller's, before the cd below (a study cds elsewhere)
  /*) ;;
  *) ROOT_BASE=$PWD/$ROOT_BASE ;;
esac
cd "$(dirname "$0")"
ALL=$(for d in */run.sh; do dirname "$d"; done | tr '\n' ' ')
fail() {
  echo "error: $*" >&2
  exit 2
}
[ $# -eq 0 ] || fail "run_all.sh takes no arguments, got: $*; pick studies with" \
  "STUDIES=\"a b\" (allowed: ${ALL% })"
STUDIES=${STUDIES-$ALL}  # unset: every study; set but empty is refused, not read as every one
[ -n "${STUDIES//[[:space:]]/}" ] ||
  fail "STUDIES is empty; name the studies to run, or leave it unset for all (allowed: ${ALL% })"
for study in $STUDIES; do
  [ -f "$study/run.sh" ] || fail "STUDIES names '$study', which is no study; allowed: ${ALL% }"
done
case ${CONFIRM:-0} in
  0 | 1) ;;
  *) fail "CONFIRM=$CONFIRM; allowed: 0 | 1 (1: also the confirmation on fresh seeds)" ;;
esac
mkdir -p "$ROOT_BASE" 2>/dev/null ||
  fail "ROOT_BASE=$ROOT_BASE: cannot create it; want a folder this user can write"
failed=()
interrupted=""
child=""
# Ctrl-C or SIGTERM to run_all.sh stops the running study (its own process group: the sweep's
# trainers save their step and exit) and no other starts.
trap 'interrupted=${interrupted:-run_all.sh}; [ -n "$child" ] && kill -TERM -- "-$child" 2>/dev/null' INT TERM
set -m  # each study in its own process group, so the signal reaches its trainers too
for study in $STUDIES; do
  echo "== $study"
  start=$(date +%s)
  ROOT="$ROOT_BASE/$study" bash "$study/run.sh" > "$study/tables.md.new" 2> "$ROOT_BASE.$study.log" &
  child=$!
  wait "$child"
  rc=$?
  while kill -0 "$child" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for it to stop
    wait "$child"
    rc=$?
  done
  child=""
  if [ "$rc" -eq 130 ] || [ "$rc" -eq 143 ] || [ -n "$interrupted" ]; then  # Ctrl-C, SIGTERM
    rm -f "$study/tables.md.new"
    echo "   INTERRUPTED after $(( $(date +%s) - start )) s (exit $rc; log: $ROOT_BASE.$study.log): its committed tables are unchanged"
    interrupted=$study
    break
  fi
  if [ "$rc" -eq 0 ]; then
    # An output without a table (a study that printed nothing), or one compare_tables.py cannot
    # read (exit 2), is not written over the committed tables.
    bad=""
    if ! grep -q '^|' "$study/tables.md.new"; then
      bad="its output has no Markdown table (no line starting with |)"
    elif [ -f "$study/tables.md" ]; then  # against the committed tables (compare_tables.py)
      summary=$(python compare_tables.py "$study/tables.md" "$study/tables.md.new" 2>&1)
      if [ $? -eq 2 ]; then
        bad=$(tail -n 1 <<< "$summary")
        bad=${bad#error: }
        bad=${bad%%;*}
      else
        echo "   against the previous tables: $(tail -n 1 <<< "$summary")"
      fi
    fi
    if [ -n "$bad" ]; then
      failed+=("$study")
      kept="the output is in $study/tables.md.new"
      [ -f "$study/tables.md" ] && kept="$study/tables.md is kept as it was; $kept"
      echo "   FAILED (exit 0, but $bad: $kept; log: $ROOT_BASE.$study.log)"
      continue
    fi
    mv "$study/tables.md.new" "$study/tables.md"
    echo "   done in $(( $(date +%s) - start )) s: $study/tables.md"
  else
    rm -f "$study/tables.md.new"
    failed+=("$study")
    why="exit $rc"  # above 128: killed by a signal other than INT or TERM (KILL: out of memory?)
    if [ "$rc" -gt 128 ] && sig=$(kill -l "$((rc - 128))" 2>/dev/null); then
      why="$why: killed by SIG$sig"
    fi
    echo "   FAILED ($why; log: $ROOT_BASE.$study.log)"
  fi
done
[ ${#failed[@]} -eq 0 ] || echo "failed: ${failed[*]}" >&2
if [ -n "$interrupted" ]; then
  echo "interrupted: $interrupted (the studies after it did not run)" >&2
  exit 130
fi
[ ${#failed[@]} -eq 0 ] || exit 1
