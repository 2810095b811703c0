# prefill: chunked prefill on the GPU: the CUDA tests of prefill from any position (the attention through the decode
# attention op, the indexer's prefill scores op), then the kernels' benchmarks (indexer prefill scores, the window
# attention's torch form), then the prefill benchmark (whole / chunks / compiled chunks / HF against prompt
# length); the scheduler's compiled prefill chunks (#29).
# PREFILL_ARGS: more bench_prefill.py arguments (e.g. "--gemm-kernels auto,cublas --lengths 4096,8192 --regional").
step prefill_tests 420 $PY -m pytest -q -m cuda -rs -p no:cacheprovider tests/test_prefill_from_position.py \
  tests/test_compiled_prefill.py tests/test_indexer_prefill.py tests/test_prefill_attn_rows.py
step prefill_indexer_bench 120 $PY bench/bench_indexer_prefill.py
step prefill_window_bench 120 $PY bench/bench_prefill_window.py
step prefill_bench 300 $PY bench/bench_prefill.py --compiled ${PREFILL_ARGS:-}
