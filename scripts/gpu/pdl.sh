# pdl: the pdl kernel override (on by default: the decode kernels outside the NVFP4 chain launched with programmatic
# dependent launch). The layer first (what decides the default): with PDL, without it, and with only the NVFP4
# kernels' PDL off (gemv_pdl=0), at batch 1 and 8; then the op tests and the compiled decode without PDL.
for b in 1 8; do
  for ov in "" pdl=0 gemv_pdl=0; do
    name=pdl_layer_b${b}_${ov:-on}; name=${name//=/}
    step "$name" 200 $PY bench/bench_layer.py ${ov:+--kernel-overrides $ov} --kinds csa,hca --steps 50 --experts 16 \
      --batch "$b"
    note "  $(grep -hsE '^(csa|hca) ' "$LOGS/$name.log" | tr -s ' ' | tr '\n' ';')"
  done
done
step pdl_op_tests 200 $PY -m pytest -q -m cuda -p no:cacheprovider --kernel-overrides pdl=0 \
  tests/test_compressor.py \
  tests/test_norm_rope.py tests/test_hc_pre.py tests/test_hadamard.py tests/test_key_store.py \
  tests/test_attn.py tests/test_indexer.py tests/test_router.py tests/test_fp32_linear.py \
  tests/test_nvfp4_quant.py
step pdl_compiled 150 $PY -m pytest -q -m cuda -x -p no:cacheprovider tests/test_compiled_decode.py \
  -k "graph_logits"
