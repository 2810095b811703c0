// CUDA kernels of dsv4::sparse_attn_decode (docs/ops.md "## Decode attention"), sm_90a. No torch headers:
// attn_bindings.cpp checks, allocates the workspace and launches. At decode a V4 layer attends one token per row
// over a few hundred cache rows (128-token window + top-k or all compressed entries) with 64-128 query heads
// sharing one K = V head of 512 dims: as tensor ops that is a gather, two fp32 GEMMs per key set, masks and a
// softmax (~13 kernels per CSA layer at batch 1; bench/RESULTS.md). Here: split-K flash decoding in two launches.
//   partial: a CTA = (split of the listed rows, 8 heads, batch row). Chunks of 32 rows are staged in shared
//     memory by cp.async, double-buffered (the next chunk's copies fly while this one is computed; rows of
//     skipped entries zero-filled); warp h scores head h against lane j's row (a full fp32 dot product per lane,
//     rows padded so the lanes hit distinct banks), keeps a running max / sum (online softmax) and accumulates
//     p_j * row in registers (lane = 16-byte pieces lane, lane + 32, ... of the row). It writes the
//     unnormalised sum, the running max and the sum of exponentials of its split.
//   combine: a CTA per (head, batch row) merges the splits with the head's sink in the softmax's denominator.
// The reference sums in another order; the results agree to fp32 rounding.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "attn_common.h"
#include "float_cast.h"
#include "launchers.h"
#include "mma.h"
#include "pdl.h"

