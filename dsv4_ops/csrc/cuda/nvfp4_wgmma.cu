// The wgmma NVFP4 kernel (one dense matrix at 8 < M; opt-in for now: the nvfp4_gemm_kernel override "wgmma",
// nvfp4_gemm.cu's file comment) and its launcher. The tiled kernel's CTA (nvfp4_tile.cuh: 128 features x TM tokens
// over a range of K, the cluster K split, the epilogue) and its cp.async ring of packed weights + scales +
// activations, with the mma.sync loop replaced by Hopper's warpgroup MMA: each of the two warpgroups decodes its
// 64 features' weights into registers as the A operand (wgmma's m64k16 register fragment is, warp by warp,
// mma.sync's m16k16 one) and multiplies them with all TM tokens in one wgmma.m64nTMk16 per k-step; the tensor cores
// read B from the activation tile in shared memory (K-major, 128-byte swizzle: two 64-k atoms per 128-k chunk).
// One wgmma replaces TM / 8 mma.sync per warp and the B fragments' ldmatrix: the tiled kernel was bound by mma
// issue at M = 64 (bench/RESULTS.md, session 24). The wgmmas of chunk i run while chunk i + 1 is decoded; the
// ring keeps a stage for the chunk in flight.
#include "nvfp4_tile.cuh"

namespace {

constexpr int kWgStages = 4;  // chunk i in the tensor cores, i + 1 decoded, i + 2 .. i + 3 loading

template <int TM>
struct WgCfg {
  static constexpr int kXStage = TM * 256;     // bf16 activations: 2 atoms of TM rows x 64 k (128 B), swizzled
  static constexpr int kWStage = kTileN * 64;  // packed weights, 128 rows x one chunk
  static constexpr int kSStage = kTileN * 8;   // scale bytes
  static constexpr int kStageBytes = kXStage + kWStage + kSStage;
  static constexpr int kSmem = kStageBytes * kWgStages + 1024;  // + the slack that aligns the ring to 1 KB
  static constexpr int kOcc = TM >= 128 ? 1 : 2;                // CTAs per SM the launch bounds allow
  static constexpr int kXLoads = TM * 16 / kThreads;            // 16-byte activation pieces per thread per stage
  static constexpr int kAcc = TM / 2;                           // fp32 accumulators per thread
  static_assert(kStageBytes % 1024 == 0, "every stage's atoms start 1 KB aligned (the swizzle's period)");
  static_assert(kXLoads >= 1, "tile shape");
  static_assert(TM * kOutStride * 4 <= kStageBytes * kWgStages, "epilogue staging must fit in the ring");
};

template <int N>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);

// d[64 x N] += a (registers: this warp's 16 rows x 16 k) * B (shared memory, descriptor desc: N rows x 16 k).
template <>
__device__ __forceinline__ void wgmma_bf16<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7"
      "}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wgmma_bf16<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wgmma_bf16<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
