// CUDA kernels of dsv4::indexer_score_topk (sm_90a). No torch headers: indexer_bindings.cpp checks and launches.
//
// Kernel 1 (indexer_score_kernel): one CTA streams tiles of 64 FP4 keys of one row through a 4-stage cp.async
// ring, decodes them once into bf16 in shared memory (LUT of byte -> bf16x2, times the exact power-of-two block
// scale), and runs mma.sync m16n8k16 with heads as M (q fragments stay in registers for the whole CTA) and keys as
// N. The epilogue applies relu, the head weights and the head sum (shuffles within a warp, then a fixed-order sum
// over the warps of a key group) and stores each score as an order-preserving uint32.
// fp32 q is split into bf16 hi + lo (two MMAs into one accumulator): per-element error <= 2^-17 relative.
// Each head weight is rounded to bf16 / fp16 (RNE, as Tensor.to) and scaled in fp32 where it is loaded, so the
// model's `proj.to(bf16).float() * scale` needs no kernel of its own.
//
// Kernel 2 (indexer_topk_kernel): a cluster of 8 CTAs per row runs an MSB-first radix select (8-bit digits) on
// the 64-bit composite (score key << 32 | (N-1-i)). Composites are distinct, so the top-k set is exactly
// {composite >= k-th largest composite}: the documented order (score desc, index asc) including every tie.
// Histograms are reduced through distributed shared memory; each CTA keeps its slice of the row in shared
// memory when it fits. The k winners are gathered in CTA 0 and bitonic-sorted. Nothing reads device data on
// the host; shapes are static, so the op is CUDA-graph safe.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.h"
#include "mma.h"
#include "smem_copy.h"
#include "pdl.h"
#include "topk_select.cuh"

namespace cg = cooperative_groups;

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::launch_ex;

using dsv4_cuda::cp_async16;
using dsv4_cuda::cp_async4;
using dsv4_cuda::cp_async_commit;
using dsv4_cuda::cp_async_wait;
using dsv4_cuda::ldmatrix_x4;
using dsv4_cuda::mma_bf16;
using dsv4_cuda::smem_u32;
using dsv4_cuda::order_key;
using dsv4_cuda::radix_find_digit;
using dsv4_cuda::bitonic_sort_desc;

constexpr int kD = 128;              // head dim (DeepSeek-V4 indexer)
constexpr int kTK = 64;              // keys per tile
constexpr int kStages = 4;           // cp.async ring depth
constexpr int kThreads = 256;        // 8 warps; heads are zero-padded to 64 (zero q and weight add exactly 0)
constexpr int kKStride = kD + 8;     // bf16 per decoded key row: 272 B rows make ldmatrix conflict-free
constexpr int kCodeBytes = kD / 2;   // 64
constexpr int kScaleBytes = kD / 32; // 4

constexpr int kCluster = 8;
constexpr int kTopkThreads = 512;
constexpr int kMaxTopk = int(dsv4_limits::kIndexerCudaMaxTopk);
constexpr int kSmemBudget = 200 * 1024;
// Rows of at most this many valid keys (all selected) are ordered by counting ranks (nv compares per key, one
// pass) instead of a bitonic sort of topk's power of two (45 barrier-separated steps at topk 512).
constexpr int kRankSortMax = 128;


__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a);
  __nv_bfloat162 y = *reinterpret_cast<__nv_bfloat162*>(&b);
  __nv_bfloat162 z = __hmul2(x, y);
  return *reinterpret_cast<uint32_t*>(&z);
}

// bf16 bits of +-E2M1(nibble): values 0, .5, 1, 1.5, 2, 3, 4, 6 (exact), bit 3 = sign.
__device__ __forceinline__ uint32_t e2m1_bf16_bits(uint32_t nib) {
  const uint32_t m = nib & 7;
  const uint32_t mag = m == 0 ? 0u : (m == 1 ? 0x3F00u : (((126u + (m >> 1)) << 7) | ((m & 1) << 6)));
  return mag | ((nib & 8) << 12);
}

// UE8M0 e -> 2^(e-127) as bf16 (e = 0 is the bf16 subnormal 2^-127), replicated in both halves.
__device__ __forceinline__ uint32_t ue8m0_bf16x2(uint32_t e) {
  const uint32_t h = e ? (e << 7) : 0x0040u;
  return h | (h << 16);
}