namespace {

using dsv4_cuda::decode_pdl;
using dsv4_cuda::row_list;
using dsv4_cuda::RowList;
using dsv4_cuda::launch_ex;

using dsv4_cuda::mma_bf16;
using dsv4_cuda::quad_max;
using dsv4_cuda::quad_sum;
using dsv4_cuda::round_to;
using dsv4_cuda::store_one;

constexpr int kHeads = 8;    // heads per CTA = warps
constexpr int kChunk = 32;   // rows per chunk = lanes
constexpr int kMaxDpl = 16;  // dims per lane: D <= 512
constexpr int kRowPad = 16;  // bytes after each staged row (see row_bytes)


// Elements of T per 16-byte piece, and a piece widened to fp32.
template <typename T>
__host__ __device__ constexpr int epp() {
  return 16 / int(sizeof(T));
}
__device__ __forceinline__ void widen(uint4 u, float (&f)[4]) {
  f[0] = __uint_as_float(u.x), f[1] = __uint_as_float(u.y), f[2] = __uint_as_float(u.z), f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void widen(uint4 u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

// A staged row is padded by 16 bytes: 16-byte aligned for cp.async, and where a row is a multiple of 128 bytes
// the stride is 4 mod 32 words, so the 8 lanes of a quarter-warp, each reading its own row at the same offset
// (16 bytes per lane), hit distinct banks.
__host__ __device__ constexpr int row_bytes(int D, int elem) { return D * elem + kRowPad; }

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}


// Stage the rows of the chunk at c0 (ids rl.at(c0 ..), those at j >= j_end skipped) into ks with cp.async (all
// copies in flight at once; skipped rows zero-filled and their id -1), one commit group.
template <typename T>
__device__ __forceinline__ void stage_chunk(unsigned char* ks, int rb, const T* kvb, const RowList& rl, int N, int D,
                                            int c0, int j_end) {
  constexpr int E = epp<T>();
  const int pieces = D / E;
  int* rows = reinterpret_cast<int*>(ks + size_t(kChunk) * rb);
  for (int e = threadIdx.x; e < kChunk * pieces; e += blockDim.x) {
    const int jj = e / pieces, pc = e - jj * pieces, j = c0 + jj;
    int r = j < j_end ? rl.at(j) : -1;
    r = (r >= 0 && r < N) ? r : -1;
    if (pc == 0) rows[jj] = r;
    const T* src = r >= 0 ? kvb + int64_t(r) * D + pc * E : kvb;
    cp_async16(ks + jj * rb + pc * 16, src, r >= 0 ? 16 : 0);
  }
  cp_async_commit();
}

// Shared memory of the partial kernel: q of the CTA's heads (fp32), then two chunk buffers (rows + row ids).
__host__ __device__ constexpr size_t partial_smem(int D, int elem) {
  return size_t(kHeads) * D * 4 + 2 * (size_t(kChunk) * row_bytes(D, elem) + kChunk * 4);
}

template <typename T>
__global__ void __launch_bounds__(kHeads * 32) attn_partial_kernel(
    const T* __restrict__ q, const T* __restrict__ kv, const int32_t* __restrict__ idx, int J1,
    const int32_t* __restrict__ idx2, int idx2_offset, int H, int N, int D, int J, int64_t kv_batch_stride,
    int kv_batch, int rows_per_split, float scale, float* __restrict__ ws_o, float* __restrict__ ws_ml, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  constexpr int E = epp<T>();
  extern __shared__ __align__(16) unsigned char smem[];
  const int split = blockIdx.x, h0 = blockIdx.y * kHeads, b = blockIdx.z, nsplit = gridDim.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, h = h0 + warp;
  const int rb = row_bytes(D, sizeof(T)), pieces = D / E;
  float* qs = reinterpret_cast<float*>(smem);  // [kHeads][D]
  unsigned char* bufs = smem + size_t(kHeads) * D * 4;
  const size_t buf_bytes = size_t(kChunk) * rb + kChunk * 4;  // rows, then their ids (-1: skipped)
  const T* kvb = kv + int64_t(kv_batch ? b % kv_batch : b) * kv_batch_stride;
  const RowList rl = row_list(idx, J1, idx2, J, idx2_offset, b);
  const int j_begin = split * rows_per_split, j_end = min(J, j_begin + rows_per_split);

  // Stage the rows of the chunk at c0 into buffer `buf` with cp.async (all copies in flight at once; skipped rows
  // zero-filled), one commit group per chunk.
  auto stage = [&](int c0, int buf) {
    stage_chunk(bufs + buf * buf_bytes, rb, kvb, rl, N, D, c0, j_end);
  };
  if (j_begin < j_end) stage(j_begin, 0);

  // q of the CTA's heads, widened (overlaps the first chunk's copies)
  for (int e = threadIdx.x; e < kHeads * pieces; e += blockDim.x) {
    const int hh = h0 + e / pieces, pc = e % pieces;
    float f[E];
    if (hh < H) {
      widen(__ldg(reinterpret_cast<const uint4*>(q + (int64_t(b) * H + hh) * D) + pc), f);
    } else {
#pragma unroll
      for (int i = 0; i < E; ++i) f[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < E; ++i) qs[(e / pieces) * D + pc * E + i] = f[i];
  }

  float o[kMaxDpl];  // dims of pieces lane, lane + 32, ... of the head's output
#pragma unroll
  for (int i = 0; i < kMaxDpl; ++i) o[i] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;

  int buf = 0;
  for (int c0 = j_begin; c0 < j_end; c0 += kChunk, buf ^= 1) {
    __syncthreads();  // every warp is done with the buffer the next chunk goes to
    if (c0 + kChunk < j_end) {
      stage(c0 + kChunk, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this chunk's rows (and q) are visible to every thread
    const unsigned char* ks = bufs + buf * buf_bytes;
    const int* rows = reinterpret_cast<const int*>(ks + size_t(kChunk) * rb);

    // warp = head, lane = row of the chunk: a full dot product per lane, four FMA chains
    float s = -INFINITY;
    if (rows[lane] >= 0 && h < H) {
      const unsigned char* k = ks + lane * rb;
      const float* qh = qs + warp * D;
      float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int pc = 0; pc < pieces; ++pc) {
        float kf[E];
        widen(*reinterpret_cast<const uint4*>(k + pc * 16), kf);
#pragma unroll
        for (int i = 0; i < E; i += 4) {
          const float4 qv = *reinterpret_cast<const float4*>(qh + pc * E + i);  // same address in every lane
          a[0] = fmaf(qv.x, kf[i], a[0]);
          a[1] = fmaf(qv.y, kf[i + 1], a[1]);
          a[2] = fmaf(qv.z, kf[i + 2], a[2]);
          a[3] = fmaf(qv.w, kf[i + 3], a[3]);
        }
      }
      s = ((a[0] + a[1]) + (a[2] + a[3])) * scale;
    }
    float cm = s;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
    const float m_new = fmaxf(m_run, cm);
    if (m_new == -INFINITY) continue;  // nothing listed yet for this head (warp-uniform; no barrier follows)
    const float alpha = m_run == -INFINITY ? 0.0f : expf(m_run - m_new);
    const float p = s == -INFINITY ? 0.0f : expf(s - m_new);
    float ps = p;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
    l_run = l_run * alpha + ps;
    m_run = m_new;
#pragma unroll
    for (int i = 0; i < kMaxDpl; ++i) o[i] *= alpha;
    // p_j * row j: lane owns pieces lane, lane + 32, ... (consecutive lanes read consecutive 16-byte pieces)
    for (int jj = 0; jj < kChunk; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      if (pj == 0.0f) continue;  // warp-uniform
      const unsigned char* k = ks + jj * rb;
#pragma unroll
      for (int t = 0; t < kMaxDpl / E; ++t) {
        const int pc = lane + 32 * t;
        if (pc < pieces) {
          float kf[E];
          widen(*reinterpret_cast<const uint4*>(k + pc * 16), kf);
#pragma unroll
          for (int i = 0; i < E; ++i) o[t * E + i] = fmaf(pj, kf[i], o[t * E + i]);
        }
      }
    }
  }
  if (h < H) {
    float* wo = ws_o + ((int64_t(b) * nsplit + split) * H + h) * D;
#pragma unroll
    for (int t = 0; t < kMaxDpl / E; ++t) {
      const int pc = lane + 32 * t;
      if (pc < pieces) {
#pragma unroll
        for (int i = 0; i < E; i += 4)
          *reinterpret_cast<float4*>(wo + pc * E + i) =
              make_float4(o[t * E + i], o[t * E + i + 1], o[t * E + i + 2], o[t * E + i + 3]);
      }
    }
    if (lane == 0) {
      float* ml = ws_ml + ((int64_t(b) * nsplit + split) * H + h) * 2;
      ml[0] = m_run;
      ml[1] = l_run;
    }
  }
}

// ------------------------------------------------------------------------------------------ mma partial kernel
// bf16, D % 64 == 0, D <= 512: the same split / chunk / online-softmax scheme on tensor cores (mma.sync m16n8k16,
// fp32 accumulation). A CTA = (split, 16 heads, batch row), 4 warps; warp w owns dims [w * D/4, (w + 1) * D/4).
// Scores: each warp multiplies its dims of q (A fragments, registers) by its dims of the chunk's 32 rows (B
// fragments straight from the staged rows), the 4 partial 16 x 32 score tiles are summed through shared memory
// in warp order, so every warp holds the same scores. P . V: P (fp32) is split into bf16 hi + lo parts (two mmas,
// ~16 significant bits, so the result keeps fp32-level accuracy instead of bf16-rounded probabilities) against the
// warp's dims of V (ldmatrix.trans). Same workspace as the CUDA-core kernel; the combine kernel is shared.
// HG head groups of 16 per CTA (4 warps each) share the staged rows: HG = 1 at decode (more CTAs for few rows),
// HG = 4 (64 heads, 512 threads) where the rows alone fill the GPU (prefill: a query per row), so that a row's keys
// are staged once instead of once per 16 heads.
constexpr int kMmaHeads = 16, kMmaWarps = 4, kMmaMaxKs = 512 / kMmaWarps / 16, kMmaMaxNt = 512 / kMmaWarps / 8;
constexpr int kMmaWideGroups = 4;  // head groups per CTA of the all-heads form
// Float index of (head row r, column c) in a warp's 16 x 32 partial-score tile: columns XOR-swizzled by r % 4, so a
// warp's 8-byte accesses (head g, columns 2t, 2t + 1) land on 16 distinct bank pairs per half-warp (unswizzled
// they were 8-way conflicts: every g on the same banks). Unpadded: 3 CTAs of 16 heads still fit an SM.
__device__ __forceinline__ int red_at(int r, int c) { return r * kChunk + (c ^ ((r & 3) << 3)); }

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t ld_u32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

__host__ __device__ constexpr size_t partial_mma_smem(int D, int groups) {
  return size_t(groups) * kMmaWarps * kMmaHeads * kChunk * 4 + 2 * (size_t(kChunk) * row_bytes(D, 2) + kChunk * 4);
}

template <int HG>
__global__ void __launch_bounds__(HG * kMmaWarps * 32) attn_partial_mma_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int32_t* __restrict__ idx,
    int J1, const int32_t* __restrict__ idx2, int idx2_offset, int H, int N, int D, int J, int64_t kv_batch_stride,
    int kv_batch, int rows_per_split, float scale, float* __restrict__ ws_o, float* __restrict__ ws_ml, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  extern __shared__ __align__(16) unsigned char smem[];
  const int split = blockIdx.x, b = blockIdx.z, nsplit = gridDim.x;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int hg = (threadIdx.x >> 5) / kMmaWarps, warp = (threadIdx.x >> 5) % kMmaWarps;  // head group, dim quarter
  const int h0 = (blockIdx.y * HG + hg) * kMmaHeads;
  const int rb = row_bytes(D, 2), dq = D / kMmaWarps, d_w = warp * dq, nks = dq / 16, nnt = dq / 8;
  // [head group][warp][16 heads][32 rows]: partial scores
  float* red = reinterpret_cast<float*>(smem) + size_t(hg) * kMmaWarps * kMmaHeads * kChunk;
  unsigned char* bufs = smem + size_t(HG) * kMmaWarps * kMmaHeads * kChunk * 4;
  const size_t buf_bytes = size_t(kChunk) * rb + kChunk * 4;
  const __nv_bfloat16* kvb = kv + int64_t(kv_batch ? b % kv_batch : b) * kv_batch_stride;
  const RowList rl = row_list(idx, J1, idx2, J, idx2_offset, b);
  const int j_begin = split * rows_per_split, j_end = min(J, j_begin + rows_per_split);
  if (j_begin < j_end) stage_chunk(bufs, rb, kvb, rl, N, D, j_begin, j_end);

  // A fragments of q for this warp's dims: heads g / g + 8, dims 16 ks + 2t (+ 8)
  const int ha = h0 + g, hb = h0 + g + 8;
  const __nv_bfloat16* qa_row = q + (int64_t(b) * H + min(ha, H - 1)) * D + d_w + 2 * t;
  const __nv_bfloat16* qb_row = q + (int64_t(b) * H + min(hb, H - 1)) * D + d_w + 2 * t;
  uint32_t qf[kMmaMaxKs][4];
#pragma unroll
  for (int ks = 0; ks < kMmaMaxKs; ++ks) {
    const bool ok = ks < nks;
    qf[ks][0] = ok && ha < H ? ld_u32(qa_row + 16 * ks) : 0u;
    qf[ks][1] = ok && hb < H ? ld_u32(qb_row + 16 * ks) : 0u;
    qf[ks][2] = ok && ha < H ? ld_u32(qa_row + 16 * ks + 8) : 0u;
    qf[ks][3] = ok && hb < H ? ld_u32(qb_row + 16 * ks + 8) : 0u;
  }

  float o[kMmaMaxNt][4];  // heads g (0, 1) / g + 8 (2, 3) x dims d_w + 8 nt + 2t (+ 1)
#pragma unroll
  for (int i = 0; i < kMmaMaxNt; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  int buf = 0;
  for (int c0 = j_begin; c0 < j_end; c0 += kChunk, buf ^= 1) {
    __syncthreads();  // every warp is done with the buffer the next chunk goes to, and with `red`
    if (c0 + kChunk < j_end) {
      stage_chunk(bufs + (buf ^ 1) * buf_bytes, rb, kvb, rl, N, D, c0 + kChunk, j_end);  // (all HG groups' threads)
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const unsigned char* ks_base = bufs + buf * buf_bytes;
    const int* rows = reinterpret_cast<const int*>(ks_base + size_t(kChunk) * rb);

    // partial scores over this warp's dims: B fragment of rows 8 nt + g, dims 16 ks + 2t (+ 8)
    float sc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
      const unsigned char* kr = ks_base + (8 * nt + g) * rb + (d_w + 2 * t) * 2;
#pragma unroll
      for (int ks = 0; ks < kMmaMaxKs; ++ks) {
        if (ks < nks) {
          const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr + 32 * ks);
          const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + 32 * ks + 16);
          mma_bf16(sc[nt], qf[ks], b0, b1);
        }
      }
    }
    // pairs (c, c + 1) are columns 2t, 2t + 1 of one head row: one 8-byte access each
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int c = 0; c < 4; c += 2)
        *reinterpret_cast<float2*>(red + red_at(warp * kMmaHeads + g + 8 * (c >> 1), 8 * nt + 2 * t)) =
            make_float2(sc[nt][c], sc[nt][c + 1]);
    __syncthreads();
    float rmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; c += 2) {
        const int hr = g + 8 * (c >> 1), col = 8 * nt + 2 * t;
        float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
        for (int w = 0; w < kMmaWarps; ++w) {
          const float2 u = *reinterpret_cast<const float2*>(red + red_at(w * kMmaHeads + hr, col));
          v0 += u.x;
          v1 += u.y;
        }
        v0 = rows[col] >= 0 ? v0 * scale : -INFINITY;
        v1 = rows[col + 1] >= 0 ? v1 * scale : -INFINITY;
        sc[nt][c] = v0;
        sc[nt][c + 1] = v1;
        rmax[c >> 1] = fmaxf(rmax[c >> 1], fmaxf(v0, v1));
      }
    }
    float alpha[2], psum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) rmax[r] = quad_max(rmax[r]);
    // every listed row scores finite for every head, so either both maxima are finite or the chunk lists nothing
    // and this is true in every lane of every head group (no barrier follows in this iteration)
    if (fmaxf(m_run[0], rmax[0]) == -INFINITY) continue;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m_run[r], rmax[r]);
      alpha[r] = m_run[r] == -INFINITY ? 0.0f : expf(m_run[r] - m_new);
      m_run[r] = m_new;
      psum[r] = 0.0f;
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float v = sc[nt][c];
        const float pv = v == -INFINITY ? 0.0f : expf(v - m_run[c >> 1]);
        sc[nt][c] = pv;
        psum[c >> 1] += pv;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + quad_sum(psum[r]);
