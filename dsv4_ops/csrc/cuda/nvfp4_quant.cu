// CUDA kernels of the NVFP4 quantization ops (docs/ops.md "## NVFP4 quantization"), sm_90a. No torch
// headers here: launchers take raw pointers and a stream; nvfp4_quant_bindings.cpp checks and allocates.
//
// The element sources and the exact numerics: nvfp4_quant_device.cuh.
//
// fused_amax_quantize (per tensor) is one launch:
//   * one row: the per-row kernel (its one CTA's max is the tensor's).
//   * small tensors: one thread-block cluster (<= 16 CTAs); the CTAs keep their blocks in registers and
//     exchange partial maxima through distributed shared memory.
//   * large tensors: a cooperative persistent grid (SMs x occupancy CTAs, all co-resident). Each CTA keeps
//     its first R tiles in registers, streams the rest once for the max, publishes its max with an atomic
//     max on the float bits, arrives on a grid counter, waits, then quantizes (registers first, then re-reads
//     the remaining tiles newest-first, mostly L2 hits). The last CTA to arrive publishes the max with a new
//     generation number and resets the words the next launch uses (grid_max_arrive_wait), so the launch is
//     self-contained (CUDA-graph replay safe). The scratch is a static __device__ array: two of these kernels
//     must not run concurrently on different streams of one device.
// Every kernel here launches with PDL (pdl.h; the pdl override turns it off) and waits at its top, the fused ones
// before reading the scratch's generation: the launch latency hides under the predecessor's tail
// (bench/RESULTS.md).

#include "nvfp4_quant_device.cuh"

namespace {

// ------------------------------------------------------------------------------------------- kernels

template <class Src>
__global__ void __launch_bounds__(256) quantize_kernel(Src src, int64_t n_qb, const float* __restrict__ gs,
                                                       RowOf row_of, bool per_row, uint2* __restrict__ packed,
                                                       uint8_t* __restrict__ sf, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  const float gs_t = per_row ? 0.0f : __ldg(gs);
  const float ge_t = gs_enc_of(gs_t);
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < n_qb; q += (int64_t)gridDim.x * blockDim.x) {
    typename Src::Raw raw;
    src.template load<Ld::kNormal>(raw, q, 0);
    Block b;
    src.decode(raw, b);
    float g = gs_t, ge = ge_t;
    if (per_row) {
      g = __ldg(gs + row_of(q));
      ge = gs_enc_of(g);
    }
    quant_block(b, block_absmax(b), g, ge, packed + q, sf + q);
  }
}

// One launch: amax over the whole tensor (cluster or cooperative grid, see the file comment), then quantize.
template <class Src, bool kGrid>
__global__ void __launch_bounds__(kThreads, 1)
    fused_amax_kernel(Src src, int64_t n_qb, int tiles_per_cta, RowOf row_of, unsigned int* sync,
                      uint2* __restrict__ packed, uint8_t* __restrict__ sf, float* __restrict__ gs_out, int pdl) {
  dsv4_cuda::grid_dep_wait();  // before the scratch's generation is read too: the previous launch has ended
  if (pdl) dsv4_cuda::grid_dep_launch();
  constexpr int R = kRegBlocks<Src>;
  constexpr int U = kStreamUnroll<Src>;
  __shared__ float red[34];  // [0, 33): cta_max; [33]: the grid-wide result (a separate word: no hazard)
  const int tid = threadIdx.x;
  const int T = blockDim.x;  // a tile is T consecutive blocks, one per thread
  const int64_t n_tiles = (n_qb + T - 1) / T;
  const int64_t tile0 = (int64_t)blockIdx.x * tiles_per_cta;
  const int64_t left = n_tiles - tile0;
  const int nt = left <= 0 ? 0 : (int)(left < tiles_per_cta ? left : tiles_per_cta);
  auto qb = [&](int i) { return (tile0 + i) * T + tid; };
  unsigned int gen = 0;
  if (kGrid && tid == 0) gen = grid_generation(sync);

  typename Src::Raw reg[R];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < R; ++i)
    if (i < nt && qb(i) < n_qb) src.template load<Ld::kEvictFirst>(reg[i], qb(i), row_of(qb(i)));
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (i < nt && qb(i) < n_qb) {
      Block b;
      src.decode(reg[i], b);
      amax = fmaxf(amax, block_absmax(b));
    }
  }
  for (int i = R; i < nt; i += U) {  // tiles that do not fit in registers: max only (re-read below)
    typename Src::Raw t[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u < nt && qb(i + u) < n_qb) src.template load<Ld::kNormal>(t[u], qb(i + u), row_of(qb(i + u)));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i + u < nt && qb(i + u) < n_qb) {
        Block b;
        src.decode(t[u], b);
        amax = fmaxf(amax, block_absmax(b));
      }
    }
  }

  amax = cta_max(amax, red);
  if constexpr (kGrid) {
    if (tid == 0) red[33] = grid_max_arrive_wait(amax, sync, gen);
    __syncthreads();
    amax = red[33];
  } else {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every CTA's red[32] is final
    if (tid < 32) {  // lane r reads CTA r's partial (<= 16): one round of DSMEM loads, then a shuffle max
      float m = tid < (int)cluster.num_blocks() ? *cluster.map_shared_rank(&red[32], tid) : 0.0f;
      m = warp_max(m);
      if (tid == 0) red[33] = m;
    }
    cluster.sync();  // publishes red[33] to the CTA; no CTA leaves while others still read its shared memory
    amax = red[33];
  }

  const float gs = __fdiv_rn(amax, 2688.0f);
  const float ge = gs_enc_of(gs);
  if (blockIdx.x == 0 && tid == 0) *gs_out = gs;

