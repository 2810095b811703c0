# tests: the CUDA tests one file per process (a crash cannot hide other files' results); TEST_FILES picks files.
for f in ${TEST_FILES:-tests/test_*.py}; do
  step "$(basename "$f" .py)" 420 $PY -m pytest -q -m cuda -rs -p no:cacheprovider "$f"
done