// float(w.to(bf16 / fp16)) * scale: the same fp32 operations as the model's weight in PyTorch.
__device__ __forceinline__ float effective_weight(float w, int round, float scale) {
  if (round == 1) w = __bfloat162float(__float2bfloat16_rn(w));
  else if (round == 2) w = __half2float(__float2half_rn(w));
  return __fmul_rn(w, scale);
}

__device__ __forceinline__ long long read_n_valid(const void* n_valid, int is64, int b, int N) {
  long long v = is64 ? static_cast<const long long*>(n_valid)[b] : static_cast<const int*>(n_valid)[b];
  return v < 0 ? 0 : (v > N ? N : v);
}

// ------------------------------------------------------------------------------------------------------------
// Kernel 1: scores
// ------------------------------------------------------------------------------------------------------------
// bf16 q: warp = (head group of 32 heads = 2 m16 slabs) x (key group of 16 keys = 2 n8 tiles); 2 x 4 warps.
// fp32 q: warp = (head group of 16 heads, slabs = hi and lo parts) x (key group of 32 keys = 4 n8 tiles); 4 x 2.
template <bool kSplit>
__global__ void __launch_bounds__(kThreads, 2)
    indexer_score_kernel(const void* __restrict__ q, const float* __restrict__ weights, int weights_round,
                         float weights_scale, const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                         const void* __restrict__ n_valid, int nv_is64, int H, int N, int kv_batch,
                         uint32_t* __restrict__ keys_out, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  constexpr int kHG = kSplit ? 4 : 2;
  constexpr int kKG = (kThreads / 32) / kHG;
  constexpr int kKeysPerWarp = kTK / kKG;
  constexpr int kNT = kKeysPerWarp / 8;
  constexpr int kNAcc = kSplit ? 1 : 2;
  constexpr int kKSteps = kD / 16;

  __shared__ __align__(16) uint8_t s_codes[kStages][kTK * kCodeBytes];
  __shared__ __align__(16) uint8_t s_scales[kStages][kTK * kScaleBytes];
  __shared__ __align__(16) __nv_bfloat16 s_k[kTK * kKStride];
  __shared__ uint32_t s_lut[256];
  __shared__ float s_red[kHG][kTK];

  const int b = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hg = warp % kHG, kg = warp / kHG;
  const int g = lane >> 2, c = lane & 3;

  const long long nv = read_n_valid(n_valid, nv_is64, b, N);
  const int ntiles = static_cast<int>((nv + kTK - 1) / kTK);
  if (static_cast<int>(blockIdx.x) >= ntiles) return;  // uniform over the CTA

  const size_t kb = kv_batch ? b % kv_batch : b;  // the sequence whose keys row b scores
  const uint8_t* codes_row = codes + kb * N * kCodeBytes;
  const uint8_t* scales_row = scales + kb * N * kScaleBytes;

  // Every stage commits a group (possibly empty) so the wait count below is the same in every iteration.
  auto issue = [&](int it) {
    const int tile = blockIdx.x + it * gridDim.x;
    if (tile < ntiles) {
      const int stage = it % kStages;
      const long long key = static_cast<long long>(tile) * kTK + (tid >> 2);
      const bool ok = key < nv;
      cp_async16(smem_u32(&s_codes[stage][tid * 16]),
                 codes_row + (ok ? key : 0) * kCodeBytes + (tid & 3) * 16, ok ? 16 : 0);
      if (tid < kTK) {
        const long long key2 = static_cast<long long>(tile) * kTK + tid;
        const bool ok2 = key2 < nv;
        cp_async4(smem_u32(&s_scales[stage][tid * 4]), scales_row + (ok2 ? key2 : 0) * kScaleBytes, ok2 ? 4 : 0);
      }
    }
    cp_async_commit();
  };
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  s_lut[tid] = e2m1_bf16_bits(tid & 15) | (e2m1_bf16_bits(tid >> 4) << 16);  // kThreads == 256

  // q fragments (A operand, row-major 16 x 16 per k-step), kept for the whole CTA.
  uint32_t a[2][kKSteps][4];
  float w[kNAcc][2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int hbase = kSplit ? hg * 16 : hg * 32 + s * 16;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = hbase + g + ((r & 1) ? 8 : 0);
        const int col = ks * 16 + 2 * c + ((r & 2) ? 8 : 0);
        const size_t off = (static_cast<size_t>(b) * H + row) * kD + col;
        if (kSplit) {
          float2 x = make_float2(0.0f, 0.0f);
          if (row < H) x = *reinterpret_cast<const float2*>(static_cast<const float*>(q) + off);
          __nv_bfloat16 h0 = __float2bfloat16_rn(x.x), h1 = __float2bfloat16_rn(x.y);
          if (s == 1) {  // the low part: what bf16 missed of the fp32 value (the subtraction is exact)
            h0 = __float2bfloat16_rn(x.x - __bfloat162float(h0));
            h1 = __float2bfloat16_rn(x.y - __bfloat162float(h1));
          }
          a[s][ks][r] = bf16x2_bits(h0, h1);
        } else {  // two consecutive bf16 = the packed pair, lower element in the low half
          a[s][ks][r] = row < H ? *reinterpret_cast<const uint32_t*>(static_cast<const __nv_bfloat16*>(q) + off) : 0u;
        }
      }
    }
  }
  const float* wrow = weights + static_cast<size_t>(b) * H;
