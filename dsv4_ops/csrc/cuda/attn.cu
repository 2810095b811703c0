// CUDA kernels of dsv4::sparse_attn_decode (docs/ops.md "## Decode attention"), sm_90a. No torch headers:
// attn_bindings.cpp checks, allocates the workspace and launches. At decode a V4 layer attends one token per row
// over a few hundred cache rows (128-token window + top-k or all compressed entries) with 64-128 query heads
// sharing one K = V head of 512 dims: as tensor ops that is a gather, two fp32 GEMMs per key set, masks and a
// softmax (~13 kernels, ~30 us per CSA layer at batch 1 on the H200). Here: split-K flash decoding in two launches.
//   partial: a CTA = (split of the listed rows, 8 heads, batch row). Per chunk of 32 rows it stages the rows in
//     shared memory (fp32 math, rows of skipped entries zero-filled), warp h scores head h against lane j's row
//     (a full fp32 dot product per lane, rows padded so the lanes hit distinct banks), keeps a running max / sum
//     (online softmax) and accumulates p_j * row in registers (lane = dims lane, lane + 32, ...). It writes the
//     unnormalised sum, the running max and the sum of exponentials of its split.
//   combine: a CTA per (head, batch row) merges the splits with the head's sink in the softmax's denominator.
// The reference sums in another order; the results agree to fp32 rounding.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int kHeads = 8;    // heads per CTA = warps
constexpr int kChunk = 32;   // rows per chunk = lanes
constexpr int kMaxDpl = 16;  // dims per lane: D <= 512

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Row padding of the staged rows: 8 bytes, so rows stay 8-byte aligned (8-byte loads) and, where a row is a
// multiple of 128 bytes (D = 512), the row stride is 2 mod 32 words: the 16 lanes of each half-warp, each
// reading its own row at the same offset, hit distinct bank pairs (other D: at most a few 2-way conflicts).
template <typename T>
__host__ __device__ constexpr int row_pad() {
  return 8 / int(sizeof(T));
}

// Four consecutive elements of a staged row (8-byte aligned), widened.
__device__ __forceinline__ float4 load4(const float* p) {
  const float2 a = *reinterpret_cast<const float2*>(p), b = *reinterpret_cast<const float2*>(p + 2);
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xFFFF0000u));
}

template <typename T>
__global__ void __launch_bounds__(kHeads * 32) attn_partial_kernel(
    const T* __restrict__ q, const T* __restrict__ kv, const int32_t* __restrict__ idx, int H, int N, int D, int J,
    int64_t kv_batch_stride, int rows_per_split, float scale, float* __restrict__ ws_o, float* __restrict__ ws_ml) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int split = blockIdx.x, h0 = blockIdx.y * kHeads, b = blockIdx.z, nsplit = gridDim.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, h = h0 + warp;
  const int stride = D + row_pad<T>();
  float* qs = reinterpret_cast<float*>(smem);                   // [kHeads][D]
  T* ks = reinterpret_cast<T*>(qs + kHeads * D);                // [kChunk][stride]
  int* rows = reinterpret_cast<int*>(ks + kChunk * stride);     // [kChunk]

  for (int e = threadIdx.x; e < kHeads * D; e += blockDim.x) {
    const int hh = h0 + e / D;
    qs[e] = hh < H ? to_f(q[(int64_t(b) * H + hh) * D + e % D]) : 0.0f;
  }
  const T* kvb = kv + int64_t(b) * kv_batch_stride;
  const int j_begin = split * rows_per_split, j_end = min(J, j_begin + rows_per_split);
  const int dpl = (D + 31) / 32;
  float o[kMaxDpl];
