#!/usr/bin/env bash
# Runs the CUDA tests one file per process, so one crash cannot hide the other files' results.
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
for f in tests/test_*.py; do
  n=$(basename "$f" .py)
  timeout "${PER_FILE_TIMEOUT:-150}" python3 -m pytest -q -m cuda -rs -p no:cacheprovider "$f" > "$OUT/$n.log" 2>&1
  echo "$n rc=$? $(grep -E 'passed|failed|error|Fatal' "$OUT/$n.log" | tail -1)" | tee -a "$OUT/summary.txt"
done
