#!/usr/bin/env bash
# One-time set-up on a fresh machine (idempotent): torch, the Python dependencies, the op library.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Install torch 2.13.0 (CPU wheel here) explicitly first: a bare range would pull a multi-GB CUDA build.
if ! $PY -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
# The main job needs only CORE; the rest serve the tests, the server and the parity references. A machine with no
# package index (the GPU machine) still runs the main job when CORE is there: one warning names what is missing.
CORE="pybind11 safetensors tokenizers huggingface_hub"
REST="scikit_build_core transformers tqdm pytest ninja fastapi uvicorn prometheus_client openai httpx"
missing_of() { $PY -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@"; }
missing=$(missing_of $CORE $REST)
if [ -n "$missing" ] && ! $PY -m pip install -q --retries 1 --timeout 10 -r requirements.txt; then
  missing_core=$(missing_of $CORE)
  [ -z "$missing_core" ] || { echo "setup: cannot install $missing_core (needed by the main job)" >&2; exit 1; }
  echo "setup: could not install $missing; the main job runs without them (tests / serve that need them will not)" >&2
fi
bash scripts/build_ops.sh
