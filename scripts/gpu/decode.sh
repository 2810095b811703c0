# decode: the decode step end to end after a model-level change: the compiled / graph-replayed step against eager,
# the default model's exported package and bf16 settings, and the per-layer time and kernel count.
step decode_compiled 200 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_compiled_decode.py
step decode_layers 200 $PY bench/bench_layer.py --kinds csa,hca,swa --steps 50 --experts 16
step decode_count_kernels 200 $PY scripts/count_decode_kernels.py --device cuda
step decode_default_model 420 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_default_model_gpu.py \
  -k "exported or bf16"