#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (i < nt && qb(i) < n_qb) {
      Block b;
      src.decode(reg[i], b);
      quant_block(b, block_absmax(b), gs, ge, packed + qb(i), sf + qb(i));
    }
  }
  // Newest first: the tiles streamed last are the likeliest to still be in L2.
  for (int i = nt - 1; i >= R; i -= U) {
    typename Src::Raw t[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i - u >= R && qb(i - u) < n_qb) src.template load<Ld::kEvictFirst>(t[u], qb(i - u), row_of(qb(i - u)));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i - u >= R && qb(i - u) < n_qb) {
        Block b;
        src.decode(t[u], b);
        quant_block(b, block_absmax(b), gs, ge, packed + qb(i - u), sf + qb(i - u));
      }
    }
  }
}

// One CTA per row: per-row amax, then quantize. Rows longer than blockDim * R blocks are read twice. R (blocks
// a thread keeps) and the CTA size are picked per row length (launch_per_row): rows up to 256 * R blocks run in
// CTAs of <= 256 threads, several per SM, so many rows' loads are in flight at once.
template <class Src, int R, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads) fused_per_row_kernel(Src src, int64_t qbpr, uint2* __restrict__ packed,
                                                                    uint8_t* __restrict__ sf,
                                                                    float* __restrict__ gs_out, int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  __shared__ float red[33];
  const int64_t row = blockIdx.x;
  const int64_t base = row * qbpr;
  const int T = blockDim.x;
  typename Src::Raw reg[R];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * T;
    if (j < qbpr) src.template load<Ld::kNormal>(reg[i], base + j, row);
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * T;
    if (j < qbpr) {
      Block b;
      src.decode(reg[i], b);
      amax = fmaxf(amax, block_absmax(b));
    }
  }
  for (int64_t j = threadIdx.x + (int64_t)R * T; j < qbpr; j += T) {
    typename Src::Raw t;
    src.template load<Ld::kNormal>(t, base + j, row);
    Block b;
    src.decode(t, b);
    amax = fmaxf(amax, block_absmax(b));
  }
  amax = cta_max(amax, red);
  const float gs = __fdiv_rn(amax, 2688.0f);
  const float ge = gs_enc_of(gs);
  if (threadIdx.x == 0) gs_out[row] = gs;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t j = threadIdx.x + (int64_t)i * T;
    if (j < qbpr) {
      Block b;
      src.decode(reg[i], b);
      quant_block(b, block_absmax(b), gs, ge, packed + base + j, sf + base + j);
    }
  }
  for (int64_t j = threadIdx.x + (int64_t)R * T; j < qbpr; j += T) {
    typename Src::Raw t;
    src.template load<Ld::kNormal>(t, base + j, row);
    Block b;
    src.decode(t, b);
    quant_block(b, block_absmax(b), gs, ge, packed + base + j, sf + base + j);
  }
}

