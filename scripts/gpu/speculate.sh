# speculate: the default model with --speculate K (compiled + CUDA graph per bucket) for each K in SPECULATE_KS:
# tokens/s, tokens per step and acceptance per draft position, against the plain run (K = 0) of the same prompt.
for k in ${SPECULATE_KS:-0 1 2 3}; do
  step "speculate_$k" 200 $PY -m dsv4_model generate --prompt "def fibonacci(n):" --max-new-tokens 128 --speculate $k
  note "  $(grep -hsE 'done in|tokens/s|speculation:' "$LOGS/speculate_$k.log" | tr '\n' ' ')"
  grep -vsE '^\[dsv4\]' "$LOGS/speculate_$k.log" | md5sum | sed "s/^/  text md5 K=$k: /" | tee -a "$SUMMARY"
done
