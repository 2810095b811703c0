# variants: the wgmma NVFP4 kernel's A/B variants (one CTA barrier per chunk, the tall tile; issue #29): their CUDA
# tests (the same bits / within the reference's bound), then each against bf16 cuBLAS (bench_wgmma_variants.py).
step variants_tests 200 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_nvfp4_gemm.py \
  -k "test_linear_cuda_wgmma or many_tokens_per_expert"
step variants_bench 300 $PY bench/bench_wgmma_variants.py
note "  $(grep -hsE '^ *(wo_b|w2) .*M= 1024|^T= 4096' "$LOGS/variants_bench.log" | tr -s ' ' | tr '\n' ';')"
