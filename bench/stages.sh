# The stage runner of bench/gpu_*.sh (source it after setting LOG): `say` prints and logs a line, `stage NAME
# SECONDS CMD...` runs CMD with a time limit, everything it prints to the log, and says how it ended.
say() { echo "$@" | tee -a "$LOG"; }
stage() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  say "== $name"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  say "== $name: exit $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo " (TIMED OUT at ${limit} s)")"
  return $rc
}
