// The tiled NVFP4 kernel (dense 8 < M < 32 by default; nvfp4_gemm.cu's file comment) and its launcher.
// A CTA owns 128 features x TM tokens (TM = 16, 32, 64 or 128 by M: no token tile is mostly padding) over a
// range of K, through a cp.async pipeline of packed weights + scales + swizzled activations; weights are decoded
// to bf16 in registers for mma.sync. Up to TM = 64 each of the 8 warps owns 16 features x all TM tokens, so every
// weight is decoded once per CTA (decode, not bandwidth, bounds small M); at TM = 128 warps are 4 along features
// (32 each) x 2 along tokens, which halves the activation reads from shared memory where the mma count is large.
// Split K: where the feature x token tiles alone would leave SMs idle (N = 4096 at M = 64 is 32 tiles for 132
// SMs), the S CTAs of one tile split K and form a thread-block cluster; each stages its fp32 partial tile in its
// shared memory and then sums 1/S of the tile over all S partials through distributed shared memory, in rank
// order (deterministic), and stores it. No workspace, no second launch.
#include "nvfp4_tile.cuh"

namespace {

template <int TM>
struct TiledCfg {
  static constexpr int kStages = TM >= 128 ? 3 : 4;
  static constexpr int kXStage = TM * 128 * 2;  // bf16 activations, TM tokens x 128 k, swizzled 16-byte pieces
  static constexpr int kWStage = kTileN * 64;   // packed weights, 128 rows x one chunk
  static constexpr int kSStage = kTileN * 8;    // scale bytes
  static constexpr int kStageBytes = kXStage + kWStage + kSStage;
  static constexpr int kSmem = kStageBytes * kStages;
  static constexpr int kOcc = TM >= 128 ? 1 : 2;  // CTAs per SM the launch bounds allow
  static constexpr int kWm = TM >= 128 ? 2 : 1;   // warps along tokens
  static constexpr int kWn = 8 / kWm;             // warps along features
  static constexpr int kT = kTileN / 16 / kWn;    // 16-row mma tiles per warp
  static constexpr int kTokPerWarp = TM / kWm;
  static constexpr int kNt = kTokPerWarp / 8;  // n8 token tiles per warp
  static constexpr int kXLoads = TM * 16 / kThreads;  // 16-byte activation pieces per thread per stage
  static_assert(TM * kOutStride * 4 <= kSmem, "epilogue staging must fit in the pipeline smem");
  static_assert(kTokPerWarp % 16 == 0, "a warp's tokens come in ldmatrix.x4 groups of 16");
  static_assert(kXLoads >= 1 && kWn * kT * 16 == kTileN, "tile shape");
};

// blockIdx = (feature tile, token tile, K split); `per` chunks of 128 K per split. CLUSTER: gridDim.z > 1 CTAs of
// a tile form one cluster along z.
template <int TM, bool CLUSTER>
__global__ void __launch_bounds__(kThreads, TiledCfg<TM>::kOcc) nvfp4_tiled_kernel(const TiledParams p, int per) {
  using Cfg = TiledCfg<TM>;
  constexpr int T = Cfg::kT;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int wn = warp % Cfg::kWn, wm = warp / Cfg::kWn;
  const int n_base = blockIdx.x * kTileN, m_base = blockIdx.y * TM;
  const int kp = (p.K + 127) & ~127, nchunks = kp >> 7;
  const int c_begin = min(int(blockIdx.z) * per, nchunks), n_local = min(c_begin + per, nchunks) - c_begin;

  // This thread's copies of a stage (activation pieces XOR-swizzled by row for ldmatrix).
  StageCopies<Cfg::kXLoads> copies(
      p, m_base, n_base, c_begin, [](int r, int ch) { return uint32_t(r * 256 + ((ch ^ (r & 7)) << 4)); });
  auto load_stage = [&](uint8_t* xs) { copies.issue(xs, Cfg::kXStage, Cfg::kWStage, p.K, p.x); };

  // ldmatrix source of token tile pair np, k-step s: tok * 256 + (((2s + h) ^ (tok & 7)) << 4) with
  // tok = tok0 + 16 np (tok & 7 = lane & 7) and h = (lane >> 3) & 1, i.e. x_ld + np * 4096 + ((s << 5) ^ x_sw).
  const int tok0 = wm * Cfg::kTokPerWarp + (lane >> 4) * 8 + (lane & 7);
  const uint32_t x_ld = uint32_t(tok0 * 256), x_sw = uint32_t((((lane >> 3) & 1) ^ (lane & 7)) << 4);
  uint32_t w_ld[T], s_ld[T];  // this lane's weight words / scale bytes of rows g and g + 8 of tile t in a stage
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int r = (wn * T + t) * 16 + g;
    w_ld[t] = uint32_t(Cfg::kXStage + r * 64 + tq * 16);
    s_ld[t] = uint32_t(Cfg::kXStage + Cfg::kWStage + r * 8);
  }

