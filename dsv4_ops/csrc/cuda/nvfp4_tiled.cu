// The tiled NVFP4 kernel (64 < M < 256 by default; nvfp4_gemm.cu's file comment) and its launcher.
#include "nvfp4_kernels.cuh"

namespace {

__global__ void __launch_bounds__(kThreads, 1) nvfp4_tiled_kernel(const TiledParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int wn = warp & 3, wm = warp >> 2;  // 4 warps along features x 2 along tokens
  const int n_base = blockIdx.x * kTileN, m_base = blockIdx.y * kTileM;
  const int kp = (p.K + 127) & ~127, nchunks = kp >> 7;

  auto load_stage = [&](int st, int c) {
    uint8_t* xs = smem + st * kStageBytes;
    uint8_t* ws = xs + kXStage;
    uint8_t* ss = ws + kWStage;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int id = tid + i * kThreads, r = id >> 4, ch = id & 15;
      const int m = m_base + r, k = c * 128 + ch * 8;
      const bool ok = m < p.M && k < p.K;
      const bf16* src = p.x + size_t(min(m, p.M - 1)) * p.K + (ok ? k : 0);
      cp_async16(xs + r * 256 + ((ch ^ (r & 7)) << 4), src, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int id = tid + i * kThreads, r = id >> 2, part = id & 3;
      const int n = n_base + r;
      const RowAddr a = row_addr(min(n, p.N - 1), p.N, kp);
      const uint8_t* src = p.w + a.w + size_t(c) * a.wstep + part * 16;
      cp_async16(ws + r * 64 + part * 16, src, n < p.N ? 16 : 0);
    }
    if (tid < kTileN) {
      const int n = n_base + tid;
      const RowAddr a = row_addr(min(n, p.N - 1), p.N, kp);
      const uint8_t* src = p.s + a.s + size_t(c) * a.sstep;
      cp_async8(ss + tid * 8, src, n < p.N ? 8 : 0);
    }
  };

  float acc[2][8][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < nchunks) load_stage(st, st);
    cp_async_commit();
  }
  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int cn = c + kStages - 1;
    if (cn < nchunks) load_stage(cn % kStages, cn);
    cp_async_commit();

    const uint8_t* xs = smem + (c % kStages) * kStageBytes;
    const uint8_t* ws = xs + kXStage;
    const uint8_t* ss = ws + kWStage;
    uint4 wa[2], wb[2];
    uint2 sa[2], sb[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = wn * 32 + i * 16 + g;
      wa[i] = *reinterpret_cast<const uint4*>(ws + r * 64 + tq * 16);
      wb[i] = *reinterpret_cast<const uint4*>(ws + (r + 8) * 64 + tq * 16);
      sa[i] = *reinterpret_cast<const uint2*>(ss + r * 8);
      sb[i] = *reinterpret_cast<const uint2*>(ss + (r + 8) * 8);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t ra[2][4], rb[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t wa_j = j == 0 ? wa[i].x : j == 1 ? wa[i].y : j == 2 ? wa[i].z : wa[i].w;
        const uint32_t wb_j = j == 0 ? wb[i].x : j == 1 ? wb[i].y : j == 2 ? wb[i].z : wb[i].w;
        decode_word(wa_j, ra[i]);
        decode_word(wb_j, rb[i]);
      }
#pragma unroll
      for (int hs = 0; hs < 2; ++hs) {
        const int s = 2 * j + hs;
        if (c * 128 + s * 16 >= p.K) continue;
        uint32_t a[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) a_fragment(ra[i], rb[i], sa[i], sb[i], s, a[i]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          const int tok = wm * 64 + (np * 2 + (lane >> 4)) * 8 + (lane & 7);
          const int ch = 2 * s + ((lane >> 3) & 1);
          uint32_t b[4];
          ldmatrix_x4(b, xs + tok * 256 + ((ch ^ (tok & 7)) << 4));
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mma16816(acc[i][2 * np], a[i][0], a[i][1], a[i][2], a[i][3], b[0], b[1]);
            mma16816(acc[i][2 * np + 1], a[i][0], a[i][1], a[i][2], a[i][3], b[2], b[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  float alpha = __ldg(p.gs) * kUnbias;
  if (p.gs_act != nullptr) alpha *= __ldg(p.gs_act);
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = wn * 32 + i * 16 + g, tok = wm * 64 + nt * 8 + 2 * tq + e;
        cs[tok * kOutStride + row] = acc[i][nt][e] * alpha;
        cs[tok * kOutStride + row + 8] = acc[i][nt][2 + e] * alpha;
      }
  __syncthreads();
  const bool vec = (p.N % 8) == 0;
#pragma unroll 1
  for (int it = 0; it < (kTileM * kTileN / 8) / kThreads; ++it) {
    const int id = tid + it * kThreads, tl = id >> 4, fl = (id & 15) * 8;
    const int m = m_base + tl, n = n_base + fl;
    if (m >= p.M || n >= p.N) continue;
    const float* v = cs + tl * kOutStride + fl;
    const size_t o = size_t(m) * p.N + n;
    if (vec && p.out_kind == 0) {
      __nv_bfloat162 q[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) q[u] = __floats2bfloat162_rn(v[2 * u], v[2 * u + 1]);
      *reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(p.y) + o) = *reinterpret_cast<const uint4*>(q);
    } else {
      for (int u = 0; u < 8 && n + u < p.N; ++u) store_out(p.y, o + u, v[u], p.out_kind);
    }
  }
}

}  // namespace

namespace dsv4_nvfp4 {

cudaError_t launch_tiled(const TiledParams& p, cudaStream_t stream) {
  const cudaError_t err =
      cudaFuncSetAttribute(nvfp4_tiled_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTiledSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned((p.N + kTileN - 1) / kTileN), unsigned((p.M + kTileM - 1) / kTileM));
  nvfp4_tiled_kernel<<<grid, kThreads, kTiledSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsv4_nvfp4
