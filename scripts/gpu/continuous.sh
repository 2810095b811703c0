# continuous: bench/bench_continuous.py (the scheduler against a static batch, in one process) on CONTINUOUS_MODELS
# (default: the built-in model; presets such as flash2 / flash43 build random NVFP4 models on the GPU) at
# CONTINUOUS_C concurrency levels; NAME:N gives a preset N routed experts (flash43:160 fits one H200).
# CONTINUOUS_ARGS: more bench_continuous.py arguments (e.g. "--requests-per-row 1" for the 43-layer model, whose
# eager prefill dominates); CONTINUOUS_STEP_SECONDS: each model's limit (300). Then issue #29's compiled prefill:
# flash2 at CONTINUOUS_PREFILL_C (1,8,64; empty: skipped) with prefill eager and compiled, TTFT side by side
# (CONTINUOUS_PREFILL_SECONDS: its limit, 600: each bucket compiles in the warm-up run).
for spec in ${CONTINUOUS_MODELS:-default}; do
  model=${spec%%:*}; experts=(); [[ $spec == *:* ]] && experts=(--experts "${spec#*:}")
  step "continuous_$model" "${CONTINUOUS_STEP_SECONDS:-300}" $PY bench/bench_continuous.py --model "$model" \
    ${experts[@]+"${experts[@]}"} --concurrency "${CONTINUOUS_C:-1,8,32}" ${CONTINUOUS_ARGS:-}
  [ -n "$DRY" ] || grep -hsA12 "steady/static" "$LOGS/continuous_$model.log" | sed 's/^/  /' | tee -a "$SUMMARY"
done
if [ -n "${CONTINUOUS_PREFILL_C-1,8,64}" ]; then
  step continuous_prefill_flash2 "${CONTINUOUS_PREFILL_SECONDS:-600}" $PY bench/bench_continuous.py --model flash2 \
    --concurrency "${CONTINUOUS_PREFILL_C-1,8,64}" --compiled-prefill
  [ -n "$DRY" ] || grep -hsA12 "steady/static" "$LOGS/continuous_prefill_flash2.log" | sed 's/^/  /' | tee -a "$SUMMARY"
fi
