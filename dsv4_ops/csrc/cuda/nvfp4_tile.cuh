// What the two tile kernels (nvfp4_tiled.cu: mma.sync; nvfp4_wgmma.cu: warpgroup MMA) share: a CTA owns TN (128;
// the wide wgmma tile 256) features x TM tokens over a range of K, stages its fp32 partial tile in shared memory
// and stores it (summed over the K split's cluster through distributed shared memory, in rank order:
// deterministic, no workspace); the cluster launch and the K-split plan.
#pragma once
#include <cooperative_groups.h>

#include "nvfp4_kernels.cuh"

namespace {

namespace cg = cooperative_groups;

constexpr int kTileN = 128;
constexpr int kOutStride = kTileN + 4;  // fp32 epilogue staging [token][feature]
constexpr int kMaxSplit = 8;            // portable cluster size

// This thread's share of a tile kernel's stage (tiled, wgmma dense and MoE): XLoads 16-byte activation pieces (placed
// where the kernel's layout x_offset(row, piece) puts them), TN / 64 x 16 B of packed weights and (threads < TN) the
// 8 scale bytes of one 128-k chunk of TN feature rows; every source moves one chunk on after each stage issued.
// Padding past K needs no guard in the mma loops: activations past K load as zeros (and padded codes are 0).
template <int XLoads, int TN = kTileN>
struct StageCopies {
  static constexpr int kWLoads = TN * 64 / 16 / kThreads;
  static_assert(kWLoads >= 1 && TN <= kThreads, "tile rows");
  const bf16* x_src[XLoads];
  uint32_t x_dst[XLoads];
  bool x_row_ok[XLoads];
  const uint8_t* w_src[kWLoads];
  bool w_ok[kWLoads];
  uint32_t w_step[kWLoads];  // 1024 in a full 16-row tile, 64 in a row-major N % 16 tail
  const uint8_t* s_src;
  uint32_t s_step;
  bool s_ok;
  int k_next;  // k of this thread's pieces in the next stage issued

  StageCopies() = default;  // the MoE kernel fills the sources per token tile
  // A dense tile: rows m_base.. of x, features n_base.. of the matrix, from chunk c_begin.
  template <typename XOffset>
  __device__ __forceinline__ StageCopies(const TiledParams& p, int m_base, int n_base, int c_begin,
                                         XOffset x_offset) {
    const int tid = threadIdx.x, kp = (p.K + 127) & ~127;
    const int x_k = (tid & 15) * 8;  // the k of this thread's activation pieces inside a chunk
#pragma unroll
    for (int i = 0; i < XLoads; ++i) {
      const int r = (tid + i * kThreads) >> 4;
      x_row_ok[i] = m_base + r < p.M;
      x_src[i] = p.x + size_t(min(m_base + r, p.M - 1)) * p.ldx + size_t(c_begin) * 128 + x_k;
      x_dst[i] = x_offset(r, tid & 15);
    }
#pragma unroll
    for (int i = 0; i < kWLoads; ++i) {
      const int id = tid + i * kThreads, r = id >> 2, part = id & 3, n = n_base + r;
      const RowAddr a = row_addr(min(n, p.N - 1), p.N, kp);
      w_src[i] = p.w + a.w + size_t(c_begin) * a.wstep + part * 16;
      w_ok[i] = n < p.N;
      w_step[i] = a.wstep;
    }
    const RowAddr sa = row_addr(min(n_base + (tid & (TN - 1)), p.N - 1), p.N, kp);
    s_src = p.s + sa.s + size_t(c_begin) * sa.sstep;
    s_step = sa.sstep;
    s_ok = tid < TN && n_base + tid < p.N;
    k_next = c_begin * 128 + x_k;
  }

  // Stage xs: activations at 0, weights at x_bytes, scale bytes at x_bytes + w_bytes; K: the activations' width,
  // any: a valid address for the zero-filling copies.
  __device__ __forceinline__ void issue(uint8_t* xs, int x_bytes, int w_bytes, int K, const bf16* any) {
    const int tid = threadIdx.x;
    uint8_t* ws = xs + x_bytes;
    uint8_t* ss = ws + w_bytes;
    const bool k_ok = k_next < K;
#pragma unroll
    for (int i = 0; i < XLoads; ++i) {
      const bool ok = x_row_ok[i] && k_ok;
      cp_async16(xs + x_dst[i], ok ? x_src[i] : any, ok ? 16 : 0);
      x_src[i] += 128;
    }
#pragma unroll
    for (int i = 0; i < kWLoads; ++i) {
      cp_async16(ws + (tid + i * kThreads) * 16, w_src[i], w_ok[i] ? 16 : 0);
      w_src[i] += w_step[i];
    }
    if (tid < TN) cp_async8(ss + tid * 8, s_src, s_ok ? 8 : 0);
    s_src += s_step;
    k_next += 128;
  }
};

// Stores v[0..3] (features n .. n + 3 of token row m) with the global scale applied.
__device__ __forceinline__ void store4(const TiledParams& p, int m, int n, float4 v, float alpha) {
  v.x *= alpha;
  v.y *= alpha;
  v.z *= alpha;
  v.w *= alpha;
  const size_t o = size_t(m) * p.ldy + p.y_col + n;  // (N % 4 == 0: 4-aligned too, as ldy = G N and y_col = g N)
  if ((p.N & 3) == 0 && p.out_kind == 0) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t*>(&a);
    u.y = *reinterpret_cast<const uint32_t*>(&b);
    *reinterpret_cast<uint2*>(reinterpret_cast<bf16*>(p.y) + o) = u;
  } else if ((p.N & 3) == 0 && p.out_kind == 2) {
    *reinterpret_cast<float4*>(reinterpret_cast<float*>(p.y) + o) = v;
  } else {
    const float e[4] = {v.x, v.y, v.z, v.w};
    for (int u = 0; u < 4 && n + u < p.N; ++u) store_out(p.y, o + u, e[u], p.out_kind);
  }
}

