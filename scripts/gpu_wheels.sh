#!/usr/bin/env bash
# The server's Python packages as wheels for the GPU machine (Python 3.12, no package index there), into .wheels/
# (ignored by git; name it in the device call's carry). scripts/gpu/serve.sh installs them from there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qs '^/.wheels/$' .git/info/exclude || echo "/.wheels/" >> .git/info/exclude
${PYTHON:-python3} -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .wheels fastapi==0.165.0 uvicorn==0.55.0 prometheus_client==0.26.0 openai==3.63.0 httpx
du -sh .wheels
