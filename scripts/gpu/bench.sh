# bench: every benchmark (BENCHES picks them), each under 300 s.
for b in ${BENCHES:-bench/bench_*.py}; do
  step "$(basename "$b" .py)" 300 $PY "$b"
done
