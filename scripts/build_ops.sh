#!/usr/bin/env bash
# Builds the op library against the installed torch and drops libdsv4_ops.so + the _C module into
# dsv4_ops/ (so `import dsv4_ops` works from the repository root). Incremental: reuses $DSV4_BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${DSV4_BUILD_DIR:-build}
PY=${PYTHON:-python3}
TORCH_PREFIX=$($PY -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
PYBIND_DIR=$($PY -m pybind11 --cmakedir)
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
COMPILERS=()
# Inductor/AOTI and this library must share the libstdc++ of the running process: on the GPU machine
# /opt/gcc's g++ is newer than the system libstdc++ that Python loads, so prefer the system compiler.
if [ -x /usr/bin/g++ ]; then
  COMPILERS=(-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++)
fi
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${GEN[@]}" "${COMPILERS[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -Dpybind11_DIR="$PYBIND_DIR" \
    -DPython_EXECUTABLE="$(command -v $PY)" -DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" >/dev/null
fi
cmake --build "$BUILD_DIR" -j "${DSV4_BUILD_JOBS:-$(nproc)}"
if nm -DC "$BUILD_DIR/libdsv4_ops.so" 2>/dev/null | grep -qE " [TW] std::.*codecvt<"; then
  echo "build_ops: $BUILD_DIR/libdsv4_ops.so carries a static copy of libstdc++ (exported std::codecvt symbols);" \
       "its iostream formatting (every TORCH_CHECK message) would crash the process." >&2
  [ -n "${DSV4_ALLOW_STATIC_LIBSTDCXX:-}" ] || exit 1
  echo "build_ops: WARNING: kept anyway (DSV4_ALLOW_STATIC_LIBSTDCXX)" >&2
fi
[ -n "${DSV4_NO_INSTALL:-}" ] && { echo "dsv4_ops built in $BUILD_DIR (not copied)"; exit 0; }
# Copy then rename: a process that has the old library mapped keeps a valid file.
for f in "$BUILD_DIR"/libdsv4_ops.so "$BUILD_DIR"/_C*.so; do
  cp "$f" "dsv4_ops/.$(basename "$f").tmp" && mv -f "dsv4_ops/.$(basename "$f").tmp" "dsv4_ops/$(basename "$f")"
done
echo "dsv4_ops built in $BUILD_DIR"
