# sanitizer: compute-sanitizer (memcheck, racecheck) on the direct kernel tests, SANITIZER_JOBS (8) runs at a time
# (each is bound by the sanitizer's host-side work, not by the GPU: all at once, each ran past its limit).
# Runs: FILE or FILE@K (a pytest -k expression, @ for spaces). The GEMM and sampler files time out as one run under
# the sanitizer: they are split. The chi-square test only draws more samples from the kernels the other sampler
# tests run: memcheck only (racecheck instruments every shared-memory access: far past the limit).
KERNEL_TESTS="tests/test_nvfp4_quant.py tests/test_indexer.py tests/test_indexer_prefill.py tests/test_mhc.py
  tests/test_fp32_linear.py tests/test_router.py tests/test_attn.py tests/test_hc_pre.py tests/test_compressor.py
  tests/test_norm_rope.py tests/test_hadamard.py tests/test_key_store.py
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
if [ -z "$DRY" ] && ! command -v compute-sanitizer >/dev/null; then note "no compute-sanitizer"; return 0; fi
# Not instrumented: PyTorch's and cuBLAS's kernels (the tests' references and glue: instrumenting them took most of
# each run, and racecheck reported only nvjet races). Racecheck keeps cuBLAS's kernels instrumented: with them left
# out it crashed inside them ("failed to handle a hardware exception").
skip_flags() { for sub in "$@"; do printf -- ' --kernel-name-exclude kns=%s' "$sub"; done; }
SKIP_memcheck=$(skip_flags native cub nvjet cutlass cublas gemm); SKIP_racecheck=$(skip_flags native cub)
if [ -n "$DRY" ]; then :
else
  compute-sanitizer --help 2>&1 | grep -A4 -E "kernel-name" > "$LOGS/san_help.log"
  if compute-sanitizer --tool racecheck $SKIP_memcheck $PY -c "import torch; torch.ones(4, device='cuda').sum()" \
      > "$LOGS/san_filter_probe.log" 2>&1; then note "sanitizer: not instrumented: memcheck$SKIP_memcheck; racecheck$SKIP_racecheck"
  else note "sanitizer: the kernel filter was refused ($(head -c 300 "$LOGS/san_filter_probe.log" | tr '\n' ' ')); every kernel instrumented"; SKIP_memcheck=""; SKIP_racecheck=""; fi
fi
for tool in memcheck racecheck; do
  specs=$KERNEL_TESTS; [ "$tool" = memcheck ] && specs="$KERNEL_TESTS $MEMCHECK_ONLY"
  skip_var=SKIP_$tool; skip=${!skip_var}
  for spec in $specs; do
    [ -n "${SANITIZE:-}" ] && ! echo "$tool $spec" | grep -qE "$SANITIZE" && continue
    f=${spec%%@*}; k=""; name="san_${tool}_$(basename "$f" .py)"
    if [ "$spec" != "$f" ]; then k=${spec#*@}; k=${k//@/ }; name="${name}_${k// /_}"; fi
    while [ "$(jobs -rp | wc -l)" -ge "${SANITIZER_JOBS:-8}" ]; do wait -n; done
    # -v --durations: a run cut off by its time limit still shows which tests finished and how long each took.
    # Host threads shared out: the tests' CPU work (references, repacking) in every run at once oversubscribed.
    step "$name" "${SANITIZER_TIMEOUT:-300}" env OMP_NUM_THREADS=$(( $(nproc) / ${SANITIZER_JOBS:-8} + 1 )) compute-sanitizer --tool "$tool" --error-exitcode 1 $skip \
      $PY -m pytest -v -x --durations=0 -m "cuda and kernels and not slow" -p no:cacheprovider ${k:+-k "$k"} "$f" &
  done
done
wait
for log in "$LOGS"/san_racecheck_*.log; do
  if [ -f "$log" ]; then note "[$(basename "$log" .log)] races in project kernels: $(own_races "$log")"; fi
done
