#!/usr/bin/env bash
# Everything the GPU machine must show, in one call (device time is scarce): build the CUDA library, then the parts
# asked for, each a file scripts/gpu/PART.sh. $OUT gets summary.txt + logs.tgz (a device call returns few files).
# Usage on the H200, from the repo root:
#   bash scripts/gpu_check.sh [PART ...]    (default: mainjob tests sanitizer bench)
# Parts: mainjob gate tests sanitizer bench soak profile switches pdl decode depth fulldepth ab speculate prefill serve continuous
#   multigpu (a machine of 2+ GPUs: issue #32)
# Knobs (environment):
#   GPU_CHECK_SECONDS     a total budget: steps get what is left and are skipped once it is spent
#   GPU_CHECK_SKIP_BUILD=1  the library is already built (parallel runs share one build)
#   GPU_CHECK_DRY_RUN=1   print each step's command instead of running it (no GPU needed)
#   TEST_FILES, BENCHES   space-separated paths for `tests` / `bench` (default: all)
#   SANITIZE              a grep -E pattern on "TOOL SPEC": only the sanitizer runs it matches
#   SANITIZER_JOBS (8), SANITIZER_TIMEOUT (300 s)   parallel sanitizer runs and each one's limit
#   SPECULATE_KS ("0 1 2 3"), SPECULATE_PRESET / _DRAFTERS / _PRESET_KS / _PROFILE / _PROFILE_DRAFTERS, PROFILE_ARGS, AB_BASE_TGZ, AB_ROUNDS (2), PDL_ROUNDS (1), PDL_BATCHES, PDL_TESTS
#                         see the part's file
#   SERVE_CONCURRENCY ("1 8 32"), SERVE_PRESETS, SERVE_ARGS (more --preset-server arguments), SERVE_PORT, SERVE_UP_SECONDS, CONTINUOUS_MODELS, CONTINUOUS_C, CONTINUOUS_ARGS,
#   CONTINUOUS_PREFILL_C   see scripts/gpu/serve.sh, continuous.sh
#   OUT (out), PYTHON (python3)
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
DRY=${GPU_CHECK_DRY_RUN:-}
source scripts/gpu/lib.sh
trap finish EXIT
trap 'exit 143' TERM INT
for part in $PARTS; do
  [ -f "scripts/gpu/$part.sh" ] || { note "unknown part: $part"; exit 2; }
done
if [ -n "$DRY" ]; then note "dry run: $PARTS"
else
  note "date: $(date -u +%FT%TZ)  $($PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))')"
fi
build_library || exit 1
for part in $PARTS; do
  source "scripts/gpu/$part.sh"
done
