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
#include <type_traits>

#include "nvfp4_wgmma.cuh"
#include "tma.h"

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

  float* cs = reinterpret_cast<float*>(sm.p);
  stage_tile<TM, TN>(cs, acc, r0, tq);
  store_tile<TM, CLUSTER, TN>(p, cs, m_base, n_base);
}

// The dense kernel with its ring filled by bulk copies instead of every thread's cp.async (one matrix, N % 16 == 0:
// launch_wgmma_tma's conditions), warp-specialized: a third warpgroup loads (its first warp issues; setmaxnreg
// hands its registers to the two consumer warpgroups: the wide tile's consumers need ~221, and with 384 threads
// the launch gives each thread 168). Per chunk the loader announces the stage's bytes on the stage's full barrier and its
// lanes issue the two activation boxes (the tensor map: 128-byte swizzled atoms, rows past M and k past K as
// zeros) and the 16-row weight / scale blocks (1,024 / 128 contiguous bytes each in the kernel layout; rows past N
// are not loaded and only feed outputs never stored); before refilling a stage it waits on the stage's empty
// barrier, where each consumer warp arrives once its wgmmas reading the stage retired. The consumers never wait on
// a load they did not need, there is no CTA-wide barrier in the loop, and the epilogue stays in the consumers'
// branch (code after the branches would run under the loader's register count). The first version (thread 0 of
// warp 0 loading) stalled its warpgroup: 2x slower (bench/RESULTS.md). The same wgmmas in the same order and the
// cp.async kernel's K split: the same bits.
constexpr int kTmaThreads = kThreads + 128;

// CTAs per SM: the cp.async kernel's, but one for the 256-feature tiles (their consumers need more registers
// than two CTAs leave them).
template <int TM, int TN>
__host__ __device__ constexpr int tma_occ() {
  return WgCfg<TM, TN>::kOcc == 2 && TN == 128 ? 2 : 1;
}

// setmaxnreg: a warpgroup's registers per thread, the CTA's total conserved: 3 x the launch's 168 at 1 CTA per SM
// = 56 + 2 x 224 (40 + 2 x 232 spilled 28 bytes in the clustered wide tiles), 3 x 80 at 2 >= 24 + 2 x 104 (an inc
// past the pool would spin forever).
constexpr int launch_registers(int ctas) { return (65536 / (ctas * kTmaThreads)) & ~7; }
static_assert(56 + 2 * 224 <= 3 * launch_registers(1) && 24 + 2 * 104 <= 3 * launch_registers(2), "register pool");
template <bool INC, int N>
__device__ __forceinline__ void set_max_registers() {
  if constexpr (INC)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N) : "memory");
  else
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N) : "memory");
}