#pragma unroll
    for (int i = 0; i < kMmaMaxNt; ++i) {
      o[i][0] *= alpha[0], o[i][1] *= alpha[0], o[i][2] *= alpha[1], o[i][3] *= alpha[1];
    }
    // P . V over the chunk's two 16-row k-steps; P as bf16 hi + lo
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t ph[4], pl[4];
      const float* p0 = sc[2 * kk];
      const float* p1 = sc[2 * kk + 1];
      const float pf[4][2] = {{p0[0], p0[1]}, {p0[2], p0[3]}, {p1[0], p1[1]}, {p1[2], p1[3]}};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ph[i] = pack_bf16(pf[i][0], pf[i][1]);
        const __nv_bfloat162 hv = *reinterpret_cast<const __nv_bfloat162*>(&ph[i]);
        pl[i] = pack_bf16(pf[i][0] - __low2float(hv), pf[i][1] - __high2float(hv));
      }
      // matrix m = lane >> 3 of the x4 load: rows 16 kk + 8 (m & 1) + (lane & 7), dims d_w + 8 (nt + (m >> 1))
      const unsigned char* vrow =
          ks_base + (16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * rb + (d_w + 8 * (lane >> 4)) * 2;
#pragma unroll
      for (int nt = 0; nt < kMmaMaxNt; nt += 2) {
        if (nt < nnt) {
          uint32_t vb[4];
          ldsm_x4_trans(vb, vrow + nt * 16);
          mma_bf16(o[nt], ph, vb[0], vb[1]);
          mma_bf16(o[nt], pl, vb[0], vb[1]);
          mma_bf16(o[nt + 1], ph, vb[2], vb[3]);
          mma_bf16(o[nt + 1], pl, vb[2], vb[3]);
        }
      }
    }
  }
  const int64_t base = (int64_t(b) * nsplit + split) * H;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + g + 8 * r;
    if (h >= H) continue;
    float* wo = ws_o + (base + h) * D + d_w + 2 * t;
