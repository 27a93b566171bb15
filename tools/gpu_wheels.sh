# Sourced by tools/gpu_smollm2.sh and tools/gpu_card.sh (bash); install_wheels needs WHEELS and
# SITE set.
# install_wheels: every wheel of $WHEELS into $SITE (no index, no dependencies), once per machine:
# a marker in $SITE names the set of wheels installed. A lock on $SITE/.lock makes copies run side
# by side (a compile-only copy beside the timed steps) wait for one install instead of both
# writing $SITE at once. Prints one line; returns pip's status.
install_wheels() {
  local mark wheels
  wheels=$(ls "$WHEELS"/*.whl 2>/dev/null)
  if [ -z "$wheels" ]; then
    echo "wheels: none in $WHEELS (bash tools/gpu_smollm2.sh prepare, here)"
    return 0
  fi
  mkdir -p "$SITE" || return 1
  mark="$SITE/.installed_$(echo "$wheels" | md5sum | cut -c1-12)"
  (
    command -v flock >/dev/null && flock 9
    if [ -f "$mark" ]; then
      echo "wheels: already in $SITE"
    elif python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl; then
      touch "$mark" && echo "wheels: installed into $SITE"
    else
      echo "wheels: install into $SITE failed"
      exit 1
    fi
  ) 9>"$SITE/.lock"
}

# split_parts FILE FIRST REST DIR: FILE as DIR/part0 (its first FIRST bytes), then DIR/part1,
# part2, ... of REST bytes each (the last the remainder), for invocations that each carry one
# part (the first beside more files than the others); earlier parts in DIR are removed. Prints
# how many parts; at most 10 (a one-digit name each), else an error line and status 2.
split_parts() {
  local file=$1 first=$2 rest=$3 dir=$4 size n
  mkdir -p "$dir" && rm -f "$dir"/part?
  head -c "$first" "$file" >"$dir/part0" || return 2
  size=$(stat -c %s "$file")
  if [ "$size" -gt "$first" ]; then
    if [ $(((size - first + rest - 1) / rest)) -gt 9 ]; then
      rm -f "$dir"/part?
      echo "error: $file in parts of $first then $rest bytes needs more than 10 parts" >&2
      return 2
    fi
    tail -c +$((first + 1)) "$file" | split -b "$rest" -a 1 -d --numeric-suffixes=1 - "$dir/part"
  fi
  n=$(ls "$dir"/part? | wc -l)
  echo "$n"
}

# join_parts DIR BYTES OUT: DIR/part0, part1, ... joined in order into OUT, where they hold
# BYTES bytes together; else one error line naming the parts held, and status 2 (OUT untouched).
join_parts() {
  local dir=$1 bytes=$2 out=$3 held have
  held=$(ls "$dir" 2>/dev/null | grep -E '^part[0-9]$' | tr '\n' ' ')
  have=$(cat "$dir"/part? 2>/dev/null | wc -c)
  if [ "$have" -ne "$bytes" ]; then
    echo "error: the parts in $dir (${held:-none}) hold $have of the $bytes bytes of" \
      "$(basename "$out"): send the invocations that carry the others first, on this machine" >&2
    return 2
  fi
  cat "$dir"/part? >"$out.partial" && mv "$out.partial" "$out"
}
