# Sourced by tools/gpu_smollm2.sh and tools/gpu_card.sh (bash); needs WHEELS and SITE set.
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
