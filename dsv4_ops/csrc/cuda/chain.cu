// The NVFP4 linear chain (dsv4::nvfp4_linear_chain): up to kChainMaxStages dependent decode linears (M <= 8 rows;
// the attention's wo_a -> wo_b) in one persistent launch, the first step of the resident decode kernel (issue #30,
// docs/decode-layer.md).
//
// Tasks: every CTA of the per-op gemv launches of the stages (nvfp4_gemv.cu), numbered stage by stage, each
// with the gemv's own plan (plan_gemv: K-splits per tile, tiles per CTA), ring, reduction and epilogue, so the
// chain returns the per-op path's bits. The grid is what fits on the GPU at once; CTA b takes tasks b, b + grid,
// ... in order, and a task waits only on lower-numbered ones, so the lowest unfinished task can always run.
// Dependencies are per 128-column chunk of a stage's output: a finished task adds one per 16-column tile to its
// chunks' counters (release), a warp of the next stage waits (acquire) for the 8 tiles of each input chunk just
// before copying it, and copies its first weight chunks before any wait: the next matrix streams while the
// previous one finishes, with no launch, ramp or tail in between. The last CTA to leave zeroes the counters, so
// the op's sync buffer is zero again for the next launch.
#include "chain.h"
#include "device_info.h"
#include "kernel_limits.h"
#include "nvfp4_gemv_ring.cuh"