#pragma unroll
    for (int nt = 0; nt < kMmaMaxNt; ++nt)
      if (nt < nnt) *reinterpret_cast<float2*>(wo + 8 * nt) = make_float2(o[nt][2 * r], o[nt][2 * r + 1]);
    if (warp == 0 && t == 0) {
      ws_ml[(base + h) * 2] = m_run[r];
      ws_ml[(base + h) * 2 + 1] = l_run[r];
    }
  }
}

// A CTA per (head, batch row): the splits' weights exp(m_s - M) once (nsplit <= 64), then 4 dims per thread.
template <typename T>
__global__ void __launch_bounds__(128) attn_combine_kernel(const float* __restrict__ ws_o,
                                                          const float* __restrict__ ws_ml,
                                                          const float* __restrict__ sink, int H, int D, int nsplit,
                                                          const float* __restrict__ out_rope, int rope_dim,
                                                          T* __restrict__ out, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  __shared__ float wgt[64];
  __shared__ float total;
  const int h = blockIdx.x, b = blockIdx.y;
  const int64_t base = int64_t(b) * nsplit * H + h;  // split s: (base + s * H) * {2, D}
  if (threadIdx.x < 32) {
    const int l = threadIdx.x;
    float m[2], lsum[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int s = l + 32 * i;
      m[i] = s < nsplit ? ws_ml[(base + int64_t(s) * H) * 2] : -INFINITY;
      lsum[i] = s < nsplit ? ws_ml[(base + int64_t(s) * H) * 2 + 1] : 0.0f;
    }
    float M = fmaxf(sink[h], fmaxf(m[0], m[1]));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float w = m[i] == -INFINITY ? 0.0f : expf(m[i] - M);
      if (l + 32 * i < nsplit) wgt[l + 32 * i] = w;
      L = fmaf(lsum[i], w, L);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    if (l == 0) total = L + expf(sink[h] - M);
  }
  __syncthreads();
  const float L = total;
  for (int d = threadIdx.x * 4; d < D; d += blockDim.x * 4) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < nsplit; ++s) {
      const float w = wgt[s];
      if (w == 0.0f) continue;  // the same for every thread
      const float4 v = *reinterpret_cast<const float4*>(ws_o + (base + int64_t(s) * H) * D + d);
      acc.x = fmaf(v.x, w, acc.x), acc.y = fmaf(v.y, w, acc.y), acc.z = fmaf(v.z, w, acc.z);
      acc.w = fmaf(v.w, w, acc.w);
    }
    T* o = out + (int64_t(b) * H + h) * D + d;
    float v[4] = {round_to(acc.x / L, o), round_to(acc.y / L, o), round_to(acc.z / L, o), round_to(acc.w / L, o)};
    const int nope = D - rope_dim;
    if (out_rope != nullptr && d >= nope) {  // inverse RoPE of the 2 pairs (d - nope is a multiple of 4)
      const float* c = out_rope + int64_t(b) * rope_dim + (d - nope);  // (cos, sin) of pair (d - nope) / 2, + 1
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const float x0 = v[2 * k], x1 = v[2 * k + 1], co = c[2 * k], si = -c[2 * k + 1];
        v[2 * k] = round_to(__fsub_rn(__fmul_rn(x0, co), __fmul_rn(x1, si)), o);
        v[2 * k + 1] = round_to(__fadd_rn(__fmul_rn(x0, si), __fmul_rn(x1, co)), o);
      }
    }
    store_one(o, v[0]), store_one(o + 1, v[1]), store_one(o + 2, v[2]), store_one(o + 3, v[3]);
  }
}