template <int TM, int TN, bool CLUSTER>
__global__ void __launch_bounds__(kTmaThreads, (tma_occ<TM, TN>()))
    nvfp4_wgmma_tma_kernel(const __grid_constant__ CUtensorMap xmap, const TiledParams p, int per) {
  using Cfg = WgCfg<TM, TN>;
  constexpr int S = kWgStages, kOcc = tma_occ<TM, TN>();
  extern __shared__ __align__(128) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * S];  // full[0, S): a chunk landed; empty[S, 2S): its stage was read
  const AlignedSmem sm = aligned_smem(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int n_base = blockIdx.x * TN, m_base = int(blockIdx.y) * TM;
  const int kp = (p.K + 127) & ~127, nchunks = kp >> 7;
  const int c_begin = min(int(blockIdx.z) * per, nchunks), n_local = min(c_begin + per, nchunks) - c_begin;
  const uint32_t full0 = dsv4_cuda::smem_addr(&bars[0]), empty0 = dsv4_cuda::smem_addr(&bars[S]);
  if (tid == 0) {
    for (int st = 0; st < S; ++st) {
      dsv4_cuda::mbar_init(full0 + 8 * st, 1);
      dsv4_cuda::mbar_init(empty0 + 8 * st, kThreads / 32);
    }
    dsv4_cuda::fence_mbar_init();
  }
  __syncthreads();

  if (__shfl_sync(0xffffffffu, tid / 128, 0) == kThreads / 128) {  // the loader warpgroup (warp-uniform test)
    set_max_registers<false, kOcc == 1 ? 56 : 24>();
    if (warp == kThreads / 32) {
      const int tiles = min(TN / 16, (p.N - n_base) / 16);  // this CTA's 16-row weight blocks
      const size_t kp2 = size_t(kp) / 2, kp16 = size_t(kp) / 16;
      for (int j = 0; j < n_local; ++j) {
        const int st = j % S, c = c_begin + j;
        if (j >= S) dsv4_cuda::mbar_wait(empty0 + 8 * st, uint32_t(j / S - 1) & 1u);  // chunk j - S was read
        const uint32_t bar = full0 + 8 * st, xs = sm.s + uint32_t(st * Cfg::kStageBytes);
        if (lane == 0) dsv4_cuda::mbar_expect_tx(bar, uint32_t(Cfg::kXStage + tiles * (1024 + 128)));
        __syncwarp();
        for (int q = lane; q < 2 + 2 * tiles; q += 32) {  // a copy per lane: 2 boxes, the weight, the scale blocks
          if (q < 2) {
            dsv4_cuda::tma_load_2d(xs + q * (TM * 128), &xmap, c * 128 + 64 * q, m_base, bar);
          } else if (q < 2 + tiles) {
            const size_t row0 = size_t(n_base + 16 * (q - 2));
            dsv4_cuda::bulk_load(xs + Cfg::kXStage + (q - 2) * 1024, p.w + row0 * kp2 + size_t(c) * 1024, 1024,
                                 bar);
          } else {
            const int t = q - 2 - tiles;
            const size_t row0 = size_t(n_base + 16 * t);
            dsv4_cuda::bulk_load(xs + Cfg::kXStage + Cfg::kWStage + t * 128, p.s + row0 * kp16 + size_t(c) * 128,
                                 128, bar);
          }
        }
      }
    }
    if constexpr (CLUSTER) store_tile_cluster_barriers();  // the consumers' epilogue syncs the cluster twice
    return;
  }
  set_max_registers<true, kOcc == 1 ? 224 : 104>();
  const int r0 = warp * 16 + g;
  float acc[Cfg::kAcc];
#pragma unroll
  for (int i = 0; i < Cfg::kAcc; ++i) acc[i] = 0.f;
  for (int i = 0; i < n_local; ++i) {
    const int st = i % S;
    dsv4_cuda::mbar_wait(full0 + 8 * st, uint32_t(i / S) & 1u);
    wgmma_chunk<TM, TN>(sm.p + st * Cfg::kStageBytes, sm.s + uint32_t(st * Cfg::kStageBytes), r0, tq, acc);
    if (i > 0) {  // chunk i - 1's wgmmas retired (wgmma_chunk): its stage is free
      __syncwarp();
      if (lane == 0) dsv4_cuda::mbar_arrive(empty0 + 8 * ((i - 1) % S));
    }
  }
  wgmma_wait<0>();
  fence_operands(acc);
  consumers_sync();  // every consumer's wgmmas are done (and every copy landed): the ring takes the staging
  float* cs = reinterpret_cast<float*>(sm.p);
  stage_tile<TM, TN>(cs, acc, r0, tq);
  store_tile<TM, CLUSTER, TN, true>(p, cs, m_base, n_base);
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

template <int TM, int TN>
cudaError_t run_wgmma_tma(const TiledParams& p, int sms, cudaStream_t stream) {
  using Cfg = WgCfg<TM, TN>;
  // Fewer CTAs per SM than the cp.async kernel's plan (below) fills: a second wave. That tile stays on cp.async.
  if constexpr (tma_occ<TM, TN>() < Cfg::kOcc) return cudaErrorNotSupported;
  CUtensorMap xmap;
  if (!dsv4_cuda::encode_bf16_rows(&xmap, p.x, p.M, p.K, p.ldx, 64, TM)) return cudaErrorNotSupported;
  for (const auto kernel : {nvfp4_wgmma_tma_kernel<TM, TN, false>, nvfp4_wgmma_tma_kernel<TM, TN, true>}) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
    if (err != cudaSuccess) return err;
  }
  // (the split plan below queries the cp.async kernel's clusters: their shared memory too)
  const cudaError_t err = cudaFuncSetAttribute(nvfp4_wgmma_kernel<TM, TN, true>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
  if (err != cudaSuccess) return err;
  const int nchunks = (p.K + 127) / 128;
  const unsigned nt = unsigned((p.N + TN - 1) / TN), mt = unsigned((p.M + TM - 1) / TM);
  int splits = 1, per = nchunks;
  // the cp.async kernel's plan (its clusters' occupancy): the same K split, so the same sums in the same order
  plan_split<nvfp4_wgmma_kernel<TM, TN, true>, Cfg::kSmem>(int64_t(nt) * mt, nchunks, sms * Cfg::kOcc, stream,
                                                             splits, per);
  if (splits == 1) {
    nvfp4_wgmma_tma_kernel<TM, TN, false><<<dim3(nt, mt, 1), kTmaThreads, Cfg::kSmem, stream>>>(xmap, p, per);
    return cudaGetLastError();
  }
  ClusterLaunch l(dim3(nt, mt, unsigned(splits)), Cfg::kSmem, stream);
  l.cfg.blockDim = dim3(kTmaThreads);
  return cudaLaunchKernelEx(&l.cfg, nvfp4_wgmma_tma_kernel<TM, TN, true>, xmap, p, per);
}

template <int MODE, int TM, int TN>
cudaError_t run_moe_wgmma(const SkinnyParams& p, dim3 grid, cudaStream_t stream) {
  const auto kernel = nvfp4_moe_wgmma_kernel<MODE, TM, TN>;
  constexpr int smem = WgCfg<TM, TN>::kSmem;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  return launch_ex(p.pdl != 0, kernel, grid, dim3(kThreads), size_t(smem), stream, p);
}

// run(TM, TN) (std::integral_constant arguments) for the dense kernels' tile of M tokens: 16-128 tokens x 128
// features, or the wide tile's 32-128 x 256.
template <int V>
using Int = std::integral_constant<int, V>;
template <typename Run>
cudaError_t by_dense_tile(int64_t M, bool wide, Run&& run) {
  const int tm = wgmma_tile_tokens(M);
  if (wide)
    return tm <= 32 ? run(Int<32>{}, Int<256>{}) : tm == 64 ? run(Int<64>{}, Int<256>{}) : run(Int<128>{}, Int<256>{});
  switch (tm) {
    case 16: return run(Int<16>{}, Int<kTileN>{});
    case 32: return run(Int<32>{}, Int<kTileN>{});
    case 64: return run(Int<64>{}, Int<kTileN>{});
    default: return run(Int<128>{}, Int<kTileN>{});
  }
}

}  // namespace

namespace dsv4_nvfp4 {

int wgmma_tile_tokens(int64_t tokens) { return tokens <= 16 ? 16 : tokens <= 32 ? 32 : tokens <= 64 ? 64 : 128; }

cudaError_t launch_wgmma(const TiledParams& p, bool wide, int sms, cudaStream_t stream) {
  return by_dense_tile(p.M, wide, [&](auto tm, auto tn) { return run_wgmma<tm(), tn()>(p, sms, stream); });
}

cudaError_t launch_wgmma_tma(const TiledParams& p, bool wide, int sms, cudaStream_t stream) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(p.w) | reinterpret_cast<uintptr_t>(p.s)) & 15) == 0;
  if (p.G != 1 || p.N % 16 != 0 || !aligned) return cudaErrorNotSupported;
  return by_dense_tile(p.M, wide, [&](auto tm, auto tn) { return run_wgmma_tma<tm(), tn()>(p, sms, stream); });
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