// Row stride (fp32) of a tile's epilogue staging cs[token][feature].
template <int TN>
__host__ __device__ constexpr int out_stride() {
  return TN + 4;
}

// The staged tile cs[token][feature] (row stride out_stride<TN>, unscaled; this CTA's K range) -> y: every rank of
// a CLUSTER (gridDim.z CTAs along z) sums 1/S of the tile over all S partials.
template <int TM, bool CLUSTER, int TN = kTileN>
__device__ __forceinline__ void store_tile(const TiledParams& p, float* cs, int m_base, int n_base) {
  const int tid = threadIdx.x;
  float alpha = __ldg(p.gs) * kUnbias;
  if (p.gs_act != nullptr) alpha *= __ldg(p.gs_act);
  // Items of 4 features of one token; rank r of S sums items r, r + S, ... over every rank's partial.
  constexpr int kItems = TM * TN / 4, kRowItems = TN / 4, kStride = out_stride<TN>();
  if constexpr (CLUSTER) {
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();  // every partial staged
    const int S = int(gridDim.z), r = int(blockIdx.z);
    for (int id = r * kThreads + tid; id < kItems; id += S * kThreads) {
      const int tl = id / kRowItems, fl = (id % kRowItems) * 4;
      const int m = m_base + tl, n = n_base + fl;
      if (m >= p.M || n >= p.N) continue;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int q = 0; q < S; ++q) {
        const float4 u = *reinterpret_cast<const float4*>(cl.map_shared_rank(cs, q) + tl * kStride + fl);
        v.x += u.x;
        v.y += u.y;
        v.z += u.z;
        v.w += u.w;
      }
      store4(p, m, n, v, alpha);
    }
    cl.sync();  // no CTA leaves while another still reads its shared memory
  } else {
    __syncthreads();
    for (int id = tid; id < kItems; id += kThreads) {
      const int tl = id / kRowItems, fl = (id % kRowItems) * 4;
      const int m = m_base + tl, n = n_base + fl;
      if (m >= p.M || n >= p.N) continue;
      store4(p, m, n, *reinterpret_cast<const float4*>(cs + tl * kStride + fl), alpha);
    }
  }
}

// A cluster launch of the split kernel: grid (feature tiles, token tiles, splits), clusters along z.
struct ClusterLaunch {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg;
  ClusterLaunch(dim3 grid, int smem, cudaStream_t stream) : attr{}, cfg{} {
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = size_t(smem);
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = grid.z;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // cfg.attrs points into this object
};

// Clusters of `splits` CTAs resident at once (a GPC holds whole clusters: 8-CTA clusters fill fewer SMs than 8
// free CTA slots suggest), -1 where the query fails; cached per kernel, device and split count.
template <auto Kernel, int Smem>
int max_active_clusters(int splits, cudaStream_t stream) {
  static int cache[64][kMaxSplit + 1] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  int& v = cache[dev & 63][splits];
  if (v == 0) {
    const ClusterLaunch l(dim3(1, 1, unsigned(splits)), Smem, stream);
    int n = 0;
    v = cudaOccupancyMaxActiveClusters(&n, Kernel, &l.cfg) == cudaSuccess && n > 0 ? n : -1;
    if (v < 0) cudaGetLastError();  // clear it: the launch falls back to no split
  }
  return v;
}

// K splits for `tiles` CTAs: as many as give every SM its CTAs (each split >= 2 chunks, at most a portable
// cluster) while every tile's cluster is resident at once (else the last clusters run as a second wave: 32
// clusters of 8 where 30 fit took 1.7x the time); then as few as cover the chunks with `per` each (no empty split).
template <auto Kernel, int Smem>
void plan_split(int64_t tiles, int nchunks, int slots, cudaStream_t stream, int& splits, int& per) {
  int s = tiles < slots ? int(slots / tiles) : 1;
  s = s < kMaxSplit ? s : kMaxSplit;
  s = s < nchunks / 2 ? s : nchunks / 2;
  for (; s > 1; --s) {
    per = (nchunks + s - 1) / s;
    splits = (nchunks + per - 1) / per;
    if (splits > 1 && tiles <= max_active_clusters<Kernel, Smem>(splits, stream)) return;
  }
  per = nchunks;
  splits = 1;
}

}  // namespace