template <typename T>
cudaError_t launch(const void* q, const void* kv, const int32_t* idx, int J1, const int32_t* idx2, int idx2_offset,
                   const float* sink, int B, int H, int N, int D, int J, int64_t kv_batch_stride, int kv_batch,
                   float scale, float* ws_o, float* ws_ml, int nsplit, int rows_per_split, int use_mma,
                   const float* out_rope, int rope_dim, void* out, cudaStream_t stream) {
  // > 48 KB of dynamic shared memory needs an opt-in, per device (a host-side call, not a stream operation)
  static bool opted_in[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!opted_in[dev]) {
    cudaError_t e = cudaFuncSetAttribute(attn_partial_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(partial_smem(512, sizeof(T))));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(attn_partial_mma_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(partial_mma_smem(512, 1)));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(attn_partial_mma_kernel<kMmaWideGroups>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(partial_mma_smem(512, kMmaWideGroups)));
    if (e != cudaSuccess) return e;
    opted_in[dev] = true;
  }
  const bool pdl = decode_pdl();
  if (use_mma == 3) {  // attn_wgmma.cu: 64 heads x 512 dims on warpgroup MMA (its own opt-in)
    const cudaError_t e = dsv4_attn_partial_wgmma_launch(q, kv, idx, J1, idx2, idx2_offset, B, H, N, J,
                                                         kv_batch_stride, kv_batch, scale, ws_o, ws_ml, nsplit,
                                                         rows_per_split, int(pdl), stream);
    if (e != cudaSuccess) return e;
  } else if (use_mma) {
    const int hg = use_mma == 2 ? kMmaWideGroups : 1, heads = hg * kMmaHeads;
    const dim3 grid(nsplit, (H + heads - 1) / heads, B);
    const auto kernel = use_mma == 2 ? attn_partial_mma_kernel<kMmaWideGroups> : attn_partial_mma_kernel<1>;
    launch_ex(pdl, kernel, grid, dim3(hg * kMmaWarps * 32), partial_mma_smem(D, hg), stream,
              static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(kv), idx, J1, idx2, idx2_offset,
              H, N, D, J, kv_batch_stride, kv_batch, rows_per_split, scale, ws_o, ws_ml, int(pdl));
  } else {
    const dim3 grid(nsplit, (H + kHeads - 1) / kHeads, B);
    launch_ex(pdl, attn_partial_kernel<T>, grid, dim3(kHeads * 32), partial_smem(D, sizeof(T)), stream,
              static_cast<const T*>(q), static_cast<const T*>(kv), idx, J1, idx2, idx2_offset, H, N, D, J,
              kv_batch_stride, kv_batch, rows_per_split, scale, ws_o, ws_ml, int(pdl));
  }
  launch_ex(pdl, attn_combine_kernel<T>, dim3(H, B), dim3(128), 0, stream, ws_o, ws_ml, sink, H, D, nsplit, out_rope,
            rope_dim, static_cast<T*>(out), int(pdl));
  return cudaGetLastError();
}

}  // namespace