template <typename T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return __float2half_rn(v);
}

template <typename T>
__global__ void __launch_bounds__(256) dequantize_kernel(const uint2* __restrict__ packed,
                                                         const uint8_t* __restrict__ sf, const float* __restrict__ gs,
                                                         RowOf row_of, bool per_row, int64_t n_qb, T* __restrict__ out,
                                                         int pdl) {
  dsv4_cuda::grid_dep_wait();
  if (pdl) dsv4_cuda::grid_dep_launch();
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < n_qb; q += (int64_t)gridDim.x * blockDim.x) {
    const uint2 p = __ldg(packed + q);
    const float g = __ldg(gs + (per_row ? row_of(q) : 0));
    const float d = __fmul_rn(e4m3_to_f32(__ldg(sf + q)), g);
    alignas(16) T v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t c = ((i < 8 ? p.x : p.y) >> (4 * (i & 7))) & 0xFu;
      const uint32_t m = c & 7u;
      const float mag = m < 2 ? 0.5f * (float)m : __uint_as_float((m << 22) + 0x3F000000u);
      const float val = __fmul_rn(mag, d);
      v[i] = from_f32<T>((c & 8u) ? -val : val);
    }
    uint4* o = reinterpret_cast<uint4*>(out + 16 * q);
    const uint4* s = reinterpret_cast<const uint4*>(v);
#pragma unroll
    for (int i = 0; i < (int)(16 * sizeof(T) / 16); ++i) o[i] = s[i];
  }
}

// --------------------------------------------------------------------------------------- launch helpers

struct DeviceInfo {
  int sms = 0;
  unsigned int* sync = nullptr;  // this device's g_grid_sync
};

DeviceInfo& device_info() {
  static DeviceInfo info[64];
  int dev = 0;
  cudaGetDevice(&dev);
  DeviceInfo& d = info[dev & 63];  // (device ids >= 64 are not supported)
  if (d.sms == 0) {
    cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
    void* p = nullptr;
    cudaGetSymbolAddress(&p, g_grid_sync);
    d.sync = reinterpret_cast<unsigned int*>(p);
  }
  return d;
}

int grid_for(int64_t items, int threads, int sms) {
  const int64_t want = (items + threads - 1) / threads;
  return (int)std::max<int64_t>(1, std::min<int64_t>(want, (int64_t)sms * 16));
}

int current_device() {
  int dev = 0;
  cudaGetDevice(&dev);
  return dev & 63;
}

// Largest usable cluster size of this kernel (once per kernel and device; 16 is non-portable).
template <typename Kernel>
int max_cluster_of(Kernel kernel) {
  static int cache[64] = {};
  int& cached = cache[current_device()];
  if (cached) return cached;
  int best = 8;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 16;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(16);
    cfg.blockDim = dim3(kThreads);
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) == cudaSuccess && n > 0) best = 16;
  }
  cudaGetLastError();  // a refused query leaves no sticky error
  cached = best;
  return best;
}

// Co-resident CTAs per SM of a cooperative kernel at a CTA size (once per kernel and size).
template <typename Kernel>
int coop_blocks_per_sm(Kernel kernel, int threads) {
  static int cache[64][kThreads / 32 + 1] = {};
  int& c = cache[current_device()][threads / 32];
  if (!c) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0);
    c = std::max(n, 1);
  }
  return c;
}

// Which single-launch scheme the per-tensor fused ops use. The nvfp4_fused_path override (1 cluster, 2 grid)
// forces one (tests and benchmarks compare them); otherwise a cluster when one block per thread fits in it, else
// the grid.
enum class FusedPath { kAuto, kCluster, kGrid };

FusedPath fused_path_override() {
  const int v = dsv4_overrides::get().nvfp4_fused_path;
  return v == 1 ? FusedPath::kCluster : v == 2 ? FusedPath::kGrid : FusedPath::kAuto;
}