#pragma unroll
  for (int s = 0; s < kNAcc; ++s) {
    const int hbase = kSplit ? hg * 16 : hg * 32 + s * 16;
    const int h0 = hbase + g, h1 = hbase + g + 8;
    w[s][0] = h0 < H ? effective_weight(wrow[h0], weights_round, weights_scale) : 0.0f;
    w[s][1] = h1 < H ? effective_weight(wrow[h1], weights_round, weights_scale) : 0.0f;
  }

  for (int it = 0;; ++it) {
    const int tile = blockIdx.x + it * gridDim.x;
    if (tile >= ntiles) break;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage `it` landed for all threads; the previous tile's s_k / s_red readers are done
    issue(it + kStages - 1);

    {  // decode: thread -> key tid/4, elements (tid%4)*32 .. +32 = exactly scale block tid%4
      const int stage = it % kStages;
      const uint4 raw = *reinterpret_cast<const uint4*>(&s_codes[stage][tid * 16]);
      const uint32_t sc = ue8m0_bf16x2(s_scales[stage][tid]);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t v[16];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) v[i * 4 + j] = bf16x2_mul(s_lut[(words[i] >> (8 * j)) & 0xFF], sc);
      uint4* dst = reinterpret_cast<uint4*>(&s_k[(tid >> 2) * kKStride + (tid & 3) * 32]);
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = make_uint4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
    __syncthreads();

#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int krow = kg * kKeysPerWarp + nt * 8;
      float acc[kNAcc][4];
#pragma unroll
      for (int s = 0; s < kNAcc; ++s) acc[s][0] = acc[s][1] = acc[s][2] = acc[s][3] = 0.0f;
#pragma unroll
      for (int kp = 0; kp < kKSteps / 2; ++kp) {
        uint32_t bfr[4];  // B fragments of k-steps 2kp and 2kp+1 for keys krow..krow+7
        ldmatrix_x4(bfr, smem_u32(&s_k[(krow + (lane & 7)) * kKStride + kp * 32 + (lane >> 3) * 8]));
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int s = 0; s < 2; ++s) mma_bf16(acc[kSplit ? 0 : s], a[s][2 * kp + half], bfr[2 * half], bfr[2 * half + 1]);
        }
      }
      // acc[s][0..1]: head g, keys 2c, 2c+1; acc[s][2..3]: head g+8, same keys.
      float p0 = 0.0f, p1 = 0.0f;
#pragma unroll
      for (int s = 0; s < kNAcc; ++s) {
        p0 += w[s][0] * fmaxf(acc[s][0], 0.0f) + w[s][1] * fmaxf(acc[s][2], 0.0f);
        p1 += w[s][0] * fmaxf(acc[s][1], 0.0f) + w[s][1] * fmaxf(acc[s][3], 0.0f);
      }
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        p0 += __shfl_xor_sync(0xffffffffu, p0, off);
        p1 += __shfl_xor_sync(0xffffffffu, p1, off);
      }
      if (g == 0) {
        s_red[hg][krow + 2 * c] = p0;
        s_red[hg][krow + 2 * c + 1] = p1;
      }
    }
    __syncthreads();
    if (tid < kTK) {
      float sum = s_red[0][tid];
#pragma unroll
      for (int h = 1; h < kHG; ++h) sum += s_red[h][tid];
      const long long key = static_cast<long long>(tile) * kTK + tid;
      if (key < nv) keys_out[static_cast<size_t>(b) * N + key] = order_key(sum);
    }
  }
  cp_async_wait<0>();
}