// Whether the mma kernel takes this call (bf16 only: the caller passes is_fp32 = 0).
extern "C" int dsv4_attn_decode_mma_ok(int D) { return dsv4_limits::attn_mma_dim_ok(D); }

// Splits of the listed rows: as many CTAs as one wave holds (2 CTAs of 8 heads or 3 of 16 heads per SM, by shared
// memory), at most 64 per (row, head group). Rounded down: CTAs past a full wave run as a second wave (at batch 8
// with 640 rows, rounding up gave 320 CTAs for 264 slots on the H200: two waves of 4 chunks instead of one of 5;
// not yet measured). use_mma 3 (attn_wgmma.cu): one CTA of 64 heads per SM, splits of whole 64-row chunks; the
// 64-head mma CTA (use_mma 2) keeps the 16-head plan, so both mma forms give the same bits.
extern "C" int dsv4_attn_decode_splits(int B, int H, int J, int num_sms, int use_mma, int* rows_per_split) {
  const int heads = use_mma == 3 ? 64 : use_mma ? kMmaHeads : kHeads, per_sm = use_mma == 3 ? 1 : use_mma ? 3 : 2;
  const int chunk = use_mma == 3 ? 64 : kChunk;
  const int groups = B * ((H + heads - 1) / heads);
  int n = (J + chunk - 1) / chunk;
  const int want = per_sm * num_sms / groups;
  if (n > want) n = want;
  if (n > 64) n = 64;
  if (n < 1) n = 1;
  int per = (J + n - 1) / n;
  per = (per + chunk - 1) / chunk * chunk;
  if (per < chunk) per = chunk;
  *rows_per_split = per;
  return (J + per - 1) / per > 0 ? (J + per - 1) / per : 1;
}

