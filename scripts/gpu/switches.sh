# switches: the debug overrides (DecodeOptions hc_pre=0: mHC as tensor ops; attention=torch; the kernel override
# attn_kernel=simt: the CUDA-core attention kernel): the model-level tests, the kernel count, and the layer each way
# (what the defaults buy).
step switches_op_tests 150 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_hc_pre.py \
  tests/test_attn.py tests/test_decode_options.py
step switches_count_kernels 200 $PY scripts/count_decode_kernels.py --device cuda
step switches_layer_default 200 $PY bench/bench_layer.py --kinds csa --steps 50 --experts 16
step switches_layer_off 200 $PY bench/bench_layer.py --kernel-overrides attn_kernel=simt --kinds csa --steps 50 \
  --experts 16 --decode-options "hc_pre=0,attention=torch"
