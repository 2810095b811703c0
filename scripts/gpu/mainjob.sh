# mainjob: what a GPU user runs first, the GPU gate for any change to the model, the ops, the compile path or export.
# `bash scripts/run.sh` twice (cold Inductor caches, then a second process on warm ones) and the default model's
# bf16 GPU tests, each under a hard limit; the summary carries the compile time and tokens/s.
for run in cold warm; do
  step "mainjob_run_$run" 300 env PYTHON=$PY bash scripts/run.sh
  note "  $(grep -hsE 'decode step for batch bucket .*: done in|tokens/s' "$LOGS/mainjob_run_$run.log" | tr '\n' ' ')"
done
# The default model's bf16 export (what `python -m dsv4_export build` does by default) and a run of the package.
step mainjob_export_bf16 240 $PY -m dsv4_export build --model dsv4_model/assets/default \
  --out "$LOGS/default_bf16.pt2" --no-exported-programs
note "  $(grep -hsE 'done in|package written' "$LOGS/mainjob_export_bf16.log" | tail -n 4 | tr '\n' ' ')"
step mainjob_export_run 120 $PY -m dsv4_export run "$LOGS/default_bf16.pt2" --prompt-ids 1 2 3 4 \
  --max-new-tokens 32
# The same package from C++ (dsv4_export/cpp): its greedy ids must equal the Python run's.
step mainjob_cpp_build 200 env PYTHON=$PY DSV4_BUILD_JOBS=16 bash dsv4_export/cpp/build.sh "$LOGS/cpp_build"
step mainjob_cpp_run 120 "$LOGS/cpp_build/dsv4_run" --ops-lib "$($PY -c 'import dsv4_ops; print(dsv4_ops.library_path())')" \
  --max-new-tokens 32 "$LOGS/default_bf16.pt2" 1 2 3 4
py_ids=$(grep -hs '^generated:' "$LOGS/mainjob_export_run.log"); cpp_ids=$(grep -hs '^generated:' "$LOGS/mainjob_cpp_run.log")
if [ -n "$py_ids" ] && [ "$py_ids" = "$cpp_ids" ]; then note "  C++ runner ids == Python ids: $cpp_ids"
else note "  C++ runner ids DIFFER: python [$py_ids] c++ [$cpp_ids]"; fi
rm -rf "$LOGS/default_bf16.pt2" "$LOGS/cpp_build"
# ... and the loader's memory check (it runs on every GPU load).
step mainjob_default_model_bf16 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_default_model_gpu.py \
  tests/test_compile_cost.py tests/test_memory_plan.py -k "bf16 or too_small"