namespace {

// The gemv kernel's ring at 2 CTAs per SM (its GemvCfg<ROWS, 2>): the stage count changes no value.
template <int ROWS>
using ChainCfg = GemvRing<ROWS, ROWS <= 2 ? 6 : 3>;
constexpr int kChainOcc = 2;
constexpr int kSyncHead = 1;  // sync[0]: CTAs done; then the chunk counters

struct ChainStage {
  const bf16* x;       // input: row pos, group grp at x + (pos * G + grp) * K
  bf16* y;             // output [M, G, N]
  const uint8_t* w;    // [G, N, Kp/2]
  const uint8_t* s;    // [G, N, Kp/16]
  const float* gs;     // [G]
  const int* ready;    // counters of the input's 128-column chunks (nullptr: the op's input)
  int* done;           // counters of the output's chunks (nullptr: the last stage)
  int G, N, K, kw, rt, gx, task0;
};

struct ChainParams {
  ChainStage st[kChainMaxStages];
  int nstages, ntasks, M, nsync;
  int* sync;
  int pdl;
};

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One task: CTA (bx, grp) of stage st's gemv launch.
template <int ROWS>
__device__ __forceinline__ void chain_task(const ChainParams& p, const ChainStage& st, int local, uint8_t* smem,
                                           float (&red)[kWarps][4][32]) {
  using Cfg = ChainCfg<ROWS>;
  constexpr int S = Cfg::kStages;
  const int grp = local / st.gx, bx = local % st.gx;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int kw = warp % st.kw, rt = warp / st.kw;
  const int ntiles = (st.N + 15) >> 4;
  const int tile0 = bx * st.rt;
  const bool tile_ok = tile0 + rt < ntiles;
  const int tile = tile_ok ? tile0 + rt : ntiles - 1;
  const int kp = (st.K + 127) & ~127, nchunks = kp >> 7;
  const int per = (nchunks + st.kw - 1) / st.kw;
  const int c_begin = min(kw * per, nchunks), c_end = min(c_begin + per, nchunks);
  const uint8_t* mw = st.w + size_t(grp) * size_t(st.N) * size_t(kp / 2);
  const uint8_t* ms = st.s + size_t(grp) * size_t(st.N) * size_t(kp / 16);
  const RowAddr ra = row_addr(min(tile * 16 + g, st.N - 1), st.N, kp);
  const uint8_t* wa_ptr = mw + ra.w + tq * 16;
  const uint8_t* wb_ptr = mw + row_addr(min(tile * 16 + g + 8, st.N - 1), st.N, kp).w + tq * 16;
  const uint8_t* s_ptr = ms + row_addr(min(tile * 16 + (lane & 15), st.N - 1), st.N, kp).s;
  const uint32_t wstep = ra.wstep, sstep = ra.sstep;
  uint8_t* ring = smem + warp * (Cfg::kStage * S);
  const int rows = min(ROWS, p.M);
  const int pc = lane & 15;
  const RingLane<ROWS> rl = ring_lane<ROWS>(lane);
  const bf16* xrow[ROWS / 2];
#pragma unroll
  for (int i = 0; i < ROWS / 2; ++i)
    xrow[i] = st.x + (size_t(min((lane >> 4) + 2 * i, rows - 1)) * size_t(st.G) + size_t(grp)) * size_t(st.K);
  // The input chunk of chunk ci of this group: K % 128 == 0 past stage 0, so 8 full tiles of the previous stage.
  const int ready0 = grp * (kp >> 7);
  auto issue_w = [&](int ci, uint8_t* stg) {
    if (ci < c_end) ring_copy_weights(stg, lane, wa_ptr, wb_ptr, s_ptr, uint32_t(ci), wstep, sstep);
  };
  auto issue_x = [&](int ci, uint8_t* stg) {
    if (ci < c_end) {
      if (st.ready != nullptr) {
        const int* c = st.ready + ready0 + ci;
        for (unsigned ns = 64; ld_acquire(c) < 8; ns = min(2 * ns, 1024u)) __nanosleep(ns);
      }
      const int kx = ci * 128 + pc * 8;
#pragma unroll
      for (int i = 0; i < ROWS / 2; ++i) {
        const bool ok = (lane >> 4) + 2 * i < rows && kx < st.K;
        cp_async16(stg + rl.x_dst[i], ok ? xrow[i] + kx : xrow[0], ok ? 16 : 0);
      }
    }
  };
  // The weights of the first S - 1 chunks go out before any wait (S - 1 groups), then their activations (S - 1
  // more): at chunk c the S - 1 newest groups are all younger than chunk c's, so the gemv's wait_group S - 1 holds.
#pragma unroll
  for (int j = 0; j < S - 1; ++j) {
    issue_w(c_begin + j, ring + j * Cfg::kStage);
    cp_async_commit();
  }
#pragma unroll
  for (int j = 0; j < S - 1; ++j) {
    issue_x(c_begin + j, ring + j * Cfg::kStage);
    cp_async_commit();
  }
  float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c0 = c_begin; c0 < c_end; c0 += S) {
#pragma unroll
    for (int j = 0; j < S; ++j) {
      const int c = c0 + j;
      if (c >= c_end) break;
      uint8_t* next = ring + ((j + S - 1) % S) * Cfg::kStage;
      issue_w(c + S - 1, next);
      issue_x(c + S - 1, next);
      cp_async_commit();
      cp_async_wait<S - 1>();
      __syncwarp();
      ring_chunk_mma(ring + j * Cfg::kStage, lane, rl.ldm, acc0, acc1);
      __syncwarp();
    }
  }
  cp_async_wait<0>();
  __syncwarp();
  float acc[1][4];
  reduce_k_splits(acc0, acc1, acc[0], red, warp, kw, st.kw, lane);
  if (kw == 0 && tile_ok) {
    // the gemv's epilogue, as a one-group dense launch of this group's matrix sees it
    SkinnyParams ep{};
    ep.G = st.G;
    ep.out_kind = 0;
    Task t{};
    t.grp = grp;
    t.N = st.N;
    t.cnt = p.M;
    t.y = st.y;
    t.alpha = __ldg(st.gs + grp) * kUnbias;
    skinny_epilogue<kDense, 1>(ep, t, acc, tile, 0, g, tq, ROWS);
  }
  __syncthreads();  // every store of the task (and every read of `red`) is done
  if (st.done != nullptr && int(threadIdx.x) < st.rt && tile0 + int(threadIdx.x) < ntiles) {
    add_release(st.done + (grp * st.N + (tile0 + int(threadIdx.x)) * 16) / 128, 1);
  }
}

