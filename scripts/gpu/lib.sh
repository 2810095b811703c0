# What every part of scripts/gpu_check.sh uses: the summary line, the timed step, the build, the logs at exit.
# Sourced by the driver, which sets OUT, LOGS, PY, SUMMARY, DRY.

note() { echo "$*" | tee -a "$SUMMARY"; }

T_START=$(date +%s)
step() {  # step NAME TIMEOUT CMD...  (log in $LOGS/NAME.log; the summary gets rc, seconds and the log's verdict)
  local name=$1 limit=$2; shift 2
  if [ -n "$DRY" ]; then note "[$name] ${limit}s: $*"; return 0; fi
  local t0=$(date +%s)
  if [ -n "${GPU_CHECK_SECONDS:-}" ]; then
    local left=$(( GPU_CHECK_SECONDS - (t0 - T_START) ))
    if [ "$left" -lt 20 ]; then note "[$name] skipped: GPU_CHECK_SECONDS spent"; return 124; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  note "[$name] rc=$rc $(( $(date +%s) - t0 ))s $(grep -E 'passed|failed|error|Fatal|ERROR SUMMARY' "$LOGS/$name.log" | tail -n 1)"
  return $rc
}

finish() { (cd "$LOGS" && tar czf - .) > "$OUT/logs.tgz"; cat "$SUMMARY"; }

build_library() {
  # A library with a static libstdc++ still runs its kernels: keep testing, but say so in the summary.
  if [ -z "${GPU_CHECK_SKIP_BUILD:-}" ]; then
    step build 300 env DSV4_BUILD_JOBS=16 DSV4_ALLOW_STATIC_LIBSTDCXX=1 bash scripts/build_ops.sh || return 1
    grep -qs "static copy of libstdc++" "$LOGS/build.log" && note "WARNING: libdsv4_ops.so links libstdc++ statically (error messages crash)"
  fi
  [ -n "$DRY" ] || $PY -c 'import dsv4_ops; assert dsv4_ops.built_with_cuda(), "library built without CUDA"'
}
