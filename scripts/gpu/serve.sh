# serve: our server under bench/bench_serve.py at SERVE_CONCURRENCY (default 1 8 32), for each of SERVE_PRESETS
# (default "default"): default is `python -m dsv4_model serve` on the built-in model; others (e.g. "flash2
# flash43:160") random NVFP4 models served by `bench_serve.py --preset-server`, :N their routed experts (43 layers
# with all 256 do not fit one H200). The static batch to compare with: the `continuous` part. The GPU machine has
# no package index: wheels carried in .wheels/ (made by scripts/gpu_wheels.sh) are installed first.
# SERVE_UP_SECONDS (300): how long a server may take to listen (a preset server compiles + captures every bucket
# first: 43 layers want SERVE_ARGS=--regional-compile, or more time).
if [ -d .wheels ] && [ -z "$DRY" ]; then
  $PY -m pip install -q --no-index --find-links .wheels fastapi uvicorn prometheus_client httpx openai \
    > "$LOGS/wheels.log" 2>&1 || note "[serve] wheels from .wheels/ did not install (see wheels.log)"
fi
SERVE_PORT=${SERVE_PORT:-8123}
SERVE_C=${SERVE_CONCURRENCY:-1 8 32}
serve_bench() {  # serve_bench NAME SERVER-CMD...: start the server, bench each concurrency, stop it
  local name=$1; shift
  if [ -n "$DRY" ]; then note "[serve_$name] $* (background)"; else
    "$@" > "$LOGS/serve_${name}_server.log" 2>&1 &
    local pid=$! t0=$(date +%s)
    until curl -sf "http://127.0.0.1:$SERVE_PORT/health" > /dev/null; do
      if ! kill -0 $pid 2>/dev/null; then
        wait $pid; note "[serve_$name] server exited ($?) before it was up: $(tail -n 1 "$LOGS/serve_${name}_server.log")"
        return 0
      fi
      if [ $(( $(date +%s) - t0 )) -ge "${SERVE_UP_SECONDS:-300}" ]; then
        kill -KILL $pid; note "[serve_$name] server not up after ${SERVE_UP_SECONDS:-300} s (killed): $(tail -n 1 "$LOGS/serve_${name}_server.log")"
        return 0
      fi
      sleep 1
    done
    note "[serve_$name] server up after $(( $(date +%s) - t0 ))s"
  fi
  for c in $SERVE_C; do
    step "serve_${name}_c$c" 180 $PY bench/bench_serve.py --url "http://127.0.0.1:$SERVE_PORT" --concurrency "$c" \
      --num-requests $(( c * 4 )) --max-tokens 64 --out "$LOGS/serve_${name}_c$c.json"
    [ -n "$DRY" ] || note "  $($PY -c 'import json, sys; d = json.load(open(sys.argv[1])); print({k: d[k] for k in d if "throughput" in k or k in ("ttft", "tpot")})' "$LOGS/serve_${name}_c$c.json" 2>&1 | tail -c 600)"
  done
  [ -n "$DRY" ] && return 0
  kill -TERM $pid 2>/dev/null
  for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -0 $pid 2>/dev/null && { kill -KILL $pid; note "[serve_$name] server killed: no exit 30 s after SIGTERM"; }
  wait $pid; note "[serve_$name] server exit $?"
}
for p in ${SERVE_PRESETS:-default}; do
  if [ "$p" = default ]; then
    serve_bench default $PY -m dsv4_model serve --port "$SERVE_PORT" --max-batch-size 32; continue
  fi
  experts=(); [[ $p == *:* ]] && experts=(--experts "${p#*:}")
  serve_bench "${p%%:*}" $PY bench/bench_serve.py --preset-server "${p%%:*}" ${experts[@]+"${experts[@]}"} \
    --port "$SERVE_PORT" --max-batch-size 64 ${SERVE_ARGS:-}
done
