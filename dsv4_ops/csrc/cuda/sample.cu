// CUDA kernels of dsv4::sample (no torch headers; launched from sample_bindings.cpp).
//  1. sample_threshold_kernel (one CTA per row): for rows with top-k and/or top-p, finds the smallest kept
//     radix key tau by an 8-bit-digit radix search over the row (counts for top-k, 2^-40 fixed-point mass for
//     top-p); other rows exit at once.
//  2. sample_partial_kernel (rows split over many CTAs so batch 1 still uses the whole GPU): per chunk, the
//     argmax of logit (greedy rows) or logit/T + Gumbel (sampling rows, keys >= tau).
//  3. sample_finalize_kernel: reduces the chunk winners of each row.
// No host sync, no allocation, every per-step value is read from device memory: safe inside CUDA graphs.
#include <cuda_runtime.h>
#include <stdint.h>

#include "../sample_math.h"
#include "device_info.h"
#include "launchers.h"

namespace {

using namespace dsv4_sample;

constexpr int kThreshThreads = 1024;
constexpr int kPartialThreads = 256;
constexpr int kCtasPerSm = 2;  // partial-kernel CTAs per SM (264 on an H200's 132 SMs)
constexpr int kNoIndex = 0x7fffffff;

struct Params {
  const float* logits;
  const float* temperature;
  const int64_t* top_k;
  const float* top_p;
  const int64_t* seed;
  const int64_t* offset;
  int64_t B, V;
};

__device__ __forceinline__ bool row_filters(const Params& p, int64_t b, bool* use_k, bool* use_p) {
  const float t = p.temperature[b];
  const int64_t k = p.top_k[b];
  *use_k = k > 0 && k < p.V;
  *use_p = p.top_p[b] < 1.0f;
  return t > 0.0f && (*use_k || *use_p);
}

__device__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;  // valid in every thread
}

__device__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : 0ull;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Smallest present key v >= lower with W(key > v) < target (W: unit weights, or fixed-point mass if by_mass).
// Digit by digit from the top: the answer lies in the LOWEST non-empty bucket whose mass above it (mass
// above the current prefix + higher buckets) is still < target, because that mass only grows downwards.
// Must be called by the whole block (uniform trip counts: the warp intrinsics need converged warps).
__device__ uint32_t radix_threshold(const float* row, int64_t V, uint32_t lower, bool by_mass, float row_max,
                                    float t, double target, unsigned long long* hist,
                                    unsigned long long* warp_tot, int* sel, unsigned long long* sel_above) {
  uint32_t prefix = 0;
  unsigned long long above = 0;
  const int lane = threadIdx.x & 31;
  for (int level = 0; level < 4; ++level) {
    const int shift = 24 - 8 * level;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    if (threadIdx.x == 0) *sel = 256;
    __syncthreads();
    for (int64_t base = 0; base < V; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      unsigned bucket = 256u;  // 256 = not counted
      unsigned long long w = 0;
      if (i < V) {
        const float x = row[i];
        const uint32_t key = order_key(x);
        if (key >= lower && (level == 0 || (key >> (shift + 8)) == (prefix >> (shift + 8)))) {
          w = by_mass ? fixed_mass(x, row_max, t) : 1ull;
          if (w) bucket = (key >> shift) & 255u;
        }
      }
      // Logits share few top-digit buckets, so aggregate equal buckets per warp before the shared atomic.
      // Mass <= 2^40 is summed as two 20-bit halves (32 lanes x 2^20 fits the 32-bit reduction).
      const unsigned peers = __match_any_sync(0xffffffffu, bucket);
      const unsigned lo = __reduce_add_sync(peers, (unsigned)(w & 0xFFFFFull));
      const unsigned hi = __reduce_add_sync(peers, (unsigned)(w >> 20));
      if (bucket < 256u && lane == __ffs(peers) - 1)
        atomicAdd(&hist[bucket], ((unsigned long long)hi << 20) + lo);
    }
    __syncthreads();
    // Suffix sums: thread j owns bucket 255 - j, so an inclusive prefix scan over j is a suffix scan.
    unsigned long long incl = 0, h = 0;
    const int j = threadIdx.x;
    if (j < 256) {
      h = hist[255 - j];
      incl = h;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
      }
      if (lane == 31) warp_tot[j >> 5] = incl;
    }
    __syncthreads();
    unsigned long long excl = 0;  // mass in the buckets above 255 - j
    if (j < 256) {
      for (int w = 0; w < (j >> 5); ++w) incl += warp_tot[w];
      excl = incl - h;
      if (h > 0 && (double)(above + excl) < target) atomicMin(sel, 255 - j);
    }
    __syncthreads();
    const int bsel = *sel;
    // The bucket holding the largest remaining key always qualifies, so bsel < 256 for valid inputs.
    if (bsel >= 256) return prefix;
    if (j < 256 && 255 - j == bsel) *sel_above = excl;
    __syncthreads();
    above += *sel_above;
    prefix |= (uint32_t)bsel << shift;
    __syncthreads();
  }
  return prefix;
}