__device__ __forceinline__ void wgmma_bf16<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The accumulators are written by the tensor cores behind the compiler's back: pin them after a wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// cp.async writes are the generic proxy's; wgmma reads shared memory through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Shared-memory matrix descriptor of a K-major operand in 128-byte swizzle atoms (8 rows x 128 B, 1 KB aligned;
// consecutive 8-row groups 1 KB apart): start address >> 4, leading offset 1 (unused in this mode), stride 1024 B.
__device__ __forceinline__ uint64_t b_desc(uint32_t saddr) {
  return uint64_t((saddr & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// blockIdx = (feature tile, token tile, K split); `per` chunks of 128 K per split. CLUSTER: gridDim.z > 1 CTAs of
// a tile form one cluster along z.
template <int TM, bool CLUSTER>
__global__ void __launch_bounds__(kThreads, WgCfg<TM>::kOcc) nvfp4_wgmma_kernel(const TiledParams p, int per) {
  using Cfg = WgCfg<TM>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const uint32_t smem_s = (raw + 1023u) & ~1023u;  // its shared-window address
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int n_base = blockIdx.x * kTileN, m_base = blockIdx.y * TM;
  const int kp = (p.K + 127) & ~127, nchunks = kp >> 7;
  const int c_begin = min(int(blockIdx.z) * per, nchunks), n_local = min(c_begin + per, nchunks) - c_begin;

  // This thread's copies of a stage: running sources, one chunk further after each stage issued. Activation
  // piece (token r, 16-byte piece ch of the chunk's 256 B) goes to atom ch >> 3, row r, piece (ch & 7) ^ (r & 7).
  const bf16* x_src[Cfg::kXLoads];
  uint32_t x_dst[Cfg::kXLoads];
  bool x_row_ok[Cfg::kXLoads];
  const int x_k = (tid & 15) * 8;  // the k of this thread's activation pieces inside a chunk
#pragma unroll
  for (int i = 0; i < Cfg::kXLoads; ++i) {
    const int r = (tid + i * kThreads) >> 4, ch = tid & 15;
    x_row_ok[i] = m_base + r < p.M;
    x_src[i] = p.x + size_t(min(m_base + r, p.M - 1)) * p.K + size_t(c_begin) * 128 + x_k;
    x_dst[i] = uint32_t((ch >> 3) * (TM * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
  }
  const uint8_t* w_src[2];
  bool w_ok[2];
  uint32_t w_step[2];  // 1024 in a full 16-row tile, 64 in a row-major N % 16 tail
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int id = tid + i * kThreads, r = id >> 2, part = id & 3, n = n_base + r;
    const RowAddr a = row_addr(min(n, p.N - 1), p.N, kp);
    w_src[i] = p.w + a.w + size_t(c_begin) * a.wstep + part * 16;
    w_ok[i] = n < p.N;
    w_step[i] = a.wstep;
  }
  const RowAddr sa_row = row_addr(min(n_base + (tid & 127), p.N - 1), p.N, kp);
  const uint8_t* s_src = p.s + sa_row.s + size_t(c_begin) * sa_row.sstep;
  const bool s_ok = tid < kTileN && n_base + tid < p.N;
  int k_next = c_begin * 128 + x_k;  // k of this thread's pieces in the next stage issued

  // Padding past K needs no guard: activations past K load as zeros (and padded codes are 0).
  auto load_stage = [&](uint8_t* xs) {
    uint8_t* ws = xs + Cfg::kXStage;
    uint8_t* ss = ws + Cfg::kWStage;
    const bool k_ok = k_next < p.K;
#pragma unroll
    for (int i = 0; i < Cfg::kXLoads; ++i) {
      const bool ok = x_row_ok[i] && k_ok;
      cp_async16(xs + x_dst[i], ok ? x_src[i] : p.x, ok ? 16 : 0);
      x_src[i] += 128;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      cp_async16(ws + (tid + i * kThreads) * 16, w_src[i], w_ok[i] ? 16 : 0);
      w_src[i] += w_step[i];
    }
    if (tid < kTileN) cp_async8(ss + tid * 8, s_src, s_ok ? 8 : 0);
    s_src += sa_row.sstep;
    k_next += 128;
  };

  // This warp's 16 rows (g, g + 8) of the tile: warpgroup warp >> 2 holds rows 64 (warp >> 2) .. + 63.
  const int r0 = warp * 16 + g;
  const uint32_t w_ld = uint32_t(Cfg::kXStage + r0 * 64 + tq * 16);
  const uint32_t s_ld = uint32_t(Cfg::kXStage + Cfg::kWStage + r0 * 8);

  float acc[Cfg::kAcc];
#pragma unroll
  for (int i = 0; i < Cfg::kAcc; ++i) acc[i] = 0.f;

  // Decode the chunk in stage `st` (all 8 k-steps' A fragments) and issue its 8 wgmmas as one group.
  auto compute = [&](int st) {
    const uint8_t* xs = smem + st * Cfg::kStageBytes;
    const uint32_t xs_s = smem_s + uint32_t(st * Cfg::kStageBytes);
    const uint4 wa = *reinterpret_cast<const uint4*>(xs + w_ld);
    const uint4 wb = *reinterpret_cast<const uint4*>(xs + w_ld + 8 * 64);
    const RowScales sa = row_scales(*reinterpret_cast<const uint2*>(xs + s_ld));
    const RowScales sb = row_scales(*reinterpret_cast<const uint2*>(xs + s_ld + 8 * 8));
    uint32_t a[8][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t ra[4], rb[4];
      decode_word(j == 0 ? wa.x : j == 1 ? wa.y : j == 2 ? wa.z : wa.w, ra);
      decode_word(j == 0 ? wb.x : j == 1 ? wb.y : j == 2 ? wb.z : wb.w, rb);
      a_fragment_rs(ra, rb, sa, sb, 2 * j, a[2 * j]);
      a_fragment_rs(ra, rb, sa, sb, 2 * j + 1, a[2 * j + 1]);
    }
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 8; ++s)
      wgmma_bf16<TM>(acc, a[s], b_desc(xs_s + uint32_t((s >> 2) * (TM * 128) + (s & 3) * 32)));
    wgmma_commit();
  };

  constexpr int S = kWgStages;
#pragma unroll
  for (int st = 0; st < S - 2; ++st) {
    if (st < n_local) load_stage(smem + st * Cfg::kStageBytes);
    cp_async_commit();
  }
  for (int i = 0; i < n_local; ++i) {
    __syncthreads();  // every warpgroup is past the wait below for chunk i - 2: its stage is free
    if (i + S - 2 < n_local) load_stage(smem + ((i + S - 2) % S) * Cfg::kStageBytes);
    cp_async_commit();
    cp_async_wait<S - 2>();  // this thread's pieces of chunk i landed
    fence_proxy_async();
    __syncthreads();  // and every thread's
    compute(i % S);
    wgmma_wait<1>();  // chunk i - 1's wgmmas are done (their stage may be refilled next trip)
  }
  wgmma_wait<0>();
  fence_operands(acc);
  cp_async_wait<0>();
  __syncthreads();  // no wgmma reads the ring any more: it becomes the epilogue's staging

  // The CTA's (partial) tile, unscaled: cs[token][feature]. Accumulator 4i + e: row g + 8 (e >> 1), token
  // 8i + 2 tq + (e & 1) (wgmma's D fragment: mma.sync's per n8 block).
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < TM / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) cs[(8 * i + 2 * tq + (e & 1)) * kOutStride + r0 + 8 * (e >> 1)] = acc[4 * i + e];
  store_tile<TM, CLUSTER>(p, cs, m_base, n_base);
}

template <int TM>
cudaError_t run_wgmma(const TiledParams& p, int sms, cudaStream_t stream) {
  using Cfg = WgCfg<TM>;
  for (const auto kernel : {nvfp4_wgmma_kernel<TM, false>, nvfp4_wgmma_kernel<TM, true>}) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
    if (err != cudaSuccess) return err;
  }
  const int nchunks = (p.K + 127) / 128;
  const unsigned nt = unsigned((p.N + kTileN - 1) / kTileN), mt = unsigned((p.M + TM - 1) / TM);
  int splits = 1, per = nchunks;
  plan_split<nvfp4_wgmma_kernel<TM, true>, Cfg::kSmem>(int64_t(nt) * mt, nchunks, sms * Cfg::kOcc, stream, splits,
                                                         per);
  if (splits == 1) {
    nvfp4_wgmma_kernel<TM, false><<<dim3(nt, mt, 1), kThreads, Cfg::kSmem, stream>>>(p, per);
    return cudaGetLastError();
  }
  const ClusterLaunch l(dim3(nt, mt, unsigned(splits)), Cfg::kSmem, stream);
  return cudaLaunchKernelEx(&l.cfg, nvfp4_wgmma_kernel<TM, true>, p, per);
}

}  // namespace

namespace dsv4_nvfp4 {

cudaError_t launch_wgmma(const TiledParams& p, int sms, cudaStream_t stream) {
  if (p.M <= 16) return run_wgmma<16>(p, sms, stream);
  if (p.M <= 32) return run_wgmma<32>(p, sms, stream);
  if (p.M <= 64) return run_wgmma<64>(p, sms, stream);
  return run_wgmma<128>(p, sms, stream);
}

}  // namespace dsv4_nvfp4