// ------------------------------------------------------------------------------------------------------------
// Kernel 2: top-k
// ------------------------------------------------------------------------------------------------------------

// SCORES: src holds fp32 scores (dsv4::indexer_topk: each mapped by order_key as it is read, every key valid:
// n_valid null), else the scoring kernel's order keys. OutT: the output's index type.
template <bool SCORES, typename OutT>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kTopkThreads, 1)
    indexer_topk_kernel(const void* __restrict__ src, const void* __restrict__ n_valid, int nv_is64, int N,
                        int k, int kpad, int cache_cap, OutT* __restrict__ out) {
  dsv4_cuda::grid_dep_wait();  // keys and n_valid come from the scoring kernel / the step
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char s_dyn[];
  unsigned long long* cand = reinterpret_cast<unsigned long long*>(s_dyn);  // [kpad], used in rank 0
  uint32_t* cache = reinterpret_cast<uint32_t*>(cand + kpad);               // [cache_cap]
  __shared__ unsigned s_hist[2][256];
  __shared__ unsigned s_tot[256];
  __shared__ unsigned s_count;
  __shared__ int s_digit;
  __shared__ unsigned s_above;

  const int rank = static_cast<int>(cluster.block_rank());
  const int b = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int nv = n_valid != nullptr ? static_cast<int>(read_n_valid(n_valid, nv_is64, b, N)) : N;
  const size_t row0 = static_cast<size_t>(b) * N;
  auto row = [&](int i) -> uint32_t {
    return SCORES ? order_key(static_cast<const float*>(src)[row0 + i]) : static_cast<const uint32_t*>(src)[row0 + i];
  };
  const uint32_t nm1 = static_cast<uint32_t>(N - 1);
  OutT* orow = out + static_cast<size_t>(b) * k;

  if (nv <= k) {  // every valid key is selected: only the order is left (uniform over the cluster)
    if (rank != 0) return;
    for (int j = tid; j < k; j += blockDim.x)
      if (j >= nv) orow[j] = OutT(-1);
    if (nv <= kRankSortMax) {  // short rows (decode early in a sequence): one pass, each key's rank by counting
      for (int j = tid; j < nv; j += blockDim.x)
        cand[j] = (static_cast<unsigned long long>(row(j)) << 32) | (nm1 - static_cast<uint32_t>(j));
      __syncthreads();
      for (int j = tid; j < nv; j += blockDim.x) {
        const unsigned long long c = cand[j];
        int r = 0;
        for (int i = 0; i < nv; ++i) r += cand[i] > c;  // composites are distinct: ranks are a permutation
        orow[r] = static_cast<OutT>(nm1 - static_cast<uint32_t>(c));
      }
      return;
    }
    int npad = 1;  // the sort needs only the valid keys' power of two, not topk's
    while (npad < nv) npad <<= 1;
    for (int j = tid; j < npad; j += blockDim.x)
      cand[j] = j < nv ? ((static_cast<unsigned long long>(row(j)) << 32) | (nm1 - static_cast<uint32_t>(j))) : 0ull;
    __syncthreads();
    bitonic_sort_desc(cand, npad);
    for (int j = tid; j < nv; j += blockDim.x) orow[j] = static_cast<OutT>(nm1 - static_cast<uint32_t>(cand[j]));
    return;
  }

  if (rank == 0) {
    for (int j = tid; j < kpad; j += blockDim.x) cand[j] = 0ull;
    if (tid == 0) s_count = 0;
  }
  const int len = (nv + kCluster - 1) / kCluster;
  const int start = min(nv, rank * len), end = min(nv, start + len);
  const bool cached = cache_cap >= len;
  const int npass = dsv4_cuda::radix_passes(nm1);

  unsigned long long prefix = 0;
  unsigned krem = static_cast<unsigned>(k);
  for (int p = 0; p < npass; ++p) {
    const int shift = dsv4_cuda::radix_shift(p, npass);
    const unsigned long long mask = dsv4_cuda::radix_mask_above(shift);
    unsigned* h = s_hist[p & 1];
    // This buffer was last read remotely in pass p-2, before every CTA arrived at pass p-1's cluster barrier.
    for (int j = tid; j < 256; j += blockDim.x) h[j] = 0;
    __syncthreads();
    // Run-length counting: scores crowd into a few digits (the top digit is sign + 7 exponent bits), and
    // same-address shared atomics serialize; a thread flushes only when its digit changes.
    unsigned run_digit = 0, run_count = 0;
    for (int i = start + tid; i < end; i += blockDim.x) {
      uint32_t key;
      if (cached) {
        if (p == 0) {
          key = row(i);
          cache[i - start] = key;
        } else {
          key = cache[i - start];
        }
      } else {
        key = row(i);
      }
      const unsigned long long cmp = (static_cast<unsigned long long>(key) << 32) | (nm1 - static_cast<uint32_t>(i));
      if ((cmp & mask) == prefix) {
        const unsigned digit = static_cast<unsigned>(cmp >> shift) & 255u;
        if (digit != run_digit && run_count) {
          atomicAdd(&h[run_digit], run_count);
          run_count = 0;
        }
        run_digit = digit;
        ++run_count;
      }
    }
    if (run_count) atomicAdd(&h[run_digit], run_count);
    cluster.sync();
    for (int j = tid; j < 256; j += blockDim.x) {
      unsigned sum = 0;
#pragma unroll
      for (int r = 0; r < kCluster; ++r) sum += cluster.map_shared_rank(h, r)[j];
      s_tot[j] = sum;
    }
    __syncthreads();
    if (warp == 0) radix_find_digit(s_tot, krem, &s_digit, &s_above);
    __syncthreads();
    const int d = s_digit;
    krem -= s_above;
    prefix |= static_cast<unsigned long long>(d) << shift;
    if (s_tot[d] == krem) break;  // every composite with this prefix is selected (same decision cluster-wide)
  }

  // Gather the k composites >= prefix into rank 0 (order of arrival does not matter: they get sorted).
  unsigned* rcount = cluster.map_shared_rank(&s_count, 0);
  unsigned long long* rcand = cluster.map_shared_rank(cand, 0);
  for (int i = start + tid; i < end; i += blockDim.x) {
    const uint32_t key = cached ? cache[i - start] : row(i);
    const unsigned long long cmp = (static_cast<unsigned long long>(key) << 32) | (nm1 - static_cast<uint32_t>(i));
    if (cmp >= prefix) {
      const unsigned pos = atomicAdd(rcount, 1u);
      if (pos < static_cast<unsigned>(k)) rcand[pos] = cmp;
    }
  }
  cluster.sync();
  if (rank != 0) return;
  bitonic_sort_desc(cand, kpad);
  for (int j = tid; j < k; j += blockDim.x) orow[j] = static_cast<OutT>(nm1 - static_cast<uint32_t>(cand[j]));
}

