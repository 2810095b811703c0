#!/usr/bin/env bash
# Set-up (idempotent) and the whole test suite. CUDA tests skip on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ${PYTHON:-python3} -m pytest -q -rs "$@" tests
