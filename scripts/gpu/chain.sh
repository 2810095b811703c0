# chain: dsv4::nvfp4_linear_chain (issue #30's first step): its CUDA tests, the op against the per-op path
# (bench_chain), then the layers of CHAIN_KINDS (csa) at CHAIN_BATCHES (1 8) with the attention's output projection
# per op (the default) and chained (DecodeOptions out_chain=1), in one run.
step chain_tests 200 $PY -m pytest -q -m cuda -rs -p no:cacheprovider tests/test_chain.py
step chain_bench 150 $PY bench/bench_chain.py
for b in ${CHAIN_BATCHES:-1 8}; do
  step "chain_layer_b${b}_per_op" 150 $PY bench/bench_layer.py --kinds ${CHAIN_KINDS:-csa} --steps 50 --experts 16 --batch $b
  step "chain_layer_b${b}_chained" 150 $PY bench/bench_layer.py --kinds ${CHAIN_KINDS:-csa} --steps 50 --experts 16 --batch $b \
    --decode-options out_chain=1
done