// The top-k kernel over B rows of N: kpad (topk's power of two) candidates in CTA 0, and each CTA's slice of
// the row cached in shared memory when it fits the budget.
template <bool SCORES, typename OutT>
cudaError_t launch_topk(const void* src, const void* n_valid, int nv_is64, int B, int N, int topk, OutT* out,
                        cudaStream_t stream) {
  int kpad = 1;
  while (kpad < topk) kpad <<= 1;
  const int len = (N + kCluster - 1) / kCluster;
  const size_t base = static_cast<size_t>(kpad) * sizeof(unsigned long long);
  const int cache_cap = base + static_cast<size_t>(len) * 4 <= static_cast<size_t>(kSmemBudget) ? len : 0;
  const size_t smem = base + static_cast<size_t>(cache_cap) * 4;
  const auto kernel = indexer_topk_kernel<SCORES, OutT>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return launch_ex(decode_pdl(), kernel, dim3(kCluster, B), dim3(kTopkThreads), smem, stream, src, n_valid, nv_is64,
                   N, topk, kpad, cache_cap, out);
}

struct DeviceInfo {
  int sms = 0;
  int score_ctas_per_sm[2] = {0, 0};
};

DeviceInfo& device_info() {
  static DeviceInfo info[64];
  int dev = 0;
  cudaGetDevice(&dev);
  DeviceInfo& d = info[dev & 63];
  if (d.sms == 0) {
    cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&d.score_ctas_per_sm[0], indexer_score_kernel<false>, kThreads, 0);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&d.score_ctas_per_sm[1], indexer_score_kernel<true>, kThreads, 0);
    for (int& x : d.score_ctas_per_sm) x = x > 0 ? x : 1;
  }
  return d;
}

}  // namespace

