// The L2 prefetch kernel of dsv4::prefetch_l2 (docs/ops.md "## L2 prefetch"). Each warp's lane 0 asks the TMA
// unit of its SM for one piece of kPiece bytes (cp.async.bulk.prefetch.L2: no destination, no completion to wait
// for), so the pieces of tens of MB spread over many SMs and the kernel ends as soon as they are issued; HBM then
// fills L2 while the kernels after it run. L2 is the GPU's point of coherence, so a prefetch cannot make a later
// read stale: the kernel reads no value and needs no wait for its predecessor, except for its marker write.
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/launchers.h"
#include "cuda/pdl.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kPiece = 32 * 1024;  // bytes per prefetch instruction: ~30 MB -> ~1000 pieces, ~120 CTAs

struct PrefetchList {
  const uint8_t* ptr[dsv4_limits::kPrefetchMaxTensors];
  int64_t bytes[dsv4_limits::kPrefetchMaxTensors];
  int64_t first_piece[dsv4_limits::kPrefetchMaxTensors + 1];  // exclusive prefix of the pieces per tensor
  int n;
};

__global__ void __launch_bounds__(kThreads) prefetch_l2_kernel(const PrefetchList l, int64_t* marker, int64_t total) {
  // Nothing here is read by a later kernel but the marker: successors may be scheduled at once.
  dsv4_cuda::grid_dep_launch();
  const int lane = threadIdx.x & 31;
  const int64_t piece = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (lane == 0 && piece < l.first_piece[l.n]) {
    int t = 0;
    while (piece >= l.first_piece[t + 1]) ++t;
    // the piece's 16-byte-aligned interior (the instruction's granule); a ragged end of < 16 bytes is left out
    const uintptr_t base = reinterpret_cast<uintptr_t>(l.ptr[t]);
    const uintptr_t lo = base + uintptr_t((piece - l.first_piece[t]) * kPiece);
    const uintptr_t hi_piece = lo + uintptr_t(kPiece), hi_tensor = base + uintptr_t(l.bytes[t]);
    const uintptr_t a = (lo + 15) & ~uintptr_t(15), b = (hi_piece < hi_tensor ? hi_piece : hi_tensor) & ~uintptr_t(15);
    if (b > a)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(uint32_t(b - a)) : "memory");
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    dsv4_cuda::grid_dep_wait();  // the marker's previous writer is done
    *marker = total;
  }
}

}  // namespace

extern "C" cudaError_t dsv4_prefetch_l2_launch(const void* const* ptrs, const int64_t* bytes, int n,
                                               int64_t* marker, int64_t total, cudaStream_t stream) {
  if (n < 0 || n > dsv4_limits::kPrefetchMaxTensors) return cudaErrorInvalidValue;
  PrefetchList l{};
  l.n = n;
  l.first_piece[0] = 0;
  for (int i = 0; i < n; ++i) {
    l.ptr[i] = static_cast<const uint8_t*>(ptrs[i]);
    l.bytes[i] = bytes[i];
    l.first_piece[i + 1] = l.first_piece[i] + (bytes[i] + kPiece - 1) / kPiece;
  }
  const int64_t ctas = (l.first_piece[n] + kWarps - 1) / kWarps;
  return dsv4_cuda::launch_ex(dsv4_cuda::decode_pdl(), prefetch_l2_kernel, dim3(unsigned(ctas > 0 ? ctas : 1)),
                              dim3(kThreads), 0, stream, l, marker, total);
}
