# prefill: chunked prefill on the GPU: the CUDA tests of prefill from any position, then the prefill benchmark
# (whole / chunks / compiled chunks / HF against prompt length); the scheduler's compiled prefill chunks (#29).
# PREFILL_ARGS: more bench_prefill.py arguments (e.g. "--gemm-kernels auto,cublas --lengths 4096,8192").
step prefill_tests 300 $PY -m pytest -q -m cuda -rs -p no:cacheprovider tests/test_prefill_from_position.py \
  tests/test_compiled_prefill.py
step prefill_bench 300 $PY bench/bench_prefill.py --compiled ${PREFILL_ARGS:-}