  float acc[T][Cfg::kNt][4];
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kNt; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  auto compute = [&](const uint8_t* xs) {
    uint4 wa[T], wb[T];
    RowScales sa[T], sb[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
      wa[t] = *reinterpret_cast<const uint4*>(xs + w_ld[t]);
      wb[t] = *reinterpret_cast<const uint4*>(xs + w_ld[t] + 8 * 64);
      sa[t] = row_scales(*reinterpret_cast<const uint2*>(xs + s_ld[t]));
      sb[t] = row_scales(*reinterpret_cast<const uint2*>(xs + s_ld[t] + 8 * 8));
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t ra[T][4], rb[T][4];
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const uint32_t wa_j = j == 0 ? wa[t].x : j == 1 ? wa[t].y : j == 2 ? wa[t].z : wa[t].w;
        const uint32_t wb_j = j == 0 ? wb[t].x : j == 1 ? wb[t].y : j == 2 ? wb[t].z : wb[t].w;
        decode_word(wa_j, ra[t]);
        decode_word(wb_j, rb[t]);
      }
#pragma unroll
      for (int hs = 0; hs < 2; ++hs) {
        const int s = 2 * j + hs;
        uint32_t a[T][4];
#pragma unroll
        for (int t = 0; t < T; ++t) a_fragment_rs(ra[t], rb[t], sa[t], sb[t], s, a[t]);
        const uint8_t* xb = xs + (x_ld + ((uint32_t(s) << 5) ^ x_sw));
#pragma unroll
        for (int np = 0; np < Cfg::kNt / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, xb + np * 4096);
#pragma unroll
          for (int t = 0; t < T; ++t) {
            mma16816(acc[t][2 * np], a[t][0], a[t][1], a[t][2], a[t][3], b[0], b[1]);
            mma16816(acc[t][2 * np + 1], a[t][0], a[t][1], a[t][2], a[t][3], b[2], b[3]);
          }
        }
      }
    }
  };

  constexpr int S = Cfg::kStages;
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < n_local) load_stage(smem + st * Cfg::kStageBytes);
    cp_async_commit();
  }
  // One trip of the outer loop walks the whole ring, so every stage offset is a constant.
  for (int i0 = 0; i0 < n_local; i0 += S) {
#pragma unroll
    for (int j = 0; j < S; ++j) {
      if (i0 + j >= n_local) break;
      cp_async_wait<S - 2>();
      __syncthreads();  // chunk i0 + j landed for every thread; the stage refilled below was consumed last step
      if (i0 + j + S - 1 < n_local) load_stage(smem + ((j + S - 1) % S) * Cfg::kStageBytes);
      cp_async_commit();
      compute(smem + j * Cfg::kStageBytes);
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // The CTA's (partial) tile, unscaled, in shared memory: cs[token][feature].
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int nt = 0; nt < Cfg::kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = (wn * T + t) * 16 + g, tok = wm * Cfg::kTokPerWarp + nt * 8 + 2 * tq + e;
        cs[tok * kOutStride + row] = acc[t][nt][e];
        cs[tok * kOutStride + row + 8] = acc[t][nt][2 + e];
      }
  store_tile<TM, CLUSTER>(p, cs, m_base, n_base);
}

template <int TM>
cudaError_t run_tiled(const TiledParams& p, int sms, cudaStream_t stream) {
  using Cfg = TiledCfg<TM>;
  for (const auto kernel : {nvfp4_tiled_kernel<TM, false>, nvfp4_tiled_kernel<TM, true>}) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
    if (err != cudaSuccess) return err;
  }
  const int nchunks = (p.K + 127) / 128;
  const unsigned nt = unsigned((p.N + kTileN - 1) / kTileN), mt = unsigned((p.M + TM - 1) / TM);
  int splits = 1, per = nchunks;
  plan_split<nvfp4_tiled_kernel<TM, true>, Cfg::kSmem>(int64_t(nt) * mt, nchunks, sms * Cfg::kOcc, stream, splits,
                                                        per);
  if (splits == 1) {
    nvfp4_tiled_kernel<TM, false><<<dim3(nt, mt, 1), kThreads, Cfg::kSmem, stream>>>(p, per);
    return cudaGetLastError();
  }
  const ClusterLaunch l(dim3(nt, mt, unsigned(splits)), Cfg::kSmem, stream);
  return cudaLaunchKernelEx(&l.cfg, nvfp4_tiled_kernel<TM, true>, p, per);
}

}  // namespace

namespace dsv4_nvfp4 {

cudaError_t launch_tiled(const TiledParams& p, int sms, cudaStream_t stream) {
  if (p.M <= 16) return run_tiled<16>(p, sms, stream);
  if (p.M <= 32) return run_tiled<32>(p, sms, stream);
  if (p.M <= 64) return run_tiled<64>(p, sms, stream);
  return run_tiled<128>(p, sms, stream);
}

}  // namespace dsv4_nvfp4