int pow2_ceil(int64_t v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

template <class Src>
cudaError_t launch_fused(const Src& src, int64_t n_qb, int64_t qbpr, uint2* packed, uint8_t* sf, float* gs_out,
                         unsigned int* sync, cudaStream_t stream) {
  constexpr int R = kRegBlocks<Src>;
  const DeviceInfo& dev = device_info();
  const RowOf row_of = make_row_of(qbpr, n_qb);
  const bool pdl = decode_pdl();
  auto cluster_kernel = fused_amax_kernel<Src, false>;
  const int cmax = max_cluster_of(cluster_kernel);
  const FusedPath force = fused_path_override();
  const bool fits_cluster = n_qb <= (int64_t)cmax * kThreads * R;
  const bool use_cluster = fits_cluster && (force == FusedPath::kCluster ||
                                            (force == FusedPath::kAuto && n_qb <= (int64_t)cmax * kThreads));
  if (use_cluster) {
    const int t = (int)std::min<int64_t>(kThreads, (n_qb + 31) / 32 * 32);
    const int64_t n_tiles = (n_qb + t - 1) / t;
    int c = (int)std::min<int64_t>(n_tiles, cmax);
    const int tpc = (int)((n_tiles + c - 1) / c);
    c = pow2_ceil((n_tiles + tpc - 1) / tpc);  // power-of-two clusters; spare CTAs contribute 0 to the max
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = c;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    set_pdl_attribute(attr[1]);
    cfg.gridDim = dim3(c);
    cfg.blockDim = dim3(t);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, cluster_kernel, src, n_qb, tpc, row_of, sync, packed, sf, gs_out, int(pdl));
  }
  // Smaller CTAs for mid sizes, so the work spreads over every SM; never below 256 threads (8 x 7168 ..
  // 128 x 4096: 128-thread CTAs were slower, the grid barrier waiting on twice the arrivals; bench/RESULTS.md).
  const int t = n_qb >= (int64_t)dev.sms * kThreads * 2 ? kThreads : 256;
  auto grid_kernel = fused_amax_kernel<Src, true>;
  const int64_t n_tiles = (n_qb + t - 1) / t;
  const int64_t max_ctas = (int64_t)dev.sms * coop_blocks_per_sm(grid_kernel, t);
  const int tpc = (int)((n_tiles + max_ctas - 1) / max_ctas);
  const int grid = (int)((n_tiles + tpc - 1) / tpc);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  set_pdl_attribute(attr[1]);
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(t);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, grid_kernel, src, n_qb, tpc, row_of, sync, packed, sf, gs_out, int(pdl));
}

template <class Src>
cudaError_t launch_per_row(const Src& src, int64_t rows, int64_t qbpr, uint2* packed, uint8_t* sf, float* gs_out,
                           cudaStream_t stream) {
  // Rows of <= 256 * R blocks: CTAs of <= 256 threads keeping R <= 4 blocks each (one wave of the whole batch
  // holds many rows in flight; at 8192 x 7168 one 448-thread CTA per row and SM left HBM mostly idle:
  // bench/RESULTS.md). Longer rows: 512 threads, kRegBlocks each, the rest streamed twice.
  auto threads = [&](int r) { return (unsigned int)std::max<int64_t>(32, ((qbpr + r - 1) / r + 31) / 32 * 32); };
  const dim3 grid((unsigned int)rows);
  const bool pdl = decode_pdl();
  if (qbpr <= 256)
    return launch_ex(pdl, fused_per_row_kernel<Src, 1, 256>, grid, threads(1), 0, stream, src, qbpr, packed, sf,
                     gs_out, int(pdl));
  if (qbpr <= 512)
    return launch_ex(pdl, fused_per_row_kernel<Src, 2, 256>, grid, threads(2), 0, stream, src, qbpr, packed, sf,
                     gs_out, int(pdl));
  if (qbpr <= 1024 && kRegBlocks<Src> >= 4)
    return launch_ex(pdl, fused_per_row_kernel<Src, 4, 256>, grid, threads(4), 0, stream, src, qbpr, packed, sf,
                     gs_out, int(pdl));
  return launch_ex(pdl, fused_per_row_kernel<Src, kRegBlocks<Src>, kThreads>, grid, kThreads, 0, stream, src, qbpr,
                   packed, sf, gs_out, int(pdl));
}

unsigned int* sync_slot(int i) { return device_info().sync + 8 * i; }

}  // namespace

