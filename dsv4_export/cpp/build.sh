#!/usr/bin/env bash
# Builds dsv4_export/cpp/dsv4_run against the installed torch's libtorch.
# Usage: bash dsv4_export/cpp/build.sh [BUILD_DIR]   (default: dsv4_export/cpp/build); prints the binary's path.
# The compiler must link the libstdc++ the runner will load (the one libtorch's process gets: the system one),
# chosen like the AOTI packages' compiler (dsv4_export/toolchain.py: the system g++ on the GPU machine, not $CXX =
# /opt/gcc's); DSV4_CXX overrides.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BUILD_DIR=${1:-$HERE/build}
PY=${PYTHON:-python3}
TORCH_PREFIX=$($PY -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
TORCH_VERSION=$($PY -c 'import torch; print(torch.__version__)')
REPO="$(cd "$HERE/../.." && pwd)"
CXX_BIN=${DSV4_CXX:-$(cd "$REPO" && $PY -m dsv4_export.toolchain)}
ARGS=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DDSV4_TORCH_VERSION="$TORCH_VERSION")
[ -n "$CXX_BIN" ] && ARGS+=(-DCMAKE_CXX_COMPILER="$CXX_BIN")
# A CUDA torch makes find_package(Torch) enable CUDA: use the same host compiler and arch as the op library.
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null 2>&1; then export PATH=/usr/local/cuda/bin:$PATH; fi
ARGS+=(-DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}")
[ -n "$CXX_BIN" ] && ARGS+=(-DCMAKE_CUDA_HOST_COMPILER="$CXX_BIN")
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
mkdir -p "$BUILD_DIR"
cmake -S "$HERE" -B "$BUILD_DIR" "${GEN[@]}" "${ARGS[@]}" >"$BUILD_DIR/configure.log" 2>&1 \
  || { cat "$BUILD_DIR/configure.log" >&2; exit 1; }
cmake --build "$BUILD_DIR" -j "${DSV4_BUILD_JOBS:-2}" >&2
echo "$BUILD_DIR/dsv4_run"
