# prefetch: the L2 weight-prefetch experiment (#30; DecodeOptions prefetch=1, dsv4::prefetch_l2): its CUDA tests,
# then one V4-Flash-width layer of each kind with and without it, alternating, PREFETCH_ROUNDS (2) times.
step prefetch_tests 150 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_prefetch.py
for round in $(seq "${PREFETCH_ROUNDS:-2}"); do
  step "prefetch_layer_off_$round" 200 $PY bench/bench_layer.py --kinds csa,hca --steps 50 --experts 16
  step "prefetch_layer_on_$round" 200 $PY bench/bench_layer.py --kinds csa,hca --steps 50 --experts 16 \
    --decode-options prefetch=1
  [ -n "$DRY" ] || grep -hsE "^(csa|hca) +[0-9]" "$LOGS/prefetch_layer_off_$round.log" "$LOGS/prefetch_layer_on_$round.log" \
    | sed 's/^/  /' | tee -a "$SUMMARY"
done
