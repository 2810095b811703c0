// The wgmma NVFP4 kernels (dense 32 <= M <= 1024 and the MoE beyond gemv by default; nvfp4_gemm.cu's file comment)
// and their launchers; the warpgroup-MMA K loop they share is nvfp4_wgmma.cuh.
//   dense: one matrix at 8 < M: the tiled kernel's CTA (nvfp4_tile.cuh: 128 features x TM tokens over a range of
//     K, the cluster K split, the epilogue) with wgmma in place of mma.sync. One wgmma.m64nTMk16 per k-step
//     replaces TM / 8 mma.sync and their ldmatrix per warp: the tiled kernel was bound by mma issue at M = 64
//     (bench/RESULTS.md, session 24).
//   MoE up / down (T*k beyond the gemv kernel's reach): blockIdx.y = the skinny kernel's slot (shared-expert token
//     chunks, then active experts), blockIdx.x = 128 of the projection's rows; the CTA walks its task's tokens in
//     tiles of TM, gathering their activation rows into the ring (routed: by assignment), with skinny's epilogue
//     (SwiGLU x routing weight for up, rows for the combine for down). No K split: the slots fill the SMs.
#include "nvfp4_wgmma.cuh"

namespace {

// blockIdx = (feature tile, group * token tiles + token tile, K split); `per` chunks of 128 K per split. CLUSTER:
// gridDim.z > 1 CTAs of a tile form one cluster along z. TN: features per CTA (128, or the wide 256).
template <int TM, int TN, bool CLUSTER>
__global__ void __launch_bounds__(kThreads, WgCfg<TM, TN>::kOcc) nvfp4_wgmma_kernel(const TiledParams pg, int per) {
  using Cfg = WgCfg<TM, TN>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const AlignedSmem sm = aligned_smem(smem_raw);
  const int mt = (pg.M + TM - 1) / TM;
  const TiledParams p = group_matrix(pg, int(blockIdx.y) / mt);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int n_base = blockIdx.x * TN, m_base = (int(blockIdx.y) % mt) * TM;
  const int kp = (p.K + 127) & ~127, nchunks = kp >> 7;
  const int c_begin = min(int(blockIdx.z) * per, nchunks), n_local = min(c_begin + per, nchunks) - c_begin;

  // This thread's copies of a stage (activation pieces in the 128-byte swizzle atoms wgmma reads).
  StageCopies<Cfg::kXLoads, TN> copies(p, m_base, n_base, c_begin, x_piece_offset<TM>);
  auto load_stage = [&](uint8_t* xs) { copies.issue(xs, Cfg::kXStage, Cfg::kWStage, p.K, p.x); };

  // This warp's 16 rows (g, g + 8) of each 128-row block: warpgroup warp >> 2 holds rows 64 (warp >> 2) .. + 63.
  const int r0 = warp * 16 + g;
  float acc[Cfg::kAcc];
#pragma unroll
  for (int i = 0; i < Cfg::kAcc; ++i) acc[i] = 0.f;
  wgmma_k_loop<TM, TN>(sm.p, sm.s, n_local, r0, tq, load_stage, acc);

  // The CTA's (partial) tile, unscaled: cs[token][feature].
  float* cs = reinterpret_cast<float*>(sm.p);
  constexpr int kStride = out_stride<TN>();
#pragma unroll
  for (int b = 0; b < Cfg::kBlocks; ++b)
#pragma unroll
    for (int i = 0; i < TM / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        cs[(8 * i + 2 * tq + (e & 1)) * kStride + 128 * b + r0 + 8 * (e >> 1)] = acc[b * (TM / 2) + 4 * i + e];
  store_tile<TM, CLUSTER, TN>(p, cs, m_base, n_base);
}

// MoE up / down: blockIdx.y = slot (resolve_task), blockIdx.x = TN rows of the task's matrix.
template <int MODE, int TM, int TN>
__global__ void __launch_bounds__(kThreads, WgCfg<TM, TN>::kOcc) nvfp4_moe_wgmma_kernel(const SkinnyParams p) {
  using Cfg = WgCfg<TM, TN>;
  using Copies = StageCopies<Cfg::kXLoads, TN>;
  constexpr int kTiles = TN / 16;  // 16-row tiles of the CTA (the skinny epilogue's unit)
  extern __shared__ __align__(128) uint8_t smem_raw[];
  __shared__ LocalRoute lr;
  if (p.pdl) grid_dep_wait();
  local_route_cta<MODE>(p, lr);
  Task task;
  if (!resolve_task<MODE>(p, task, lr)) return;
  const int ntiles = (task.N + 15) >> 4;
  if (int(blockIdx.x) * kTiles >= ntiles) return;  // the shared expert may be narrower than the routed ones
  const AlignedSmem sm = aligned_smem(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int n_base = blockIdx.x * TN;
  const int kp = (task.K + 127) & ~127, nchunks = kp >> 7;
  const int x_k = (tid & 15) * 8;
  // The stage copies: weights and scales from chunk 0 of the task's rows, activations gathered per token tile.
  Copies base;
#pragma unroll
  for (int i = 0; i < Copies::kWLoads; ++i) {
    const int id = tid + i * kThreads, n = n_base + (id >> 2);
    const RowAddr a = row_addr(min(n, task.N - 1), task.N, kp);
    base.w_src[i] = task.w + a.w + (id & 3) * 16;
    base.w_ok[i] = n < task.N;
    base.w_step[i] = a.wstep;
  }
  const RowAddr sa = row_addr(min(n_base + (tid & (TN - 1)), task.N - 1), task.N, kp);
  base.s_src = task.s + sa.s;
  base.s_step = sa.sstep;
  base.s_ok = tid < TN && n_base + tid < task.N;
  base.k_next = x_k;
#pragma unroll
  for (int i = 0; i < Cfg::kXLoads; ++i) base.x_dst[i] = x_piece_offset<TM>((tid + i * kThreads) >> 4, tid & 15);

  for (int tt = 0; tt < task.cnt; tt += TM) {
    Copies copies = base;  // this token tile's activation rows (past the task's tokens: zeros)
#pragma unroll
    for (int i = 0; i < Cfg::kXLoads; ++i) {
      const int pos = tt + ((tid + i * kThreads) >> 4);
      copies.x_row_ok[i] = pos < task.cnt;
      copies.x_src[i] = b_row<MODE>(p, task, min(pos, task.cnt - 1)) + x_k;
    }
    auto load_stage = [&](uint8_t* xs) { copies.issue(xs, Cfg::kXStage, Cfg::kWStage, task.K, p.in); };
    float acc[Cfg::kAcc];
#pragma unroll
    for (int i = 0; i < Cfg::kAcc; ++i) acc[i] = 0.f;
    wgmma_k_loop<TM, TN>(sm.p, sm.s, nchunks, warp * 16 + g, tq, load_stage, acc);
    // every weight load of this CTA is issued: let the next kernel's CTAs fill the SMs this wave frees
    if (p.pdl && tt + TM >= task.cnt) grid_dep_launch();
    // block b holds rows 128 b + 16 warp + g (+ 8): 16-row tile 8 b + warp of the CTA
#pragma unroll
    for (int b = 0; b < Cfg::kBlocks; ++b) {
      const int tile = blockIdx.x * kTiles + 8 * b + warp;
      if (tile < ntiles)
        skinny_epilogue<MODE, TM / 8>(p, task, *reinterpret_cast<const float(*)[TM / 8][4]>(acc + b * (TM / 2)),
                                      tile, tt, g, tq, TM);
    }
  }
}

template <int TM, int TN>
cudaError_t run_wgmma(const TiledParams& p, int sms, cudaStream_t stream) {
  using Cfg = WgCfg<TM, TN>;
  for (const auto kernel : {nvfp4_wgmma_kernel<TM, TN, false>, nvfp4_wgmma_kernel<TM, TN, true>}) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
    if (err != cudaSuccess) return err;
  }
  const int nchunks = (p.K + 127) / 128;
  const unsigned nt = unsigned((p.N + TN - 1) / TN), mt = unsigned((p.M + TM - 1) / TM * p.G);
  int splits = 1, per = nchunks;
  plan_split<nvfp4_wgmma_kernel<TM, TN, true>, Cfg::kSmem>(int64_t(nt) * mt, nchunks, sms * Cfg::kOcc, stream,
                                                             splits, per);
  if (splits == 1) {
    nvfp4_wgmma_kernel<TM, TN, false><<<dim3(nt, mt, 1), kThreads, Cfg::kSmem, stream>>>(p, per);
    return cudaGetLastError();
  }
  const ClusterLaunch l(dim3(nt, mt, unsigned(splits)), Cfg::kSmem, stream);
  return cudaLaunchKernelEx(&l.cfg, nvfp4_wgmma_kernel<TM, TN, true>, p, per);
}

template <int MODE, int TM, int TN>
cudaError_t run_moe_wgmma(const SkinnyParams& p, dim3 grid, cudaStream_t stream) {
  const auto kernel = nvfp4_moe_wgmma_kernel<MODE, TM, TN>;
  constexpr int smem = WgCfg<TM, TN>::kSmem;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  return launch_ex(p.pdl != 0, kernel, grid, dim3(kThreads), size_t(smem), stream, p);
}

}  // namespace

namespace dsv4_nvfp4 {

int wgmma_tile_tokens(int64_t tokens) { return tokens <= 16 ? 16 : tokens <= 32 ? 32 : tokens <= 64 ? 64 : 128; }

cudaError_t launch_wgmma(const TiledParams& p, bool wide, int sms, cudaStream_t stream) {
  if (wide) {
    const int tm = wgmma_tile_tokens(p.M);
    return tm <= 32 ? run_wgmma<32, 256>(p, sms, stream)
                    : tm == 64 ? run_wgmma<64, 256>(p, sms, stream) : run_wgmma<128, 256>(p, sms, stream);
  }
  switch (wgmma_tile_tokens(p.M)) {
    case 16: return run_wgmma<16, kTileN>(p, sms, stream);
    case 32: return run_wgmma<32, kTileN>(p, sms, stream);
    case 64: return run_wgmma<64, kTileN>(p, sms, stream);
    default: return run_wgmma<128, kTileN>(p, sms, stream);
  }
}

template <int MODE>
cudaError_t launch_moe_wgmma(const SkinnyParams& p, int tm, bool wide, int rows, int slots, cudaStream_t stream) {
  if (wide) {  // the dense wide tile's token tiles (16 -> 32)
    const dim3 grid(unsigned((rows + 255) / 256), unsigned(slots));
    return tm <= 32 ? run_moe_wgmma<MODE, 32, 256>(p, grid, stream)
                    : tm == 64 ? run_moe_wgmma<MODE, 64, 256>(p, grid, stream)
                               : run_moe_wgmma<MODE, 128, 256>(p, grid, stream);
  }
  const dim3 grid(unsigned((rows + kTileN - 1) / kTileN), unsigned(slots));
  switch (tm) {
    case 16: return run_moe_wgmma<MODE, 16, kTileN>(p, grid, stream);
    case 32: return run_moe_wgmma<MODE, 32, kTileN>(p, grid, stream);
    case 64: return run_moe_wgmma<MODE, 64, kTileN>(p, grid, stream);
    default: return run_moe_wgmma<MODE, 128, kTileN>(p, grid, stream);
  }
}

template cudaError_t launch_moe_wgmma<kMoeUp>(const SkinnyParams&, int, bool, int, int, cudaStream_t);
template cudaError_t launch_moe_wgmma<kMoeDown>(const SkinnyParams&, int, bool, int, int, cudaStream_t);

}  // namespace dsv4_nvfp4