__global__ void __launch_bounds__(kThreshThreads) sample_threshold_kernel(Params p, uint32_t* thresh) {
  __shared__ unsigned long long hist[256];
  __shared__ unsigned long long red[32];
  __shared__ float fred[32];
  __shared__ int sel;
  __shared__ unsigned long long sel_above;
  const int64_t b = blockIdx.x;
  bool use_k, use_p;
  if (!row_filters(p, b, &use_k, &use_p)) {
    if (threadIdx.x == 0) thresh[b] = 0;
    return;
  }
  const float* row = p.logits + b * p.V;
  const float t = p.temperature[b];
  uint32_t tau = 0;
  if (use_k)
    tau = radix_threshold(row, p.V, 0, false, 0.0f, t, (double)p.top_k[b], hist, red, &sel, &sel_above);
  if (use_p) {
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < p.V; i += blockDim.x) m = fmaxf(m, sanitize(row[i]));
    m = block_max(m, fred);
    unsigned long long z = 0;
    for (int64_t i = threadIdx.x; i < p.V; i += blockDim.x)
      if (order_key(row[i]) >= tau) z += fixed_mass(row[i], m, t);
    z = block_sum_u64(z, red);
    __syncthreads();
    if (z > 0) {
      const uint32_t tp = radix_threshold(row, p.V, tau, true, m, t, top_p_target(p.top_p[b], z), hist, red,
                                         &sel, &sel_above);
      tau = tp > tau ? tp : tau;
    }
  }
  if (threadIdx.x == 0) thresh[b] = tau;
}

__device__ __forceinline__ void take(float v, int i, float& bv, int& bi) {
  if (better(v, i, bv, bi)) bv = v, bi = i;
}

__device__ void block_argmax(float& bv, int& bi, float* sv, int* si) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    take(ov, oi, bv, bi);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    bv = lane < nwarps ? sv[lane] : -INFINITY;
    bi = lane < nwarps ? si[lane] : kNoIndex;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      take(ov, oi, bv, bi);
    }
  }
}

// grid (splits, B). Each thread walks groups of 4 consecutive elements (one Philox call per group).
__global__ void __launch_bounds__(kPartialThreads)
    sample_partial_kernel(Params p, const uint32_t* thresh, int64_t groups_per_split, float* part_v, int* part_i) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const int64_t b = blockIdx.y;
  const int64_t split = blockIdx.x, splits = gridDim.x;
  const float* row = p.logits + b * p.V;
  const float t = p.temperature[b];
  const bool greedy = !(t > 0.0f);
  const uint32_t tau = thresh[b];
  const uint64_t seed = (uint64_t)p.seed[b], offset = (uint64_t)p.offset[b];
  const int64_t n_groups = (p.V + 3) / 4;
  const int64_t g_end = min(n_groups, (split + 1) * groups_per_split);
  float bv = -INFINITY;
  int bi = kNoIndex;
  for (int64_t g = split * groups_per_split + threadIdx.x; g < g_end; g += blockDim.x) {
    const int64_t i0 = g * 4;
    const int n = (int)min((int64_t)4, p.V - i0);
    if (greedy) {
      for (int e = 0; e < n; ++e) take(sanitize(row[i0 + e]), (int)(i0 + e), bv, bi);
    } else {
      uint32_t w[4];
      philox_group(seed, offset, (uint64_t)g, w);
      for (int e = 0; e < n; ++e) {
        const float x = row[i0 + e];
        if (order_key(x) < tau) continue;
        take(sanitize(x) / t + gumbel_from_word(w[e]), (int)(i0 + e), bv, bi);
      }
    }
  }
  block_argmax(bv, bi, sv, si);
  if (threadIdx.x == 0) {
    part_v[b * splits + split] = bv;
    part_i[b * splits + split] = bi;
  }
}

// One warp per row.
__global__ void sample_finalize_kernel(const float* part_v, const int* part_i, int splits, int64_t B, int64_t* out) {
  const int64_t b = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (b >= B) return;
  float bv = -INFINITY;
  int bi = kNoIndex;
  for (int s = lane; s < splits; s += 32) take(part_v[b * splits + s], part_i[b * splits + s], bv, bi);
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    take(ov, oi, bv, bi);
  }
  if (lane == 0) out[b] = bi;
}

}  // namespace

// Splits per row so that B rows fill kCtasPerSm CTAs per SM of the current device (the bindings' CUDAGuard).
extern "C" int dsv4_sample_num_splits(int64_t B, int64_t V) {
  const int64_t target_ctas = int64_t(kCtasPerSm) * dsv4_cuda::sm_count();
  const int64_t groups = (V + 3) / 4;
  const int64_t max_splits = (groups + kPartialThreads - 1) / kPartialThreads;  // >= 1 group per thread
  int64_t s = (target_ctas + B - 1) / (B > 0 ? B : 1);
  if (s > max_splits) s = max_splits;
  if (s < 1) s = 1;
  return (int)s;
}

// Workspaces: thresh [B] uint32, part_v [B, splits] fp32, part_i [B, splits] int32.
extern "C" cudaError_t dsv4_sample_launch(const float* logits, const float* temperature, const int64_t* top_k,
                                          const float* top_p, const int64_t* seed, const int64_t* offset,
                                          int64_t B, int64_t V, int splits, uint32_t* thresh, float* part_v,
                                          int* part_i, int64_t* out, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  Params p{logits, temperature, top_k, top_p, seed, offset, B, V};
  sample_threshold_kernel<<<(unsigned)B, kThreshThreads, 0, stream>>>(p, thresh);
  const int64_t groups = (V + 3) / 4;
  const int64_t per_split = (groups + splits - 1) / splits;
  sample_partial_kernel<<<dim3((unsigned)splits, (unsigned)B), kPartialThreads, 0, stream>>>(p, thresh, per_split,
                                                                                         part_v, part_i);
  const int rows_per_cta = 8;
  sample_finalize_kernel<<<(unsigned)((B + rows_per_cta - 1) / rows_per_cta), rows_per_cta * 32, 0, stream>>>(
      part_v, part_i, splits, B, out);
  return cudaGetLastError();
}
