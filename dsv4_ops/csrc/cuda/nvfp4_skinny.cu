// The skinny NVFP4 kernel (M <= 64 and every MoE projection; nvfp4_gemm.cu's file comment) and its launcher.
#include "nvfp4_kernels.cuh"

namespace {

struct WStage {
  uint4 wa[kStageChunks], wb[kStageChunks];
  uint2 sa[kStageChunks], sb[kStageChunks];
};

template <int MODE, int NT>
__global__ void __launch_bounds__(kThreads) nvfp4_skinny_kernel(const SkinnyParams p) {
  __shared__ float red[kWarps][NT * 4][32];
  __shared__ LocalRoute lr;
  if (p.pdl) grid_dep_wait();
  local_route_cta<MODE>(p, lr);
  Task task;
  if (!resolve_task<MODE>(p, task, lr)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int kw = warp % p.kw, rt = warp / p.kw;
  const int ntiles = (task.N + 15) >> 4;
  const int tile0 = blockIdx.x * p.rt;
  if (tile0 >= ntiles) return;
  const bool tile_ok = tile0 + rt < ntiles;
  const int tile = tile_ok ? tile0 + rt : ntiles - 1;
  const int row_a = min(tile * 16 + g, task.N - 1), row_b = min(tile * 16 + g + 8, task.N - 1);
  const int kp = (task.K + 127) & ~127, nchunks = kp >> 7;
  const int per = (nchunks + p.kw - 1) / p.kw;
  const int c_begin = min(kw * per, nchunks), c_end = min(c_begin + per, nchunks);
  const RowAddr aa = row_addr(row_a, task.N, kp), ab = row_addr(row_b, task.N, kp);  // one tile: same steps
  const uint8_t* wa_ptr = task.w + aa.w + tq * 16;
  const uint8_t* wb_ptr = task.w + ab.w + tq * 16;
  const uint8_t* sa_ptr = task.s + aa.s;
  const uint8_t* sb_ptr = task.s + ab.s;
  const uint32_t wstep = aa.wstep, sstep = aa.sstep;

  for (int tt = 0; tt < task.cnt; tt += 8 * NT) {
    const uint32_t* brow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      brow[nt] = reinterpret_cast<const uint32_t*>(b_row<MODE>(p, task, min(tt + nt * 8 + g, task.cnt - 1)));
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

    auto load = [&](WStage& st, int c0) {
#pragma unroll
      for (int i = 0; i < kStageChunks; ++i) {
        const int c = c0 + i;
        if (c < c_end) {
          st.wa[i] = ld_stream16(wa_ptr + size_t(c) * wstep);
          st.wb[i] = ld_stream16(wb_ptr + size_t(c) * wstep);
          st.sa[i] = __ldg(reinterpret_cast<const uint2*>(sa_ptr + size_t(c) * sstep));
          st.sb[i] = __ldg(reinterpret_cast<const uint2*>(sb_ptr + size_t(c) * sstep));
        } else {
          st.wa[i] = st.wb[i] = make_uint4(0u, 0u, 0u, 0u);
          st.sa[i] = st.sb[i] = make_uint2(0u, 0u);
        }
      }
    };
    auto compute = [&](const WStage& st, int c0) {
#pragma unroll
      for (int i = 0; i < kStageChunks; ++i) {
        const int c = c0 + i;
        if (c >= c_end) continue;
        const uint32_t wra[4] = {st.wa[i].x, st.wa[i].y, st.wa[i].z, st.wa[i].w};
        const uint32_t wrb[4] = {st.wb[i].x, st.wb[i].y, st.wb[i].z, st.wb[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t ra[4], rb[4];
          decode_word(wra[j], ra);
          decode_word(wrb[j], rb);
#pragma unroll
          for (int hs = 0; hs < 2; ++hs) {
            const int s = 2 * j + hs;
            const int kk = c * 128 + s * 16;
            if (kk >= task.K) continue;
            uint32_t a[4];
            a_fragment(ra, rb, st.sa[i], st.sb[i], s, a);
            const int kx = (kk >> 1) + tq;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint32_t b0 = __ldg(brow[nt] + kx), b1 = __ldg(brow[nt] + kx + 4);
              mma16816(acc[nt], a[0], a[1], a[2], a[3], b0, b1);
            }
          }
        }
      }
    };

    WStage s0, s1;
    int c = c_begin;
    load(s0, c);
    while (c < c_end) {
      load(s1, c + kStageChunks);
      compute(s0, c);
      c += kStageChunks;
      if (c >= c_end) break;
      load(s0, c + kStageChunks);
      compute(s1, c);
      c += kStageChunks;
    }

    // every weight load of this CTA is issued: let the next kernel's CTAs fill the SMs this wave frees
    if (p.pdl && tt + 8 * NT >= task.cnt) grid_dep_launch();
    if (p.kw > 1) {
      if (kw != 0) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) red[warp][nt * 4 + r][lane] = acc[nt][r];
      }
      __syncthreads();
      if (kw == 0) {
        for (int w2 = 1; w2 < p.kw; ++w2) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[nt][r] += red[warp + w2][nt * 4 + r][lane];
        }
      }
    }
    if (kw == 0 && tile_ok) skinny_epilogue<MODE, NT>(p, task, acc, tile, tt, g, tq, 8 * NT);
    if (p.kw > 1) __syncthreads();  // `red` is reused by the next token tile
  }
}

}  // namespace

namespace dsv4_nvfp4 {

template <int MODE>
cudaError_t launch_skinny(const SkinnyParams& p, int nt, dim3 grid, cudaStream_t stream) {
  const bool pdl = p.pdl != 0;
  switch (nt) {
    case 1: return launch_ex(pdl, nvfp4_skinny_kernel<MODE, 1>, grid, dim3(kThreads), 0, stream, p);
    case 2: return launch_ex(pdl, nvfp4_skinny_kernel<MODE, 2>, grid, dim3(kThreads), 0, stream, p);
    case 4: return launch_ex(pdl, nvfp4_skinny_kernel<MODE, 4>, grid, dim3(kThreads), 0, stream, p);
    default: return launch_ex(pdl, nvfp4_skinny_kernel<MODE, 8>, grid, dim3(kThreads), 0, stream, p);
  }
}

template cudaError_t launch_skinny<kDense>(const SkinnyParams&, int, dim3, cudaStream_t);
template cudaError_t launch_skinny<kMoeUp>(const SkinnyParams&, int, dim3, cudaStream_t);
template cudaError_t launch_skinny<kMoeDown>(const SkinnyParams&, int, dim3, cudaStream_t);

}  // namespace dsv4_nvfp4