template <int ROWS>
__global__ void __launch_bounds__(kThreads, kChainOcc) nvfp4_chain_kernel(const ChainParams p) {
  extern __shared__ __align__(128) uint8_t csmem[];
  __shared__ float red[kWarps][4][32];
  if (p.pdl) grid_dep_wait();  // the input, and the counters a previous chain zeroed
  // Tasks round-robin, each CTA's in increasing order: the lowest unfinished task waits on finished ones only,
  // and its CTA is at it, since the grid fits on the GPU at once (launch_chain): no task waits forever.
  for (int t = int(blockIdx.x); t < p.ntasks; t += int(gridDim.x)) {
    int i = 0;
    while (i + 1 < p.nstages && t >= p.st[i + 1].task0) ++i;
    chain_task<ROWS>(p, p.st[i], t - p.st[i].task0, csmem, red);
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(p.sync, 1) == int(gridDim.x) - 1) {  // every other CTA is done with its tasks
      __threadfence();  // ... and its counter updates: the zeros come after all of them
      for (int i = 1; i < p.nsync; ++i) p.sync[i] = 0;
      p.sync[0] = 0;
    }
  }
}

template <int ROWS>
cudaError_t launch_chain(const ChainParams& p, cudaStream_t stream) {
  auto kernel = nvfp4_chain_kernel<ROWS>;
  static bool smem_set[64] = {};  // per device, before the first launch (never in capture)
  int dev = 0;
  cudaGetDevice(&dev);
  if (!smem_set[dev & 63]) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ChainCfg<ROWS>::kSmem);
    if (err != cudaSuccess) return err;
    smem_set[dev & 63] = true;
  }
  static int fits[64] = {};  // CTAs per SM at once, per device (the occupancy calculator, host-side)
  if (fits[dev & 63] == 0) {
    int n = 0;
    const cudaError_t err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, ChainCfg<ROWS>::kSmem);
    if (err != cudaSuccess) return err;
    if (n < 1) return cudaErrorInvalidConfiguration;
    fits[dev & 63] = n < kChainOcc ? n : kChainOcc;
  }
  const int grid = min(p.ntasks, fits[dev & 63] * dsv4_cuda::sm_count());
  return launch_ex(p.pdl != 0, kernel, dim3(unsigned(grid)), dim3(kThreads), size_t(ChainCfg<ROWS>::kSmem), stream,
                   p);
}

}  // namespace

extern "C" cudaError_t dsv4_nvfp4_chain_launch(const Nvfp4ChainArgs* a, cudaStream_t stream) {
  if (a->nstages < 1 || a->nstages > kChainMaxStages || a->M < 1 || a->M > dsv4_limits::kChainMaxRows) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(a->x) % 16 != 0) return cudaErrorInvalidValue;
  ChainParams p{};
  p.nstages = a->nstages;
  p.M = int(a->M);
  p.sync = a->sync;
  p.pdl = a->pdl;
  const int rows = a->M <= 2 ? 2 : 8;
  int task0 = 0, sync_at = kSyncHead;
  for (int i = 0; i < a->nstages; ++i) {
    ChainStage& st = p.st[i];
    st.x = reinterpret_cast<const bf16*>(i == 0 ? a->x : a->y[i - 1]);
    st.y = reinterpret_cast<bf16*>(a->y[i]);
    st.w = a->w[i];
    st.s = a->s[i];
    st.gs = a->gs[i];
    st.G = int(a->G[i]);
    st.N = int(a->N[i]);
    st.K = int(a->K[i]);
    if (i > 0 && (st.K % 128 != 0 || a->N[i - 1] % 16 != 0 || a->G[i - 1] * a->N[i - 1] != a->G[i] * a->K[i]))
      return cudaErrorInvalidValue;
    const int64_t ntiles = (st.N + 15) / 16, nchunks = (st.K + 127) / 128;
    int occ = 2;
    plan_gemv(rows, ntiles, nchunks, st.G, st.kw, st.rt, occ);  // the per-op launch's split: its bits
    st.gx = int((ntiles + st.rt - 1) / st.rt);
    st.task0 = task0;
    task0 += st.gx * st.G;
    if (i > 0) {
      st.ready = p.st[i - 1].done;
    }
    if (i + 1 < a->nstages) {
      st.done = a->sync + sync_at;
      sync_at += int(a->G[i] * a->N[i] / 128);
    }
  }
  p.ntasks = task0;
  p.nsync = sync_at;
  if (p.ntasks == 0) return cudaSuccess;
  return rows == 2 ? launch_chain<2>(p, stream) : launch_chain<8>(p, stream);
}
