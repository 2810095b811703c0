# pdl: the pdl kernel override (on by default: the decode kernels outside the NVFP4 chain launched with programmatic
# dependent launch). Their op tests and the compiled decode without it (the default run has it), then the layer
# both ways, and with only the NVFP4 kernels' PDL off (gemv_pdl=0).
step pdl_op_tests 200 $PY -m pytest -q -m cuda -p no:cacheprovider --kernel-overrides pdl=0 \
  tests/test_compressor.py \
  tests/test_norm_rope.py tests/test_hc_pre.py tests/test_hadamard.py tests/test_key_store.py \
  tests/test_attn.py tests/test_indexer.py tests/test_router.py tests/test_fp32_linear.py \
  tests/test_nvfp4_quant.py
step pdl_compiled 150 $PY -m pytest -q -m cuda -x -p no:cacheprovider tests/test_compiled_decode.py \
  -k "graph_logits"
step pdl_layer_off 200 $PY bench/bench_layer.py --kernel-overrides pdl=0 --kinds csa --steps 50 --experts 16
step pdl_layer_on 200 $PY bench/bench_layer.py --kinds csa --steps 50 --experts 16
step pdl_layer_gemv_off 200 $PY bench/bench_layer.py --kernel-overrides gemv_pdl=0 --kinds csa --steps 50 --experts 16