// q [B, H, D], kv rows of D elements with kv_batch_stride elements between batch rows (query row b reads batch
// row b % kv_batch where kv_batch > 0, else b), idx int32 [B, J1], idx2
// int32 [B, J - J1] or null (listed after idx as idx2 + idx2_offset where idx2 >= 0), sink fp32 [H], out
// [B, H, D]; is_fp32: q / kv / out fp32 (else bf16); use_mma: the tensor-core partial kernel (bf16,
// dsv4_attn_decode_mma_ok; 1: 16 heads per CTA, 2: 64, for many rows, 3: the warpgroup-MMA kernel of
// attn_wgmma.cu (D = 512); the splits as dsv4_attn_decode_splits gives them for that value). D <= 512,
// D % 8 == 0. Workspace: ws_o fp32 [B, nsplit, H, D], ws_ml fp32 [B, nsplit, H, 2].
// out_rope: fp32 [B, rope_dim / 2, (cos, sin)] (rope_dim % 4 == 0) or null: the output's inverse RoPE, applied by
// the combine kernel to the rounded output and rounded again.
extern "C" cudaError_t dsv4_attn_decode_launch(const void* q, const void* kv, const int32_t* idx, int J1,
                                               const int32_t* idx2, int idx2_offset, const float* sink, int is_fp32,
                                               int B, int H, int N, int D, int J,
                                               int64_t kv_batch_stride, int kv_batch, float scale, float* ws_o,
                                               float* ws_ml, int nsplit, int rows_per_split, int use_mma,
                                               const float* out_rope, int rope_dim, void* out,
                                               cudaStream_t stream) {
  if (B == 0 || H == 0) return cudaSuccess;
  if (D > 512 || D % 8 != 0 || (use_mma && (is_fp32 || !dsv4_attn_decode_mma_ok(D)))) return cudaErrorInvalidValue;
  if (use_mma == 3 && !dsv4_attn_partial_wgmma_ok(D)) return cudaErrorInvalidValue;
  if (out_rope != nullptr && (rope_dim % 4 != 0 || rope_dim <= 0 || rope_dim > D)) return cudaErrorInvalidValue;
  if (idx2 == nullptr && J1 != J) return cudaErrorInvalidValue;
  return is_fp32 ? launch<float>(q, kv, idx, J1, idx2, idx2_offset, sink, B, H, N, D, J, kv_batch_stride, kv_batch,
                                 scale, ws_o, ws_ml, nsplit, rows_per_split, 0, out_rope, rope_dim, out, stream)
                 : launch<__nv_bfloat16>(q, kv, idx, J1, idx2, idx2_offset, sink, B, H, N, D, J, kv_batch_stride,
                                         kv_batch, scale, ws_o, ws_ml, nsplit, rows_per_split, use_mma, out_rope,
                                         rope_dim, out, stream);
}
