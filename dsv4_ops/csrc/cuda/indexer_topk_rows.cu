// CUDA kernel of dsv4::indexer_topk over many rows (prefill: a chunk's queries, each over the entries it sees):
// one CTA per row, no cluster. The decode kernel (indexer.cu) spreads one row over a cluster of 8 CTAs, which
// pays for itself on a few long rows but not on thousands of short ones: at 8192 rows of 2048 scores it ran
// 0.58x torch.topk (bench/RESULTS.md, session 35). No torch headers: indexer.cu's launcher dispatches here.
//
// Per row: an MSB-first radix select with 8-bit digits on the 64-bit composite (topk_select.cuh), each pass one
// histogram in shared memory (one atomic per distinct digit of a warp's 32 keys: scores crowd into a few exponents,
// and same-address atomics serialize), the row's order keys cached in shared memory after the first read when
// they fit; then the k composites >= the selected prefix are gathered (one atomic per warp) and bitonic-sorted.
#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.h"
#include "pdl.h"
#include "topk_select.cuh"

namespace {

using namespace dsv4_cuda;  // topk_select.cuh, pdl.h

constexpr int kSmemBudget = 200 * 1024;
constexpr int kShortRow = 4096;  // rows up to this many scores: 256 threads (8 CTAs per SM), longer: 1024

template <int THREADS>
__global__ void __launch_bounds__(THREADS, 2048 / THREADS)
    indexer_topk_rows_kernel(const float* __restrict__ scores, int N, int k, int kpad, int cached,
                             int64_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned long long* cand = reinterpret_cast<unsigned long long*>(smem);  // [kpad]
  uint32_t* cache = reinterpret_cast<uint32_t*>(cand + kpad);               // [N] when cached
  __shared__ unsigned hist[2][256];  // pass p uses hist[p & 1]: no barrier between reading one and zeroing the next
  __shared__ unsigned s_count;
  __shared__ int s_digit;
  __shared__ unsigned s_above;
  grid_dep_wait();

  const int tid = threadIdx.x, lane = tid & 31;
  const float* row = scores + static_cast<int64_t>(blockIdx.x) * N;
  int64_t* orow = out + static_cast<int64_t>(blockIdx.x) * k;
  const uint32_t nm1 = static_cast<uint32_t>(N - 1);
  auto key_at = [&](int i, bool first) -> uint32_t {
    if (!cached) return order_key(__ldg(row + i));
    if (!first) return cache[i];
    const uint32_t key = order_key(__ldg(row + i));
    cache[i] = key;  // read back only by this thread (same i in every pass)
    return key;
  };
  for (int j = tid; j < kpad; j += THREADS) cand[j] = 0ull;  // the sort's padding past the k winners
  if (tid == 0) s_count = 0;

  const int npass = radix_passes(nm1);
  unsigned long long prefix = 0;
  unsigned krem = static_cast<unsigned>(k);
  for (int p = 0; p < npass; ++p) {
    const int shift = radix_shift(p, npass);
    const unsigned long long mask = radix_mask_above(shift);
    unsigned* h = hist[p & 1];
    for (int j = tid; j < 256; j += THREADS) h[j] = 0;
    __syncthreads();
    for (int base = 0; base < N; base += THREADS) {  // the same trip count in every lane: warp collectives
      const int i = base + tid;
      bool in = false;
      unsigned digit = 256u;
      if (i < N) {
        const unsigned long long cmp =
            (static_cast<unsigned long long>(key_at(i, p == 0)) << 32) | (nm1 - static_cast<uint32_t>(i));
        in = (cmp & mask) == prefix;
        if (in) digit = static_cast<unsigned>(cmp >> shift) & 255u;
      }
      if (__ballot_sync(0xffffffffu, in) == 0u) continue;
      const unsigned peers = __match_any_sync(0xffffffffu, digit);  // the warp's lanes with this lane's digit
      if (in && lane == __ffs(peers) - 1) atomicAdd(&h[digit], static_cast<unsigned>(__popc(peers)));
    }
    __syncthreads();
    if (tid < 32) radix_find_digit(h, krem, &s_digit, &s_above);
    __syncthreads();
    const int d = s_digit;
    krem -= s_above;
    prefix |= static_cast<unsigned long long>(d) << shift;
    if (h[d] == krem) break;  // every composite with this prefix is selected (the same decision in every thread)
  }

  // The k composites >= prefix (all lanes of a warp run the same iterations, so the ballot sees the whole warp).
  for (int base = 0; base < N; base += THREADS) {
    const int i = base + tid;
    const unsigned long long cmp =
        i < N ? (static_cast<unsigned long long>(key_at(i, false)) << 32) | (nm1 - static_cast<uint32_t>(i)) : 0ull;
    const bool take = i < N && cmp >= prefix;
    const unsigned m = __ballot_sync(0xffffffffu, take);
    unsigned first = 0;
    if (lane == 0 && m) first = atomicAdd(&s_count, static_cast<unsigned>(__popc(m)));
    first = __shfl_sync(0xffffffffu, first, 0);
    const unsigned pos = first + __popc(m & ((1u << lane) - 1u));
    if (take && pos < static_cast<unsigned>(k)) cand[pos] = cmp;
  }
  __syncthreads();
  bitonic_sort_desc(cand, kpad);
  for (int j = tid; j < k; j += THREADS) orow[j] = static_cast<int64_t>(nm1 - static_cast<uint32_t>(cand[j]));
}

template <int THREADS>
cudaError_t launch_rows(const float* scores, int rows, int N, int topk, int kpad, int64_t* out, cudaStream_t stream) {
  const size_t base = static_cast<size_t>(kpad) * sizeof(unsigned long long);
  const bool cached = base + static_cast<size_t>(N) * 4 <= static_cast<size_t>(kSmemBudget);
  const size_t smem = base + (cached ? static_cast<size_t>(N) * 4 : 0);
  const auto kernel = indexer_topk_rows_kernel<THREADS>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return launch_ex(decode_pdl(), kernel, dim3(rows), dim3(THREADS), smem, stream, scores, N, topk, kpad,
                   int(cached), out);
}

}  // namespace

extern "C" cudaError_t dsv4_indexer_topk_rows_launch(const float* scores, int64_t R, int N, int topk, int64_t* out,
                                                     cudaStream_t stream) {
  int kpad = 1;
  while (kpad < topk) kpad <<= 1;
  constexpr int64_t kMaxRows = 0x7FFFFFFF;  // the grid's x
  for (int64_t r0 = 0; r0 < R; r0 += kMaxRows) {
    const int rows = static_cast<int>(R - r0 < kMaxRows ? R - r0 : kMaxRows);
    const float* s = scores + r0 * N;
    int64_t* o = out + r0 * topk;
    const cudaError_t err = N <= kShortRow ? launch_rows<256>(s, rows, N, topk, kpad, o, stream)
                                           : launch_rows<1024>(s, rows, N, topk, kpad, o, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}
