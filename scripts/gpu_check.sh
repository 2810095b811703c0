#!/usr/bin/env bash
# Everything the GPU machine must show, in one call (device time is scarce):
#   build the CUDA library, run the whole suite with CUDA, compute-sanitizer on the kernel tests,
#   the benchmarks; a summary and logs land under $OUT (or ./out).
# Usage (from the repo root, on the H200): bash scripts/gpu_check.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME LOG CMD...
  local name=$1 log=$2; shift 2
  local t0=$(date +%s)
  "$@" > "$OUT/$log" 2>&1
  local rc=$?
  note "[$name] rc=$rc $(( $(date +%s) - t0 ))s  (log: $log) $(tail -n 1 "$OUT/$log")"
  return $rc
}
note "date: $(date -u +%FT%TZ)  host: $(hostname)"
note "$($PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")')"
step build build.log env DSV4_BUILD_JOBS=16 bash scripts/build_ops.sh || { tail -50 "$OUT/build.log"; exit 1; }
$PY -c 'import dsv4_ops; assert dsv4_ops.built_with_cuda(), "library built without CUDA"' || exit 1
step tests-cuda tests_cuda.log $PY -m pytest -q -x -m cuda -rs tests
if [ "${1:-}" != quick ]; then
  step tests-all tests_all.log $PY -m pytest -q -rs tests
  if command -v compute-sanitizer >/dev/null 2>&1; then
    for tool in memcheck racecheck; do
      step "sanitizer-$tool" "sanitizer_$tool.log" compute-sanitizer --tool "$tool" --error-exitcode 1 \
        $PY -m pytest -q -x -m "cuda and kernels" tests
    done
  fi
  for b in bench/bench_*.py; do
    [ -f "$b" ] || continue
    step "$(basename "$b" .py)" "$(basename "$b" .py).log" $PY "$b"
  done
fi
cat "$SUMMARY"