#pragma unroll
  for (int i = 0; i < kMaxDpl; ++i) o[i] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;

  for (int c0 = j_begin; c0 < j_end; c0 += kChunk) {
    __syncthreads();  // the previous chunk's rows are no longer read
    if (threadIdx.x < kChunk) {
      const int j = c0 + threadIdx.x;
      const int r = j < j_end ? idx[int64_t(b) * J + j] : -1;
      rows[threadIdx.x] = (r >= 0 && r < N) ? r : -1;
    }
    __syncthreads();
    // stage the chunk's rows: 4-byte words (the padded rows are 4-byte aligned), zeros for skipped rows
    const int words = D * int(sizeof(T)) / 4;
    for (int e = threadIdx.x; e < kChunk * words; e += blockDim.x) {
      const int jj = e / words, w = e % words;
      const int r = rows[jj];
      const uint32_t v = r >= 0 ? __ldg(reinterpret_cast<const uint32_t*>(kvb + int64_t(r) * D) + w) : 0u;
      reinterpret_cast<uint32_t*>(ks + jj * stride)[w] = v;
    }
    __syncthreads();

    // warp = head, lane = row of the chunk (D % 8 == 0: whole 4-element steps)
    float s = -INFINITY;
    if (rows[lane] >= 0 && h < H) {
      const T* k = ks + lane * stride;
      const float* qh = qs + warp * D;
      float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;  // four chains: the dot product is latency-bound
      for (int d = 0; d < D; d += 4) {
        const float4 qv = *reinterpret_cast<const float4*>(qh + d);  // the same address in every lane: broadcast
        const float4 kv4 = load4(k + d);
        a0 = fmaf(qv.x, kv4.x, a0);
        a1 = fmaf(qv.y, kv4.y, a1);
        a2 = fmaf(qv.z, kv4.z, a2);
        a3 = fmaf(qv.w, kv4.w, a3);
      }
      s = ((a0 + a1) + (a2 + a3)) * scale;
    }
    float cm = s;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
    const float m_new = fmaxf(m_run, cm);
    if (m_new == -INFINITY) continue;  // nothing listed yet for this head (warp-uniform)
    const float alpha = m_run == -INFINITY ? 0.0f : expf(m_run - m_new);
    const float p = s == -INFINITY ? 0.0f : expf(s - m_new);
    float ps = p;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
    l_run = l_run * alpha + ps;
    m_run = m_new;
#pragma unroll
    for (int i = 0; i < kMaxDpl; ++i) o[i] *= alpha;
    for (int jj = 0; jj < kChunk; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      if (pj == 0.0f) continue;  // warp-uniform
      const T* k = ks + jj * stride;
#pragma unroll
      for (int i = 0; i < kMaxDpl; ++i) {
        const int d = lane + 32 * i;
        if (i < dpl && d < D) o[i] = fmaf(pj, to_f(k[d]), o[i]);
      }
    }
  }
  if (h < H) {
    float* wo = ws_o + ((int64_t(b) * nsplit + split) * H + h) * D;
#pragma unroll
    for (int i = 0; i < kMaxDpl; ++i) {
      const int d = lane + 32 * i;
      if (i < dpl && d < D) wo[d] = o[i];
    }
    if (lane == 0) {
      float* ml = ws_ml + ((int64_t(b) * nsplit + split) * H + h) * 2;
      ml[0] = m_run;
      ml[1] = l_run;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(128) attn_combine_kernel(const float* __restrict__ ws_o,
                                                          const float* __restrict__ ws_ml,
                                                          const float* __restrict__ sink, int H, int D, int nsplit,
                                                          T* __restrict__ out) {
  const int h = blockIdx.x, b = blockIdx.y;
  float M = sink[h];
  for (int s = 0; s < nsplit; ++s) M = fmaxf(M, ws_ml[((int64_t(b) * nsplit + s) * H + h) * 2]);
  float L = expf(sink[h] - M);
  for (int s = 0; s < nsplit; ++s) {
    const float* ml = ws_ml + ((int64_t(b) * nsplit + s) * H + h) * 2;
    if (ml[0] != -INFINITY) L += ml[1] * expf(ml[0] - M);
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < nsplit; ++s) {
      const float m = ws_ml[((int64_t(b) * nsplit + s) * H + h) * 2];
      if (m != -INFINITY) acc = fmaf(ws_o[((int64_t(b) * nsplit + s) * H + h) * D + d], expf(m - M), acc);
    }
    store(out + (int64_t(b) * H + h) * D + d, acc / L);
  }
}

template <typename T>
cudaError_t launch(const void* q, const void* kv, const int32_t* idx, const float* sink, int B, int H, int N,
                   int D, int J, int64_t kv_batch_stride, float scale, float* ws_o, float* ws_ml, int nsplit,
                   int rows_per_split, void* out, cudaStream_t stream) {
  const size_t smem = size_t(kHeads) * D * sizeof(float) + size_t(kChunk) * (D + row_pad<T>()) * sizeof(T) +
                      kChunk * sizeof(int);
  // > 48 KB of dynamic shared memory needs an opt-in, per device (a host-side call, not a stream operation)
  static bool opted_in[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!opted_in[dev]) {
    const cudaError_t e = cudaFuncSetAttribute(attn_partial_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(size_t(kHeads) * 512 * 4 + size_t(kChunk) * 516 * sizeof(T) +
                                                   kChunk * sizeof(int)));
    if (e != cudaSuccess) return e;
    opted_in[dev] = true;
  }
  const dim3 grid(nsplit, (H + kHeads - 1) / kHeads, B);
  attn_partial_kernel<T><<<grid, kHeads * 32, smem, stream>>>(static_cast<const T*>(q), static_cast<const T*>(kv),
                                                              idx, H, N, D, J, kv_batch_stride, rows_per_split,
                                                              scale, ws_o, ws_ml);
  attn_combine_kernel<T><<<dim3(H, B), 128, 0, stream>>>(ws_o, ws_ml, sink, H, D, nsplit, static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace

// Splits of the listed rows: enough CTAs to cover the GPU at batch 1, at most 64 per (row, head group).
extern "C" int dsv4_attn_decode_splits(int B, int H, int J, int num_sms, int* rows_per_split) {
  const int groups = B * ((H + kHeads - 1) / kHeads);
  int n = (J + kChunk - 1) / kChunk;
  const int want = (2 * num_sms + groups - 1) / groups;  // ~2 CTAs per SM
  if (n > want) n = want;
  if (n > 64) n = 64;
  if (n < 1) n = 1;
  int per = (J + n - 1) / n;
  per = (per + kChunk - 1) / kChunk * kChunk;
  if (per < kChunk) per = kChunk;
  *rows_per_split = per;
  return (J + per - 1) / per > 0 ? (J + per - 1) / per : 1;
}

// q [B, H, D], kv rows of D elements with kv_batch_stride elements between batch rows, idx int32 [B, J], sink fp32
// [H], out [B, H, D]; is_fp32: q / kv / out fp32 (else bf16). D <= 512, D % 8 == 0. Workspace: ws_o fp32
// [B, nsplit, H, D], ws_ml fp32 [B, nsplit, H, 2].
extern "C" cudaError_t dsv4_attn_decode_launch(const void* q, const void* kv, const int32_t* idx, const float* sink,
                                               int is_fp32, int B, int H, int N, int D, int J,
                                               int64_t kv_batch_stride, float scale, float* ws_o, float* ws_ml,
                                               int nsplit, int rows_per_split, void* out, cudaStream_t stream) {
  if (B == 0 || H == 0) return cudaSuccess;
  if (D > 512 || D % 8 != 0) return cudaErrorInvalidValue;
  return is_fp32 ? launch<float>(q, kv, idx, sink, B, H, N, D, J, kv_batch_stride, scale, ws_o, ws_ml, nsplit,
                                 rows_per_split, out, stream)
                 : launch<__nv_bfloat16>(q, kv, idx, sink, B, H, N, D, J, kv_batch_stride, scale, ws_o, ws_ml,
                                         nsplit, rows_per_split, out, stream);
}
