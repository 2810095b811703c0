#!/usr/bin/env bash
# Everything the GPU machine must show, in one call (device time is scarce):
#   build the CUDA library, the main job (what a GPU user runs first: the GPU gate for any change to the model,
#   the ops, the compile path or export), the CUDA tests one file per process (a crash cannot hide other files'
#   results), compute-sanitizer (memcheck, racecheck) on the direct kernel tests, the benchmarks.
# $OUT gets summary.txt + logs.tgz (the device tool returns at most 8 files of <= 16 MiB).
# Usage on the H200, from the repo root:
#   bash scripts/gpu_check.sh [mainjob|gate|tests|sanitizer|bench|soak|profile|switches|pdl|decode|depth|fulldepth|ab|speculate|prefill ...]
# (default: mainjob tests sanitizer bench)
# Env: GPU_CHECK_SKIP_BUILD=1 (already built), TEST_FILES / BENCHES (space-separated paths; default: all), SANITIZE
# (a grep -E pattern on "TOOL SPEC", e.g. "racecheck .*attn": only the sanitizer runs it matches), SANITIZER_JOBS (parallel sanitizer runs, 8), GPU_CHECK_SECONDS (a total budget: steps get
# what is left of it and are skipped once it is spent, so the summary always comes back within a device call).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PATH=$PATH:/usr/local/cuda/bin
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
PARTS=${*:-mainjob tests sanitizer bench}
note() { echo "$*" | tee -a "$SUMMARY"; }
T_START=$(date +%s)
step() {  # step NAME TIMEOUT CMD...  (log in $LOGS/NAME.log)
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  if [ -n "${GPU_CHECK_SECONDS:-}" ]; then
    local left=$(( GPU_CHECK_SECONDS - (t0 - T_START) ))
    if [ "$left" -lt 20 ]; then note "[$name] skipped: GPU_CHECK_SECONDS spent"; return 124; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  note "[$name] rc=$rc $(( $(date +%s) - t0 ))s $(grep -E 'passed|failed|error|Fatal|ERROR SUMMARY' "$LOGS/$name.log" | tail -n 1)"
  return $rc
}
finish() { (cd "$LOGS" && tar czf - .) > "$OUT/logs.tgz"; cat "$SUMMARY"; }
trap finish EXIT
trap 'exit 143' TERM INT
note "date: $(date -u +%FT%TZ)  $($PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))')"
# A library with a static libstdc++ still runs its kernels: keep testing, but say so in the summary.
# GPU_CHECK_SKIP_BUILD=1: the library is already built (several gpu_check runs in parallel share one build).
if [ -z "${GPU_CHECK_SKIP_BUILD:-}" ]; then
  step build 300 env DSV4_BUILD_JOBS=16 DSV4_ALLOW_STATIC_LIBSTDCXX=1 bash scripts/build_ops.sh || exit 1
  grep -q "static copy of libstdc++" "$LOGS/build.log" && note "WARNING: libdsv4_ops.so links libstdc++ statically (error messages crash)"
fi
$PY -c 'import dsv4_ops; assert dsv4_ops.built_with_cuda(), "library built without CUDA"' || exit 1
# Sanitizer runs: FILE or FILE@K (a pytest -k expression). The GEMM and sampler files time out as one run under
# the sanitizer (300 s): they are split into parallel runs. The chi-square test only draws more samples from the
# kernels the other sampler tests run: memcheck only (racecheck instruments every shared-memory access: > 480 s).
KERNEL_TESTS="tests/test_nvfp4_quant.py tests/test_indexer.py tests/test_mhc.py tests/test_fp32_linear.py
  tests/test_router.py tests/test_attn.py tests/test_hc_pre.py tests/test_compressor_op.py
  tests/test_norm_rope.py tests/test_hadamard_fp4.py tests/test_key_store.py
  tests/test_nvfp4_gemm.py@decode_kernels
  tests/test_nvfp4_gemm.py@linear_cuda@and@not@w4a4@and@not@decode
  tests/test_nvfp4_gemm.py@w4a4 tests/test_nvfp4_gemm.py@grouped@or@multi
  tests/test_nvfp4_gemm.py@moe_cuda_many_experts@and@not@64@and@not@300
  tests/test_nvfp4_gemm.py@moe_cuda_many_experts@and@(64@or@300)
  tests/test_nvfp4_gemm.py@moe@and@not@many_experts@and@not@local_route
  tests/test_nvfp4_gemm.py@local_route@and@(16-3-6@or@8-16-2) tests/test_nvfp4_gemm.py@opcheck@or@graph
  tests/test_sample.py@not@chi_square"
