// The decode gemv NVFP4 kernel (dense M <= 8 and the MoE projections while experts see few tokens;
// nvfp4_gemm.cu's file comment) and its launcher.
#include "nvfp4_kernels.cuh"

namespace {

// ------------------------------------------------------------------------------------------ gemv kernel
// Decode GEMV: dense M <= 8, and the MoE projections while experts see few tokens. Work split as in skinny (a
// warp owns 16 rows x a K range, warps of a CTA split K), but each warp streams its chunks through its own
// shared-memory ring of kStages chunks filled by cp.async (weights, scales and the chunk's activation rows), so
// kStages - 1 chunks are in flight without holding registers, and the activation fragments come from the ring by
// ldmatrix: nothing on the mma's critical path waits on L1/L2 (skinny's per-k-step activation loads did).
// With PDL (dense too) a CTA may start under the previous kernel's tail but reads nothing before
// griddepcontrol.wait, weights included: the op cannot know that its weights were not just written (a copy of a
// misaligned view, a test's copy_). Dense CTAs only warm L2 with their weights before the wait. (Loading weights
// into the ring before the wait measured faster per call: bench/RESULTS.md.)
template <int ROWS, int OCC>  // activation rows per pass (2 or 8); the mma's other columns repeat them and are dropped
struct GemvCfg {
  static constexpr int kStages = ROWS <= 2 ? (OCC == 3 ? 4 : 6) : 3;
  static constexpr int kW = 1024;        // [2][32 lanes] x 16 B: rows g / g + 8 of the chunk, lane order
  static constexpr int kS = 128;         // [16 rows] x 8 scale bytes
  static constexpr int kX = ROWS * 256;  // [ROWS] x 128 bf16, 16-byte pieces XOR-swizzled by row (ldmatrix)
  static constexpr int kStage = kW + kS + kX;
  static constexpr int kSmem = kStage * kStages * kWarps;
};

template <int MODE, int ROWS, int OCC>
__global__ void __launch_bounds__(kThreads, OCC) nvfp4_gemv_kernel(const SkinnyParams p) {
  using Cfg = GemvCfg<ROWS, OCC>;
  constexpr int S = Cfg::kStages;
  extern __shared__ __align__(128) uint8_t gsmem[];
  __shared__ float red[kWarps][4][32];
  __shared__ LocalRoute lr;
  // The weights and the shape of a dense task or of the shared expert are launch parameters, known before the
  // wait; a routed expert comes from the routing (its kernel, or the ids: the predecessors' outputs).
  const bool early = MODE == kDense || int(blockIdx.y) < p.n_sslots;
  if (!early && p.pdl) grid_dep_wait();
  local_route_cta<MODE>(p, lr);
  Task task;
  if (MODE == kDense) {
    dense_task(p, task);
  } else if (!resolve_task<MODE>(p, task, lr)) {
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int kw = warp % p.kw, rt = warp / p.kw;
  const int ntiles = (task.N + 15) >> 4;
  const int tile0 = blockIdx.x * p.rt;
  if (tile0 >= ntiles) return;
  const bool tile_ok = tile0 + rt < ntiles;
  const int tile = tile_ok ? tile0 + rt : ntiles - 1;
  const int kp = (task.K + 127) & ~127, nchunks = kp >> 7;
  const int per = (nchunks + p.kw - 1) / p.kw;
  const int c_begin = min(kw * per, nchunks), c_end = min(c_begin + per, nchunks);
  // Rows g / g + 8 / lane & 15 (clamped) of one tile: all tile-major, or all in a row-major partial tile, so
  // one chunk step serves the three streams.
  const RowAddr ra = row_addr(min(tile * 16 + g, task.N - 1), task.N, kp);
  const uint8_t* wa_ptr = task.w + ra.w + tq * 16;
  const uint8_t* wb_ptr = task.w + row_addr(min(tile * 16 + g + 8, task.N - 1), task.N, kp).w + tq * 16;
  const uint8_t* s_ptr = task.s + row_addr(min(tile * 16 + (lane & 15), task.N - 1), task.N, kp).s;
  const uint32_t wstep = ra.wstep, sstep = ra.sstep;
  uint8_t* ring = gsmem + warp * (Cfg::kStage * S);
  if (early && p.pdl) {
    // Only the chunks the ring's first fills read: warming the whole K range slowed large shapes (it competes
    // with the previous kernel's own stream; bench/RESULTS.md).
    const int warm = min(c_end - c_begin, S);
    if (warm > 0 && wstep == 1024u) {  // a full tile: its chunks are one contiguous range
      if (lane == 0) {  // row 0 of the tile, byte 0: wa_ptr / s_ptr are the tile's base
        prefetch_l2_bulk(wa_ptr + size_t(c_begin) * 1024, uint32_t(warm) * 1024);
        prefetch_l2_bulk(s_ptr + size_t(c_begin) * 128, uint32_t(warm) * 128);
      }
    } else if (lane < 16 && warm > 0) {  // a partial tile, row-major: lane l warms row l
      const RowAddr rl = row_addr(min(tile * 16 + lane, task.N - 1), task.N, kp);
      prefetch_l2_bulk(task.w + rl.w + size_t(c_begin) * 64, uint32_t(warm) * 64);
      const uint8_t* srow = task.s + rl.s + size_t(c_begin) * 8;
      prefetch_l2(srow);
      prefetch_l2(srow + warm * 8 - 1);
    }
    grid_dep_wait();
  }
  // Past its wait (or launched without PDL: its predecessors are done) this CTA's inputs are final, so a kernel
  // that reads only those inputs may start now; exited CTAs count as triggered.
  if (MODE == kDense && p.trigger_now) grid_dep_launch();
  if (MODE == kDense) {
    float a = __ldg(task.gsp) * kUnbias;
    if (p.gs_act != nullptr) a *= __ldg(p.gs_act);
    task.alpha = a;
  }

  // This lane's copies go to fixed offsets of a stage: its 16 bytes of rows g / g + 8, the scale bytes of row
  // `lane` (lanes < 16), and piece lane & 15 (8 bf16) of activation rows lane >> 4, + 2, ... (XOR-swizzled).
  const int pc = lane & 15;
  uint32_t x_dst[ROWS / 2];
#pragma unroll
  for (int i = 0; i < ROWS / 2; ++i) {
    const int r = (lane >> 4) + 2 * i;
    x_dst[i] = Cfg::kW + Cfg::kS + r * 256 + ((pc ^ (r & 7)) << 4);
  }
  // ldmatrix: matrix m = lane >> 3 (k-step 2q + m / 2, half m & 1), token row lane & 7 (repeating the pass rows)
  const int xr = (lane & 7) & (ROWS - 1), xm = lane >> 3;
  uint32_t ldm[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int piece = (2 * q + (xm >> 1)) * 2 + (xm & 1);
    ldm[q] = Cfg::kW + Cfg::kS + xr * 256 + ((piece ^ xr) << 4);
  }
  for (int tt = 0; tt < task.cnt; tt += ROWS) {
    const int rows = min(ROWS, task.cnt - tt);
    const bf16* xrow[ROWS / 2];
#pragma unroll
    for (int i = 0; i < ROWS / 2; ++i)
      xrow[i] = b_row<MODE>(p, task, tt + min((lane >> 4) + 2 * i, rows - 1));
    // Chunk ci into stage stg: one cp.async group per chunk (empty past c_end).
    auto issue = [&](int ci, uint8_t* stg) {
      if (ci < c_end) {
        cp_async16(stg + lane * 16, wa_ptr + uint32_t(ci) * wstep, 16);
        cp_async16(stg + 512 + lane * 16, wb_ptr + uint32_t(ci) * wstep, 16);
        if (lane < 16) cp_async8(stg + Cfg::kW + lane * 8, s_ptr + uint32_t(ci) * sstep, 8);
        const int kx = ci * 128 + pc * 8;
#pragma unroll
        for (int i = 0; i < ROWS / 2; ++i) {
          const bool ok = (lane >> 4) + 2 * i < rows && kx < task.K;
          cp_async16(stg + x_dst[i], ok ? xrow[i] + kx : xrow[0], ok ? 16 : 0);
        }
      }
      cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(c_begin + j, ring + j * Cfg::kStage);
    float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
    // One trip of the outer loop walks the whole ring, so every stage offset is a constant.
    for (int c0 = c_begin; c0 < c_end; c0 += S) {
#pragma unroll
      for (int j = 0; j < S; ++j) {
        const int c = c0 + j;
        if (c >= c_end) break;
        // chunk c + S - 1 into the stage consumed last step (the __syncwarp below ordered its reads)
        issue(c + S - 1, ring + ((j + S - 1) % S) * Cfg::kStage);
        cp_async_wait<S - 1>();  // this thread's copies of chunk c have landed
        __syncwarp();            // ... and every lane's
        const uint8_t* st = ring + j * Cfg::kStage;
        const uint4 wa = *reinterpret_cast<const uint4*>(st + lane * 16);
        const uint4 wb = *reinterpret_cast<const uint4*>(st + 512 + lane * 16);
        const RowScales sa = row_scales(*reinterpret_cast<const uint2*>(st + Cfg::kW + g * 8));
        const RowScales sb = row_scales(*reinterpret_cast<const uint2*>(st + Cfg::kW + (g + 8) * 8));
        uint32_t b[4][4];  // k-steps 2q, 2q + 1: {b0, b1, b0', b1'}
#pragma unroll
        for (int q = 0; q < 4; ++q) ldmatrix_x4(b[q], st + ldm[q]);
        chunk_mma(wa, wb, sa, sb, b, acc0, acc1);
        __syncwarp();  // every lane's reads of this stage are done before it is refilled
      }
    }
    cp_async_wait<0>();  // no copy outlives the pass (the next pass refills from stage 0)
    __syncwarp();
    float acc[1][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[0][r] = acc0[r] + acc1[r];
    if (p.pdl && tt + ROWS >= task.cnt) grid_dep_launch();
    if (p.kw > 1) {
      if (kw != 0) {
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][r][lane] = acc[0][r];
      }
      __syncthreads();
      if (kw == 0) {
        for (int w2 = 1; w2 < p.kw; ++w2) {
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[0][r] += red[warp + w2][r][lane];
        }
      }
    }
    if (kw == 0 && tile_ok) skinny_epilogue<MODE, 1>(p, task, acc, tile, tt, g, tq, ROWS);
    if (p.kw > 1) __syncthreads();  // `red` is reused by the next pass
  }
}

}  // namespace

namespace dsv4_nvfp4 {

template <int MODE, int ROWS, int OCC>
cudaError_t launch_gemv_occ(const SkinnyParams& p, dim3 grid, cudaStream_t stream) {
  auto kernel = nvfp4_gemv_kernel<MODE, ROWS, OCC>;
  static bool smem_set[64] = {};  // per device; the attribute is set before the first launch (never in capture)
  int dev = 0;
  cudaGetDevice(&dev);
  if (!smem_set[dev & 63]) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, GemvCfg<ROWS, OCC>::kSmem);
    if (err != cudaSuccess) return err;
    smem_set[dev & 63] = true;
  }
  return launch_ex(p.pdl != 0, kernel, grid, dim3(kThreads), size_t(GemvCfg<ROWS, OCC>::kSmem), stream, p);
}

template <int MODE, int ROWS>
cudaError_t launch_gemv(const SkinnyParams& p, dim3 grid, cudaStream_t stream, int occ) {
  if (ROWS == 2 && occ == 3) return launch_gemv_occ<MODE, 2, 3>(p, grid, stream);
  return launch_gemv_occ<MODE, ROWS, 2>(p, grid, stream);
}

template cudaError_t launch_gemv<kDense, 2>(const SkinnyParams&, dim3, cudaStream_t, int);
template cudaError_t launch_gemv<kDense, 8>(const SkinnyParams&, dim3, cudaStream_t, int);
template cudaError_t launch_gemv<kMoeUp, 2>(const SkinnyParams&, dim3, cudaStream_t, int);
template cudaError_t launch_gemv<kMoeUp, 8>(const SkinnyParams&, dim3, cudaStream_t, int);
template cudaError_t launch_gemv<kMoeDown, 2>(const SkinnyParams&, dim3, cudaStream_t, int);
template cudaError_t launch_gemv<kMoeDown, 8>(const SkinnyParams&, dim3, cudaStream_t, int);

}  // namespace dsv4_nvfp4
