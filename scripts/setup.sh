#!/usr/bin/env bash
# One-time set-up on a fresh machine (idempotent): torch, the Python dependencies, the op library.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Install torch 2.13.0 (CPU wheel here) explicitly first: a bare range would pull a multi-GB CUDA build.
if ! $PY -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
if ! $PY -c 'import pybind11, scikit_build_core, safetensors, tokenizers, huggingface_hub, transformers, tqdm, pytest, ninja, fastapi, uvicorn, prometheus_client, openai' 2>/dev/null; then
  $PY -m pip install -q -r requirements.txt
fi
bash scripts/build_ops.sh
