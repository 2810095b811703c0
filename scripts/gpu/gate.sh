# gate: the GPU gate without the export: `bash scripts/run.sh` (cold Inductor caches) and the default model's bf16
# GPU tests, each under a hard limit.
step gate_run 300 env PYTHON=$PY bash scripts/run.sh
note "  $(grep -hsE 'decode step for batch bucket .*: done in|tokens/s' "$LOGS/gate_run.log" | tr '\n' ' ')"
step gate_default_model_bf16 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_default_model_gpu.py \
  tests/test_compile_cost.py tests/test_memory_plan.py -k "bf16 or too_small"