MEMCHECK_ONLY="tests/test_sample.py@chi_square"
# Racecheck also reports cuBLAS's own kernels (nvjet_*, run by the tests' references): a run counts as clean when no
# reported race is in a kernel of this project.
own_races() { grep -E "Race reported" "$1" | grep -vcE "nvjet|cutlass|cublas" ; }
for part in $PARTS; do
  case $part in
    mainjob)
      # `bash scripts/run.sh` twice (cold Inductor caches, then a second process on warm ones) and the default
      # model's bf16 GPU tests, each under a hard limit; the summary carries the compile time and tokens/s.
      for run in cold warm; do
        step "mainjob_run_$run" "${MAINJOB_TIMEOUT:-300}" env PYTHON=$PY bash scripts/run.sh
        note "  $(grep -hE 'decode step for batch bucket .*: done in|tokens/s' "$LOGS/mainjob_run_$run.log" | tr '\n' ' ')"
      done
      # The default model's bf16 export (what `python -m dsv4_export build` does by default) and a run of the package.
      step mainjob_export_bf16 "${EXPORT_TIMEOUT:-240}" $PY -m dsv4_export build --model dsv4_model/assets/default \
        --out "$LOGS/default_bf16.pt2" --no-exported-programs
      note "  $(grep -hE 'done in|package written' "$LOGS/mainjob_export_bf16.log" | tail -n 4 | tr '\n' ' ')"
      step mainjob_export_run 120 $PY -m dsv4_export run "$LOGS/default_bf16.pt2" --prompt-ids 1 2 3 4 \
        --max-new-tokens 32
      # The same package from C++ (dsv4_export/cpp): its greedy ids must equal the Python run's.
      step mainjob_cpp_build 200 env PYTHON=$PY DSV4_BUILD_JOBS=16 bash dsv4_export/cpp/build.sh "$LOGS/cpp_build"
      step mainjob_cpp_run 120 "$LOGS/cpp_build/dsv4_run" --ops-lib "$($PY -c 'import dsv4_ops; print(dsv4_ops.library_path())')" \
        --max-new-tokens 32 "$LOGS/default_bf16.pt2" 1 2 3 4
      py_ids=$(grep -h '^generated:' "$LOGS/mainjob_export_run.log"); cpp_ids=$(grep -h '^generated:' "$LOGS/mainjob_cpp_run.log")
      if [ -n "$py_ids" ] && [ "$py_ids" = "$cpp_ids" ]; then note "  C++ runner ids == Python ids: $cpp_ids"
      else note "  C++ runner ids DIFFER: python [$py_ids] c++ [$cpp_ids]"; fi
      rm -rf "$LOGS/default_bf16.pt2" "$LOGS/cpp_build"
      # ... and the loader's memory check (it runs on every GPU load).
      step mainjob_default_model_bf16 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_default_model_gpu.py \
        tests/test_compile_cost.py tests/test_memory_plan.py -k "bf16 or too_small" ;;
    prefill)
      # Chunked prefill on the GPU: the CUDA tests of prefill from any position, then the prefill benchmark
      # (whole / chunks / compiled chunks / HF against prompt length).
      step prefill_tests 300 $PY -m pytest -q -m cuda -rs -p no:cacheprovider tests/test_prefill_from_position.py
      step prefill_bench 300 $PY bench/bench_prefill.py --compiled ;;
    speculate)
      # The default model with --speculate K (compiled + CUDA graph per bucket): tokens/s, tokens per step and
      # acceptance per draft position, against the plain run of the same prompt.
      for k in ${SPECULATE_KS:-0 1 2 3}; do
        step "speculate_$k" 200 $PY -m dsv4_model generate --prompt "def fibonacci(n):" --max-new-tokens 128 --speculate $k
        note "  $(grep -hE 'done in|tokens/s|speculation:' "$LOGS/speculate_$k.log" | tr '\n' ' ')"
        grep -vE '^\[dsv4\]' "$LOGS/speculate_$k.log" | md5sum | sed "s/^/  text md5 K=$k: /" | tee -a "$SUMMARY"
      done ;;
    gate)
      # The GPU gate without the export: `bash scripts/run.sh` (cold Inductor caches) and the default model's bf16
      # GPU tests, each under a hard limit.
      step gate_run "${MAINJOB_TIMEOUT:-300}" env PYTHON=$PY bash scripts/run.sh
      note "  $(grep -hE 'decode step for batch bucket .*: done in|tokens/s' "$LOGS/gate_run.log" | tr '\n' ' ')"
      step gate_default_model_bf16 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_default_model_gpu.py \
        tests/test_compile_cost.py tests/test_memory_plan.py -k "bf16 or too_small" ;;
    tests)
      for f in ${TEST_FILES:-tests/test_*.py}; do
        step "$(basename "$f" .py)" "${PER_FILE_TIMEOUT:-420}" $PY -m pytest -q -m cuda -rs -p no:cacheprovider "$f"
      done ;;
    sanitizer)
      command -v compute-sanitizer >/dev/null || { note "no compute-sanitizer"; continue; }
      # Not instrumented: PyTorch's and cuBLAS's kernels (the tests' references and glue: instrumenting them took
      # most of each run, and racecheck reported only nvjet races). Racecheck keeps cuBLAS's kernels instrumented:
      # with them left out it crashed inside them ("failed to handle a hardware exception", H200, CUDA 13.0).
      skip_flags() { for sub in "$@"; do printf -- ' --kernel-name-exclude kns=%s' "$sub"; done; }
      SKIP_memcheck=$(skip_flags native cub nvjet cutlass cublas gemm); SKIP_racecheck=$(skip_flags native cub)
      compute-sanitizer --help 2>&1 | grep -A4 -E "kernel-name" > "$LOGS/san_help.log"
      if compute-sanitizer --tool racecheck $SKIP_memcheck $PY -c "import torch; torch.ones(4, device='cuda').sum()" \
          > "$LOGS/san_filter_probe.log" 2>&1; then note "sanitizer: not instrumented: memcheck$SKIP_memcheck; racecheck$SKIP_racecheck"
      else note "sanitizer: the kernel filter was refused ($(head -c 300 "$LOGS/san_filter_probe.log" | tr '\n' ' ')); every kernel instrumented"; SKIP_memcheck=""; SKIP_racecheck=""; fi
      # In parallel: each run is bound by the sanitizer's host-side work, not by the GPU.
      for tool in memcheck racecheck; do
        specs=$KERNEL_TESTS; [ "$tool" = memcheck ] && specs="$KERNEL_TESTS $MEMCHECK_ONLY"
        skip_var=SKIP_$tool; skip=${!skip_var}
        for spec in $specs; do
          [ -n "${SANITIZE:-}" ] && ! echo "$tool $spec" | grep -qE "$SANITIZE" && continue
          f=${spec%%@*}; k=""; name="san_${tool}_$(basename "$f" .py)"
          if [ "$spec" != "$f" ]; then k=${spec#*@}; k=${k//@/ }; name="${name}_${k// /_}"; fi
          # At most SANITIZER_JOBS at a time: 45 sanitizer processes on 16 cores each ran past 300 s.
          while [ "$(jobs -rp | wc -l)" -ge "${SANITIZER_JOBS:-8}" ]; do wait -n; done
          # -v --durations: a run cut off by its time limit still shows which tests finished and how long each took.
          # Host threads shared out: the tests' CPU work (references, repacking) in every run at once oversubscribed.
          step "$name" "${SANITIZER_TIMEOUT:-300}" env OMP_NUM_THREADS=$(( $(nproc) / ${SANITIZER_JOBS:-8} + 1 )) compute-sanitizer --tool "$tool" --error-exitcode 1 $skip \
            $PY -m pytest -v -x --durations=0 -m "cuda and kernels and not slow" -p no:cacheprovider ${k:+-k "$k"} "$f" &
        done
      done
      wait
      for log in "$LOGS"/san_racecheck_*.log; do
        [ -f "$log" ] && note "[$(basename "$log" .log)] races in project kernels: $(own_races "$log")"
      done ;;
    soak)
      # 100,000 decode steps of the default model (compiled + graph replay, the caches filled and restarted every
      # ~200 steps), twice with the same seed: flat device memory, no recompile, no NaN, identical ids.
      step soak "${SOAK_TIMEOUT:-500}" $PY scripts/soak.py --steps "${SOAK_STEPS:-100000}"
      note "  $(grep -hE '^run |^soak' "$LOGS/soak.log" | cut -c1-400 | tr '\n' ' ')" ;;
    profile)
      # Nsight Compute on the NVFP4 linear (PROFILE_ARGS: --m 1,16,64; default the batch-1 GEMV and MoE): what
      # bounds them; text report in the logs.
      NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
      [ -n "$NCU" ] || { note "no ncu"; continue; }
      step profile_gemv "${PROFILE_TIMEOUT:-300}" "$NCU" --clock-control none --kernel-name "regex:nvfp4" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
        --section Occupancy --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis \
        $PY bench/profile_nvfp4_gemv.py ${PROFILE_ARGS:-} ;;
    bench)
      for b in ${BENCHES:-bench/bench_*.py}; do
        step "$(basename "$b" .py)" 300 $PY "$b"
      done ;;
    switches)
      # The debug overrides (DecodeOptions hc_pre=0: mHC as tensor ops; attention=torch; the kernel override
      # attn_kernel=simt: the CUDA-core attention kernel): the model-level tests, the kernel count, and the layer
      # each way (what the defaults buy).
      step switches_op_tests 150 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_hc_pre.py \
        tests/test_attn.py tests/test_decode_options.py
      step switches_count_kernels 200 $PY scripts/count_decode_kernels.py --device cuda
      step switches_layer_default 200 $PY bench/bench_layer.py --kinds csa --steps 50 --experts 16
      step switches_layer_off 200 $PY bench/bench_layer.py --kernel-overrides attn_kernel=simt --kinds csa --steps 50 \
        --experts 16 --decode-options "hc_pre=0,attention=torch" ;;
    decode)
      # The decode step end to end: the compiled / graph-replayed step against eager, the default model's exported
      # package and bf16 settings, and the per-layer time and kernel count (what a model-level change moves).
      step decode_compiled 200 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_compiled_decode.py
      step decode_layers 200 $PY bench/bench_layer.py --kinds csa,hca,swa --steps 50 --experts 16
      step decode_count_kernels 200 $PY scripts/count_decode_kernels.py --device cuda
      step decode_default_model 420 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_default_model_gpu.py \
        -k "exported or bf16" ;;
    depth)
      # Compile + capture against depth: whole-step vs regional compilation of a 43-layer V4-Flash-width model and
      # the 2-layer slice, each cold and warm in fresh processes (#25's figures).
      step compile_depth "${DEPTH_TIMEOUT:-580}" $PY bench/bench_compile_depth.py --models "${DEPTH_MODELS:-flash43,flash2}"
      note "  $(grep -hE 'prepare|vs whole' "$LOGS/compile_depth.log" | tr '\n' ' ')" ;;
    fulldepth)
      # #28's one-GPU figures: the 43-layer V4-Flash-width model (random NVFP4, as many experts as fit) at 4K and
      # 128K context, B = 1 / 8 / 64, and the 61-layer V4-Pro-width stack at 4K, B = 1 / 8.
      step fulldepth_flash_4k 300 $PY bench/bench_parallel_decode.py --preset flash --context 4096 --batches 1,8,64
      step fulldepth_flash_128k 240 $PY bench/bench_parallel_decode.py --preset flash --context 131072 \
        --batches 1,8,64 --regional
      step fulldepth_pro_4k 240 $PY bench/bench_parallel_decode.py --preset pro --context 4096 --batches 1,8 --regional
      for f in flash_4k flash_128k pro_4k; do note "$(grep -hvE '^\[dsv4\]|Warning|warn' "$LOGS/fulldepth_$f.log" | tail -n 8)"; done ;;
    ab)
      # Same-machine A/B of the layer: AB_BASE_TGZ (e.g. `git archive REV dsv4_model bench dsv4_ops | gzip`) is the
      # base tree; it runs on this tree's built library (valid only when the op sources did not change). Base and
      # this tree alternate AB_ROUNDS times so machine drift hits both alike.
      [ -n "${AB_BASE_TGZ:-}" ] || { note "ab: AB_BASE_TGZ not set"; continue; }
      AB_DIR=$(mktemp -d); tar -xzf "$AB_BASE_TGZ" -C "$AB_DIR" && cp dsv4_ops/*.so "$AB_DIR/dsv4_ops/"
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for side in base head; do
          dir=$PWD; [ "$side" = base ] && dir=$AB_DIR
          step "ab_${side}_$round" 200 env PYTHONPATH="$dir" $PY "$dir/bench/bench_layer.py" --kinds "${AB_KINDS:-csa,hca,swa}" \
            --steps 50 --experts 16
          note "  $(grep -hE '^(csa|hca|swa) ' "$LOGS/ab_${side}_$round.log" | tr -s ' ' | tr '\n' ';')"
        done
      done ;;
    pdl)
      # The pdl kernel override (on by default): the decode kernels outside the NVFP4 chain launched with programmatic
      # dependent launch. Their op tests and the compiled decode without it (the default run has it), then the
      # layer both ways.
      step pdl_op_tests 200 $PY -m pytest -q -m cuda -p no:cacheprovider --kernel-overrides pdl=0 \
        tests/test_compressor_op.py \
        tests/test_norm_rope.py tests/test_hc_pre.py tests/test_hadamard_fp4.py tests/test_key_store.py \
        tests/test_attn.py tests/test_indexer.py tests/test_router.py tests/test_fp32_linear.py \
        tests/test_nvfp4_quant.py
      step pdl_compiled 150 $PY -m pytest -q -m cuda -x -p no:cacheprovider tests/test_compiled_decode.py \
        -k "graph_logits"
      step pdl_layer_off 200 $PY bench/bench_layer.py --kernel-overrides pdl=0 --kinds csa --steps 50 --experts 16
      step pdl_layer_on 200 $PY bench/bench_layer.py --kinds csa --steps 50 --experts 16 ;;
  esac
done