// Largest topk the CUDA kernel supports (the winners are sorted in one CTA's shared memory).
extern "C" int dsv4_indexer_max_topk() { return kMaxTopk; }

// q: [B, H, 128] bf16 (q_is_fp32 = 0) or fp32; weights [B, H] fp32, each used as float(round(w)) * weights_scale
// (weights_round 0: as is, 1: bf16, 2: fp16); codes [B, N, 64] and scales [B, N, 4] uint8, contiguous, codes
// 16-byte and scales 4-byte aligned; n_valid [B] int32 or int64; keys_scratch [B, N] uint32; out [B, topk] int32.
// H <= 64, 1 <= topk <= 4096, B <= 65535. Returns cudaSuccess or the launch error.
extern "C" cudaError_t dsv4_indexer_score_topk_launch(const void* q, int q_is_fp32, const float* weights,
                                                      int weights_round, float weights_scale, const uint8_t* codes,
                                                      const uint8_t* scales, const void* n_valid, int nv_is64, int B,
                                                      int H, int N, int kv_batch, int topk, uint32_t* keys_scratch,
                                                      int32_t* out, cudaStream_t stream) {
  if (B == 0 || topk == 0) return cudaSuccess;
  DeviceInfo& info = device_info();
  if (N > 0) {
    const int ntiles = (N + kTK - 1) / kTK;
    const int slots = info.sms * info.score_ctas_per_sm[q_is_fp32 ? 1 : 0];
    int gx = slots / B;
    gx = gx < 1 ? 1 : (gx > ntiles ? ntiles : gx);
    const dim3 grid(gx, B);
    const bool pdl = decode_pdl();
    if (q_is_fp32)
      launch_ex(pdl, indexer_score_kernel<true>, grid, dim3(kThreads), 0, stream, q, weights, weights_round,
                weights_scale, codes, scales, n_valid, nv_is64, H, N, kv_batch, keys_scratch, int(pdl));
    else
      launch_ex(pdl, indexer_score_kernel<false>, grid, dim3(kThreads), 0, stream, q, weights, weights_round,
                weights_scale, codes, scales, n_valid, nv_is64, H, N, kv_batch, keys_scratch, int(pdl));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return launch_topk<false>(keys_scratch, n_valid, nv_is64, B, N, topk, out, stream);
}

// dsv4::indexer_topk: scores fp32 [R, N] contiguous, 1 <= topk <= min(N, 4096); out int64 [R, topk]. Rows in
// launches of at most 65535 (the grid's y). From 64 rows one CTA per row (indexer_topk_rows.cu; H100, top-512:
// 0.029 vs 0.037 ms at 64 x 8192, 0.37 vs 2.85 at 8192 x 2048, 3.35 vs 5.01 at 8192 x 32768); fewer rows (not
// measured) keep the 8-CTA cluster per row, decode's form.
extern "C" cudaError_t dsv4_indexer_topk_launch(const float* scores, int64_t R, int N, int topk, int64_t* out,
                                                cudaStream_t stream) {
  const int forced = dsv4_overrides::get().topk_kernel;
  if (forced == 2 || (forced == 0 && R >= 64)) return dsv4_indexer_topk_rows_launch(scores, R, N, topk, out, stream);
  constexpr int64_t kMaxRows = 65535;
  for (int64_t r0 = 0; r0 < R; r0 += kMaxRows) {
    const int rows = static_cast<int>(R - r0 < kMaxRows ? R - r0 : kMaxRows);
    const cudaError_t err = launch_topk<true>(scores + r0 * N, nullptr, 0, rows, N, topk, out + r0 * topk, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}
