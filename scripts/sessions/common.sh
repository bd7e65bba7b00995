# Helpers the session scripts share (sourced; gpu-session28 on). Needs
# FINAL (the folder that comes back), O (logs, packed into FINAL/results.tgz
# after every stage, so a call cut off by its limit still brings back what
# finished) and T0 (the start, seconds).
el() { echo "== $(($(date +%s) - T0))s $*" | tee -a "$FINAL/summary.txt"; tar czf "$FINAL/results.tgz" -C "$O" .; }
build() {
  timeout 300 python3 -m pip install -q --no-build-isolation --no-deps --no-index -C build-dir=build/main . > "$O/build.log" 2>&1
  el "build $?"
}
tests() {  # tests NAME TIMEOUT pytest-args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m pytest -q -rfE -p no:cacheprovider -p no:logging "$@" > "$O/$name.log" 2>&1
  local rc=$?
  el "$name $rc: $(tail -1 "$O/$name.log")"; grep -E "^(FAILED|ERROR)" "$O/$name.log" | head | tee -a "$FINAL/summary.txt"
  return $rc
}
