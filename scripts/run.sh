#!/usr/bin/env bash
# Main job: set-up (idempotent), then stream a completion from the built-in default model.
# Extra arguments go to `python -m dsv4_model generate` (e.g. --model PATH, --temperature 0.8); a --prompt or
# --prompt-file of yours replaces the default prompt. DSV4_SKIP_SETUP=1 skips the set-up check (repeat runs).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${DSV4_SKIP_SETUP:-}" ] || bash scripts/setup.sh >&2  # set-up chatter stays out of the completion on stdout
prompt=(--prompt "def fibonacci(n):")
for arg in "$@"; do
  case "$arg" in --pro*) prompt=() ;; esac  # --prompt, --prompt-file and what argparse takes for them (--prompt-f)
done
exec ${PYTHON:-python3} -m dsv4_model generate ${prompt[@]+"${prompt[@]}"} --max-new-tokens 64 "$@"
