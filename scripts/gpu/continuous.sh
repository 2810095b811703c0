# continuous: bench/bench_continuous.py (the scheduler against a static batch, in one process) on CONTINUOUS_MODELS
# (default: the built-in model; presets such as flash2 / flash43 build random NVFP4 models on the GPU) at
# CONTINUOUS_C concurrency levels; NAME:N gives a preset N routed experts (flash43:160 fits one H200).
# CONTINUOUS_ARGS: more bench_continuous.py arguments (e.g. "--requests-per-row 1" for the 43-layer model, whose
# eager prefill dominates); CONTINUOUS_STEP_SECONDS: each model's limit (300).
for spec in ${CONTINUOUS_MODELS:-default}; do
  model=${spec%%:*}; experts=(); [[ $spec == *:* ]] && experts=(--experts "${spec#*:}")
  step "continuous_$model" "${CONTINUOUS_STEP_SECONDS:-300}" $PY bench/bench_continuous.py --model "$model" \
    ${experts[@]+"${experts[@]}"} --concurrency "${CONTINUOUS_C:-1,8,32}" ${CONTINUOUS_ARGS:-}
  [ -n "$DRY" ] || grep -hsA8 "steady/static" "$LOGS/continuous_$model.log" | sed 's/^/  /' | tee -a "$SUMMARY"
done
