# serve: `python -m dsv4_model serve` on the built-in model (CUDA, compiled) under bench/bench_serve.py at
# concurrency 1 / 8 / 32 (SERVE_CONCURRENCY); the static batch to compare with: the `continuous` part. The GPU
# machine has no package index: wheels carried in .wheels/ are installed first.
if [ -d .wheels ] && [ -z "$DRY" ]; then
  $PY -m pip install -q --no-index --find-links .wheels fastapi uvicorn prometheus_client httpx openai \
    > "$LOGS/wheels.log" 2>&1 || note "[serve] wheels from .wheels/ did not install (see wheels.log)"
fi
SERVE_PORT=${SERVE_PORT:-8123}
if [ -n "$DRY" ]; then note "[serve] $PY -m dsv4_model serve --port $SERVE_PORT --max-batch-size 32 (background)"
else
  $PY -m dsv4_model serve --port "$SERVE_PORT" --max-batch-size 32 > "$LOGS/serve_server.log" 2>&1 &
  SERVE_PID=$!
  t0=$(date +%s)
  until curl -sf "http://127.0.0.1:$SERVE_PORT/health" > /dev/null; do
    kill -0 $SERVE_PID 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt 300 ] || break
    sleep 1
  done
  note "[serve] server up after $(( $(date +%s) - t0 ))s"
fi
for c in ${SERVE_CONCURRENCY:-1 8 32}; do
  step "serve_c$c" 180 $PY bench/bench_serve.py --url "http://127.0.0.1:$SERVE_PORT" --concurrency "$c" \
    --num-requests $(( c * 4 )) --max-tokens 64 --out "$LOGS/serve_c$c.json"
  [ -n "$DRY" ] || note "  $($PY -c 'import json, sys; d = json.load(open(sys.argv[1])); print({k: d[k] for k in d if "throughput" in k or k in ("ttft", "tpot")})' "$LOGS/serve_c$c.json" 2>&1 | tail -c 600)"
done
if [ -z "$DRY" ]; then
  kill -TERM $SERVE_PID 2>/dev/null
  for _ in $(seq 30); do kill -0 $SERVE_PID 2>/dev/null || break; sleep 1; done
  kill -0 $SERVE_PID 2>/dev/null && { kill -KILL $SERVE_PID; note "[serve] server killed: no exit 30 s after SIGTERM"; }
  wait $SERVE_PID; note "[serve] server exit $?"
fi
