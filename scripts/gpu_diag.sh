#!/usr/bin/env bash
# Temporary diagnosis run: does a TORCH_CHECK thrown from a dsv4 kernel crash the process?
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
PY=python3
export PYTHONPATH=$PWD
cat > /tmp/throw_cpu.py <<'PY'
import torch, dsv4_ops
try:
    torch.ops.dsv4.nvfp4_quantize(torch.randn(3, 10), torch.tensor(1.0))
except RuntimeError as e:
    print("CPU throw ok:", str(e)[:80])
PY
cat > /tmp/throw_cuda.py <<'PY'
import torch, dsv4_ops
try:
    torch.ops.dsv4.nvfp4_quantize(torch.randn(3, 10, device="cuda"), torch.tensor(1.0, device="cuda"))
except RuntimeError as e:
    print("CUDA throw ok:", str(e)[:80])
PY
for s in cpu cuda; do
  timeout 60 $PY /tmp/throw_$s.py > "$OUT/throw_$s.log" 2>&1; echo "throw_$s rc=$?" | tee -a "$OUT/summary.txt"
  tail -3 "$OUT/throw_$s.log"
done
if command -v cuda-gdb >/dev/null; then
  timeout 120 cuda-gdb -batch -ex run -ex bt --args $PY /tmp/throw_cuda.py > "$OUT/gdb_throw.log" 2>&1
  grep -E "^#|signal|SIG" "$OUT/gdb_throw.log" | head -40
fi
g++ --version | head -1; /usr/bin/g++ --version | head -1; ldd dsv4_ops/libdsv4_ops.so | grep -E "stdc|cudart"
