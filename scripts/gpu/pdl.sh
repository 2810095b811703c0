# pdl: the layer with the NVFP4 kernels' programmatic dependent launch as shipped (below gemv_pdl_rows = 8 token
# rows), never (gemv_pdl=0; the other decode kernels keep PDL) and at every size (gemv_pdl_rows=100000), at batch
# 1, 2, 4, 8 and 16, PDL_ROUNDS times (1), interleaved; then the op tests and the compiled decode with PDL off
# everywhere (pdl=0); PDL_BATCHES ("1 2 4 8 16") picks the batches, PDL_TESTS=0 leaves out the op tests (not the
# decode gemv's own bit test). Sessions 50-51 (H100): PDL on won at B = 1 and 4, off at B = 8 (4-6%, twice).
for r in $(seq "${PDL_ROUNDS:-1}"); do
  for b in ${PDL_BATCHES:-1 2 4 8 16}; do
    for ov in "" gemv_pdl=0 gemv_pdl_rows=100000; do
      name=pdl_layer_r${r}_b${b}_${ov:-on}; name=${name//=/}
      step "$name" 120 $PY bench/bench_layer.py ${ov:+--kernel-overrides $ov} --kinds csa,hca --steps 50 --experts 16 \
        --batch "$b"
      note "  $(grep -hsE '^(csa|hca) ' "$LOGS/$name.log" | tr -s ' ' | tr '\n' ';')"
    done
  done
done
step pdl_gemv_bits 120 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_nvfp4_gemm.py -k decode_kernels
[ "${PDL_TESTS:-1}" = 0 ] && return 0
step pdl_op_tests 200 $PY -m pytest -q -m cuda -p no:cacheprovider --kernel-overrides pdl=0 \
  tests/test_compressor.py \
  tests/test_norm_rope.py tests/test_hc_pre.py tests/test_hadamard.py tests/test_key_store.py \
  tests/test_attn.py tests/test_indexer.py tests/test_router.py tests/test_fp32_linear.py \
  tests/test_nvfp4_quant.py
step pdl_compiled 150 $PY -m pytest -q -m cuda -x -p no:cacheprovider tests/test_compiled_decode.py \
  -k "graph_logits"