namespace dsv4::nvfp4 {

cudaError_t launch_quantize(const void* x, DType dt, int64_t rows, int64_t K, const float* gs, bool per_row,
                            uint8_t* packed, uint8_t* sf, cudaStream_t stream) {
  const int64_t qbpr = K / 16, n_qb = rows * qbpr;
  if (n_qb == 0) return cudaSuccess;
  const RowOf row_of = make_row_of(qbpr, n_qb);
  const int grid = grid_for(n_qb, 256, device_info().sms);
  auto* p = reinterpret_cast<uint2*>(packed);
  const bool pdl = decode_pdl();
  auto run = [&](auto src) {
    return launch_ex(pdl, quantize_kernel<decltype(src)>, grid, 256, 0, stream, src, n_qb, gs, row_of, per_row, p,
                     sf, int(pdl));
  };
  switch (dt) {
    case DType::kBF16: return run(Src16<__nv_bfloat16>{(const __nv_bfloat16*)x});
    case DType::kF16: return run(Src16<__half>{(const __half*)x});
    case DType::kF32: return run(SrcF32{(const float*)x});
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_dequantize(const uint8_t* packed, const uint8_t* sf, const float* gs, bool per_row, int64_t rows,
                              int64_t K, void* out, DType dt, cudaStream_t stream) {
  const int64_t qbpr = K / 16, n_qb = rows * qbpr;
  if (n_qb == 0) return cudaSuccess;
  const RowOf row_of = make_row_of(qbpr, n_qb);
  const int grid = grid_for(n_qb, 256, device_info().sms);
  const auto* p = reinterpret_cast<const uint2*>(packed);
  const bool pdl = decode_pdl();
  auto run = [&](auto* o) {
    return launch_ex(pdl, dequantize_kernel<std::remove_pointer_t<decltype(o)>>, grid, 256, 0, stream, p, sf, gs,
                     row_of, per_row, n_qb, o, int(pdl));
  };
  switch (dt) {
    case DType::kBF16: return run((__nv_bfloat16*)out);
    case DType::kF16: return run((__half*)out);
    case DType::kF32: return run((float*)out);
  }
  return cudaErrorInvalidValue;
}

// One row: the per-tensor scale is the row's, and the per-row kernel (one CTA, no grid barrier, no cluster
// launch) computes it: faster at 1 x 4096 (bench/RESULTS.md).
cudaError_t launch_fused_amax_quantize(const void* x, DType dt, int64_t rows, int64_t K, bool per_row,
                                       uint8_t* packed, uint8_t* sf, float* gs_out, cudaStream_t stream) {
  const int64_t qbpr = K / 16, n_qb = rows * qbpr;
  if (n_qb == 0) return cudaSuccess;
  auto* p = reinterpret_cast<uint2*>(packed);
  auto run = [&](auto src) {
    return per_row || rows == 1 ? launch_per_row(src, rows, qbpr, p, sf, gs_out, stream)
                                : launch_fused(src, n_qb, qbpr, p, sf, gs_out, sync_slot(0), stream);
  };
  switch (dt) {
    case DType::kBF16: return run(Src16<__nv_bfloat16>{(const __nv_bfloat16*)x});
    case DType::kF16: return run(Src16<__half>{(const __half*)x});
    case DType::kF32: return run(SrcF32{(const float*)x});
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_fused_deinterleave(const void* gate_up, DType dt, const float* row_weight, float limit,
                                      int64_t rows, int64_t I, bool per_row, uint8_t* packed, uint8_t* sf,
                                      float* gs_out, cudaStream_t stream) {
  const int64_t qbpr = I / 16, n_qb = rows * qbpr;
  if (n_qb == 0) return cudaSuccess;
  auto* p = reinterpret_cast<uint2*>(packed);
  auto run = [&](auto src) {
    return per_row || rows == 1 ? launch_per_row(src, rows, qbpr, p, sf, gs_out, stream)
                                : launch_fused(src, n_qb, qbpr, p, sf, gs_out, sync_slot(1), stream);
  };
  switch (dt) {
    case DType::kBF16:
      return run(SrcDeint<__nv_bfloat16>{(const __nv_bfloat16*)gate_up, row_weight, limit});
    case DType::kF16: return run(SrcDeint<__half>{(const __half*)gate_up, row_weight, limit});
    case DType::kF32: return run(SrcDeint<float>{(const float*)gate_up, row_weight, limit});
  }
  return cudaErrorInvalidValue;
}

}  // namespace dsv4::nvfp4
