# fulldepth: one GPU, the 43-layer V4-Flash-width model (random NVFP4, as many experts as fit) at 4K and 128K
# context, B = 1 / 8 / 64, and the 61-layer V4-Pro-width stack at 4K, B = 1 / 8.
step fulldepth_flash_4k 300 $PY bench/bench_parallel_decode.py --preset flash --context 4096 --batches 1,8,64
step fulldepth_flash_128k 240 $PY bench/bench_parallel_decode.py --preset flash --context 131072 \
  --batches 1,8,64 --regional
step fulldepth_pro_4k 240 $PY bench/bench_parallel_decode.py --preset pro --context 4096 --batches 1,8 --regional
for f in flash_4k flash_128k pro_4k; do note "$(grep -hsvE '^\[dsv4\]|Warning|warn' "$LOGS/fulldepth_$f.log" | tail -n 8)"; done
