#!/usr/bin/env bash
# Main job: set-up (idempotent), then stream a completion from the built-in default model.
# Extra arguments go to `python -m dsv4_model generate` (e.g. --model PATH, --temperature 0.8).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2  # set-up chatter stays out of the completion on stdout
exec ${PYTHON:-python3} -m dsv4_model generate --prompt "def fibonacci(n):" --max-new-tokens 64 "$@"
