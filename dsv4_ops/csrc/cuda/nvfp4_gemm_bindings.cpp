// CUDA registration of dsv4::nvfp4_linear / nvfp4_linear_w4a4 / nvfp4_moe / nvfp4_moe_rows: argument checks
// (shared with the CPU kernels), outputs and workspaces from the caching allocator (graph-pool aware), launch on
// the current stream. The kernels live in nvfp4_gemm.cu and the kernel files it names.
// Kernel choice for y = x W^T (measured on the H200, bench/RESULTS.md "GEMM and head"): M <= 8 tokens -> the gemv
// kernel (cp.async ring); 8 < M < 32 -> the tiled mma kernel (the skinny kernel for grouped launches);
// 32 <= M <= 1024 -> the wgmma kernel (decoded weights as warpgroup-MMA register operand; 1.1-1.7x the tiled one;
// 256-feature tiles past 64 rows where they nearly fill the GPU: auto_wide);
// M > 1024 -> dequantize W to bf16 (exact e2m1 * block scale) + one cublasLt
// bf16 GEMM whose epilogue applies the global scale (alpha read from device memory, so no host sync and CUDA-graph
// safe) and rounds once to the output dtype. The previous form of that path (aten::mm.dtype to an fp32 [M, N]
// product, then one scaling pass) wrote and re-read the fp32 product: far slower than a bf16 matmul for wq_b at
// M = 4096 (bench/RESULTS.md). It stays as the fallback where cublasLt is not built in, offers no algorithm,
// fails, or cannot produce the output dtype (fp16 from bf16 operands); without aten::mm.dtype either, the wgmma
// kernel runs. The MoE projections beyond gemv's reach (prefill) run on the wgmma MoE kernels.
// The nvfp4_gemm_kernel override (overrides.h) forces one path: tiled | wgmma | wgmma_wide (256-row tiles) at every
// M > 8 (and the MoE on wgmma, or on skinny with tiled), cublas at every M > 64; skinny keeps M <= 8
// and MoE decode on the skinny kernel (gemv is faster at M = 1: bench/RESULTS.md); the pdl override off turns off
// programmatic dependent launch (the gemv kernels, the MoE chain).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>
#if defined(DSV4_WITH_CUBLASLT)
#include <ATen/cuda/CUDAContextLight.h>  // getCurrentCUDABlasLtHandle, cublasLt.h
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/device_info.h"
#include "cuda/fp32_linear_cuda.h"
#include "cuda/mm_dtype.h"
#include "cuda/nvfp4_gemm.h"
#include "fp32_linear_checks.h"
#include "nvfp4_gemm_checks.h"
#include "overrides.h"

namespace {

using namespace dsv4_nvfp4;

enum class Choice { kAuto, kTiled, kCublas, kSkinny, kWgmma, kWgmmaWide };

// The nvfp4_gemm_kernel override (overrides.h) forces one kernel path; 0 (auto) picks by shape.
Choice kernel_choice() {
  const int v = dsv4_overrides::get().nvfp4_gemm_kernel;
  return v >= 1 && v <= 5 ? static_cast<Choice>(v) : Choice::kAuto;
}

// wgmma forced: the 128-row tile (kWgmma) or the 256-row one (kWgmmaWide; the MoE's too).
bool forced_wgmma(Choice choice) { return choice == Choice::kWgmma || choice == Choice::kWgmmaWide; }

// The auto rule's wide tile (256 features x 128 tokens): past 64 rows where its tiles alone nearly fill the GPU
// (>= 3/4 of the SMs). Measured on an H100 (bench/RESULTS.md, session 33): wq_b M = 128 / 1024 20.6 -> 17.7 /
// 155.8 -> 132.4 µs, wo_b / w1+w3 / w2 at M = 1024 1.16-1.18x faster; with fewer tiles (wkv, expert w1, M <= 512 of
// the 4096-wide matrices) the 128-row tile's extra CTAs win, and at M <= 64 the wide tile loses everywhere. One
// matrix only: the grouped launch has not been measured with it.
bool auto_wide(int64_t M, int64_t N, int64_t G) {
  const int64_t tiles = (N + 255) / 256 * ((M + 127) / 128);
  return G <= 1 && M > 64 && 4 * tiles >= 3 * int64_t(dsv4_cuda::sm_count());
}
// The Nvfp4LinearArgs::wgmma value of a dense launch on wgmma: 2 for the wide tile (forced, or auto where it wins).
int wgmma_arg(Choice choice, int64_t M, int64_t N, int64_t G) {
  return choice == Choice::kWgmmaWide || (choice == Choice::kAuto && auto_wide(M, N, G)) ? 2 : 1;
}

// The auto rule's bounds for the wgmma kernel (H200, bench/bench_nvfp4_gemm.py, every V4-Flash shape): below
// 32 rows the tiled kernel is as fast (M = 16: within 4%), above 1024 dequantize + cuBLAS is (M = 4096: 1.1-1.4x).
constexpr int64_t kWgmmaMinRows = 32, kWgmmaMaxRows = 1024;
// Whether the auto rule puts one matrix of M rows on the wgmma kernel (where the tile kernels run, below the cuBLAS
// path's rows).
bool auto_wgmma(Choice choice, int64_t M) { return choice == Choice::kAuto && M >= kWgmmaMinRows; }

// Programmatic dependent launch (gemv, the MoE chain) unless the pdl override is off, or gemv_pdl alone (an A/B:
// back to back in a graph the gemv measured 1.4-1.5 us faster per call without it, bench/RESULTS.md session 48).
bool use_pdl() { return dsv4_overrides::get().pdl != 0 && dsv4_overrides::get().gemv_pdl != 0; }
// A call of M token rows (the MoE's T): only below gemv_pdl_rows (8; on an H100 the layer was 4-6% faster at B = 8
// without PDL on these kernels, 3-5% slower at B = 1 / 4: bench/RESULTS.md sessions 50-51).
bool use_pdl(int64_t M) { return use_pdl() && M < dsv4_overrides::get().gemv_pdl_rows; }

using dsv4_cuda::mm_dtype_op;

// Contiguous, and aligned for the kernels' vector loads (odd views get copied).
at::Tensor prep(const at::Tensor& t, uintptr_t align) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % align != 0) c = c.clone();
  return c;
}

void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
}

int out_kind_of(at::ScalarType t, const char* op) {
  if (t == at::kBFloat16) return 0;
  if (t == at::kHalf) return 1;
  TORCH_CHECK(t == at::kFloat, op, ": out_dtype must be bfloat16, float16 or float32, got ", t);
  return 2;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

#if defined(DSV4_WITH_CUBLASLT)
// Owns one cublasLt descriptor; every early return of lt_matmul below must release what it created.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct LtOwned {
  T h = nullptr;
  LtOwned() = default;
  LtOwned(const LtOwned&) = delete;
  LtOwned& operator=(const LtOwned&) = delete;
  ~LtOwned() {
    if (h != nullptr) Destroy(h);
  }
};

// The heuristic assumes 256-byte-aligned operands unless told otherwise, and could then pick a kernel whose vector
// loads need an alignment that an offset view lacks; so it is told each pointer's real alignment (<= 256).
uint32_t ptr_alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// out[M, N] = round(alpha * (x[M, K] @ wu[N, K]^T)) in one cublasLt call: fp32 accumulation, alpha (one fp32 value)
// read from device memory by the epilogue, one rounding to out's dtype (bf16 or fp32). Returns false, with out
// unwritten, when cublasLt cannot do it (the caller then takes the aten::mm.dtype path).
//
// cuBLAS is column-major; a row-major [R, C] torch tensor is the column-major C x R matrix (its transpose) with
// leading dim C. So with y = x W^T in row-major terms, the column-major problem is y^T[N, M] = W[N, K] x^T[K, M]:
//   A = wu, seen column-major as K x N (= W^T), ld K, TRANSA = T  -> op(A) = W    (N x K)
//   B = x,  seen column-major as K x M (= x^T), ld K, TRANSB = N  -> op(B) = x^T  (K x M)
//   D = out, column-major N x M (= y^T), ld N: exactly the row-major [M, N] y.
// (the "TN" form, the one cuBLAS has the most tuned Hopper kernels for).
bool lt_matmul(const at::Tensor& x, const at::Tensor& wu, const at::Tensor& alpha, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = wu.size(0);
  cudaDataType_t d_type;
  if (out.scalar_type() == at::kBFloat16) {
    d_type = CUDA_R_16BF;
  } else if (out.scalar_type() == at::kFloat) {
    d_type = CUDA_R_32F;
  } else {
    return false;  // bf16 operands -> fp16 output is not a cublasLt type combination
  }
  if (!x.is_contiguous() || !wu.is_contiguous() || !out.is_contiguous() || alpha.numel() != 1 ||
      alpha.scalar_type() != at::kFloat)
    return false;
  auto ok = [](cublasStatus_t st) { return st == CUBLAS_STATUS_SUCCESS; };

  LtOwned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> desc;
  if (!ok(cublasLtMatmulDescCreate(&desc.h, CUBLAS_COMPUTE_32F, CUDA_R_32F))) return false;
  const int32_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N, pointer_mode = CUBLASLT_POINTER_MODE_DEVICE;
  if (!ok(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a))) ||
      !ok(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b))) ||
      !ok(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode,
                                         sizeof(pointer_mode))))
    return false;

  LtOwned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> a_layout, b_layout, d_layout;
  if (!ok(cublasLtMatrixLayoutCreate(&a_layout.h, CUDA_R_16BF, uint64_t(K), uint64_t(N), K)) ||
      !ok(cublasLtMatrixLayoutCreate(&b_layout.h, CUDA_R_16BF, uint64_t(K), uint64_t(M), K)) ||
      !ok(cublasLtMatrixLayoutCreate(&d_layout.h, d_type, uint64_t(N), uint64_t(M), N)))
    return false;

  LtOwned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> pref;
  if (!ok(cublasLtMatmulPreferenceCreate(&pref.h))) return false;
  // Split-K only with fp32 partial sums: the in-place / output-type schemes add bf16 partials, i.e. several
  // roundings instead of the one these ops promise.
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  const uint64_t max_workspace = uint64_t(32) << 20;
  const uint32_t align_a = ptr_alignment(wu.data_ptr()), align_b = ptr_alignment(x.data_ptr()),
                 align_d = ptr_alignment(out.data_ptr());
  if (!ok(cublasLtMatmulPreferenceSetAttribute(pref.h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
                                               sizeof(max_workspace))) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(pref.h, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                               sizeof(reduction))) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(pref.h, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                               sizeof(align_a))) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(pref.h, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                               sizeof(align_b))) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(pref.h, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                               sizeof(align_d))) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(pref.h, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                               sizeof(align_d))))
    return false;

  cublasLtHandle_t handle = nullptr;
  try {
    handle = at::cuda::getCurrentCUDABlasLtHandle();
  } catch (const c10::Error&) {
    return false;
  }
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  if (!ok(cublasLtMatmulAlgoGetHeuristic(handle, desc.h, a_layout.h, b_layout.h, d_layout.h, d_layout.h, pref.h, 1,
                                         &heuristic, &found)) ||
      found < 1 || !ok(heuristic.state))
    return false;

  // Workspace: exactly what the chosen algorithm needs (often none), from the caching allocator, so it is
  // stream-ordered and lands in the graph pool under CUDA-graph capture; never cudaMalloc.
  at::Tensor workspace;
  void* workspace_ptr = nullptr;
  if (heuristic.workspaceSize > 0) {
    workspace = at::empty({int64_t(heuristic.workspaceSize)}, x.options().dtype(at::kByte));
    workspace_ptr = workspace.data_ptr();
  }
  // DEVICE pointer mode makes beta a device pointer too. With beta == 0, C (= D, uninitialized) is not read.
  const at::Tensor beta = at::zeros({1}, alpha.options());
  const cublasStatus_t st =
      cublasLtMatmul(handle, desc.h, alpha.data_ptr(), wu.data_ptr(), a_layout.h, x.data_ptr(), b_layout.h,
                     beta.data_ptr(), out.data_ptr(), d_layout.h, out.data_ptr(), d_layout.h, &heuristic.algo,
                     workspace_ptr, heuristic.workspaceSize, c10::cuda::getCurrentCUDAStream().stream());
  if (!ok(st)) {
    // A rejected launch may leave a non-sticky error behind; clear it so that the fallback's own launch check
    // does not report it as its failure.
    (void)cudaGetLastError();
    return false;
  }
  return true;
}
constexpr bool kHaveCublasLt = true;
#else
// Built without cuBLASLt (CMake found neither the toolkit's nor the torch wheel's): the mm.dtype form only.
bool lt_matmul(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&) { return false; }
constexpr bool kHaveCublasLt = false;
#endif

at::Tensor linear_impl(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& s, const at::Tensor& gs,
                       const at::Tensor* gs_act, int64_t N, at::ScalarType out_dtype, const char* op) {
  const int64_t M = x2.size(0), K = x2.size(1);
  TORCH_CHECK(M < (int64_t(1) << 31) && N < (int64_t(1) << 31) && K < (int64_t(1) << 31), op,
              ": sizes must fit in int32");
  const at::Tensor wc = prep(w, 16), sc = prep(s, 8), gc = gs.contiguous();
  at::Tensor ac;
  if (gs_act != nullptr) ac = gs_act->contiguous();
  const Choice choice = kernel_choice();
  const auto* mm = mm_dtype_op();
  const bool dense = M > 64 && N > 0 &&
                     (choice == Choice::kCublas || (choice == Choice::kAuto && M > kWgmmaMaxRows));
  const bool lt = kHaveCublasLt && dense && (out_dtype == at::kBFloat16 || out_dtype == at::kFloat);
  if (dense && (lt || mm != nullptr)) {
    at::Tensor wu = at::empty({N, K}, x2.options().dtype(at::kBFloat16));
    check_launch(dsv4_nvfp4_dequant_weight_launch(wc.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), N, K,
                                                  wu.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()),
                 op);
    // One fp32 on the device: the weight's global scale, or gs_x * gs_w (W4A4) by one ATen op (no host read).
    const at::Tensor alpha = gs_act != nullptr ? gc.reshape({}) * ac.reshape({}) : gc.reshape({});
    if (lt) {
      at::Tensor out = at::empty({M, N}, x2.options().dtype(out_dtype));
      if (lt_matmul(x2, wu, alpha, out)) return out;
    }
    if (mm != nullptr) {
      at::Tensor y = mm->call(x2, wu.t(), at::kFloat);
      if (out_dtype == at::kFloat) return y.mul_(alpha);
      // One pass (fp32 product, then one rounding to out_dtype) instead of mul_ + to(): at M = 4096 the fp32
      // product is the largest tensor of the call (4096 x 32768 x 4 B for wq_b).
      at::Tensor out = at::empty(y.sizes(), y.options().dtype(out_dtype));
      at::mul_out(out, y, alpha);
      return out;
    }
    // Neither GEMM form ran (cublasLt declined, no aten::mm.dtype): the tiled kernel below, wu unused.
  }
  at::Tensor out = at::empty({M, N}, x2.options().dtype(out_dtype));
  Nvfp4LinearArgs a{};
  a.x = x2.data_ptr();
  a.w = wc.data_ptr<uint8_t>();
  a.s = sc.data_ptr<uint8_t>();
  a.gs = gc.data_ptr<float>();
  a.gs_act = gs_act != nullptr ? ac.data_ptr<float>() : nullptr;
  a.y = out.data_ptr();
  a.out_kind = out_kind_of(out_dtype, op);
  a.M = M;
  a.N = N;
  a.K = K;
  a.gemv = choice == Choice::kSkinny ? 0 : 1;
  a.pdl = use_pdl(M) ? 1 : 0;
  a.wgmma = forced_wgmma(choice) || auto_wgmma(choice, M) ? wgmma_arg(choice, M, N, 1) : 0;
  check_launch(dsv4_nvfp4_linear_launch(&a, c10::cuda::getCurrentCUDAStream().stream()), op);
  return out;
}

at::Tensor nvfp4_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& gs,
                             std::optional<at::ScalarType> out_dtype) {
  const char* op = "dsv4::nvfp4_linear";
  check_cuda(x, op, "x");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16, op, ": x must be bf16 [..., K], got ",
              x.scalar_type(), " ", x.sizes());
  const at::ScalarType dt = dsv4_nvfp4::linear_out_dtype(out_dtype, op);
  const int64_t K = x.size(-1);
  const int64_t N = check_weight(w, s, K, 0, x, op, "w_packed", "w_scale");
  check_global_scale(gs, x, op, "w_global_scale");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = prep(x.reshape({-1, K}), 16);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  return linear_impl(x2, w, s, gs, nullptr, N, dt, op).view(out_shape);
}

// One launch for every group: gemv / skinny at M < 32, wgmma up to 1024 rows (group = blockIdx.y); larger M runs
// each group through the nvfp4_linear paths.
at::Tensor nvfp4_linear_grouped_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                                     const at::Tensor& gs) {
  const char* op = "dsv4::nvfp4_linear_grouped";
  check_cuda(x, op, "x");
  const auto [G, N] = check_grouped(x, w, s, gs, op);
  const int64_t K = x.size(-1);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x3 = prep(x.reshape({-1, G, K}), 16);
  const int64_t M = x3.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  TORCH_CHECK(M < (int64_t(1) << 31) && G * N < (int64_t(1) << 31) && K < (int64_t(1) << 31), op,
              ": sizes must fit in int32");
  at::Tensor out = at::empty({M, G, N}, x3.options());
  // wgmma: every group in one launch for 32 <= M <= 1024 (forced: any M > 8); 3.2-5x the skinny kernel / the
  // per-group loop at M = 32-256 (bench/RESULTS.md, session 32). Else skinny at M <= 64, then each group through
  // the linear's rule (dequantize + cuBLAS beyond 1024 rows).
  const Choice choice = kernel_choice();
  const bool wgmma = (forced_wgmma(choice) && M > 8) || (auto_wgmma(choice, M) && M <= kWgmmaMaxRows);
  TORCH_CHECK(G * K < (int64_t(1) << 31), op, ": sizes must fit in int32");
  if (M > 64 && !wgmma) {
    for (int64_t g = 0; g < G; ++g)
      out.select(1, g).copy_(linear_impl(x3.select(1, g).contiguous(), w.select(0, g), s.select(0, g),
                                         gs.select(0, g), nullptr, N, at::kBFloat16, op));
    return out.view(out_shape);
  }
  const at::Tensor wc = prep(w, 16), sc = prep(s, 8), gc = gs.contiguous();
  Nvfp4LinearArgs a{};
  a.x = x3.data_ptr();
  a.w = wc.data_ptr<uint8_t>();
  a.s = sc.data_ptr<uint8_t>();
  a.gs = gc.data_ptr<float>();
  a.gs_act = nullptr;
  a.y = out.data_ptr();
  a.out_kind = 0;
  a.M = M;
  a.N = N;
  a.K = K;
  a.G = G;
  a.gemv = choice == Choice::kSkinny ? 0 : 1;
  a.wgmma = wgmma ? wgmma_arg(choice, M, N, G) : 0;
  a.pdl = use_pdl(M) ? 1 : 0;
  check_launch(dsv4_nvfp4_linear_launch(&a, c10::cuda::getCurrentCUDAStream().stream()), op);
  return out.view(out_shape);
}

// One launch for up to kNvfp4MaxSegments matrices at decode sizes (M <= 8, or M <= 64 with a kernel forced: gemv /
// skinny, segment = blockIdx.y); otherwise one nvfp4_linear per matrix (H100: at M = 16 / 24 wq_b + the indexer's
// wq_b per matrix 17.0 / 20.0 us vs one skinny launch 38.5 / 56.0; wq_a + wkv 12.4 / 13.6 vs 11.7 / 15.2).
// trigger_now: where the gemv runs (one launch, M <= 8), it lets its successor launch at its start
// (nvfp4_fp32_linear_multi's fp32 kernel runs beside it); the other paths' kernels let it launch after their wait,
// as always. Returns whether such a gemv was enqueued (some N > 0) in *triggered, and in *hold the copies it reads
// (x, weights): a kernel beside it must not get their memory from the allocator while it runs.
std::vector<at::Tensor> multi_impl(const at::Tensor& x, at::TensorList w, at::TensorList s, at::TensorList gs,
                                   const std::vector<int64_t>& ns, bool trigger_now, const char* op,
                                   bool* triggered = nullptr, std::vector<at::Tensor>* hold = nullptr) {
  if (triggered != nullptr) *triggered = false;
  const int64_t K = x.size(-1);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = prep(x.reshape({-1, K}), 16);
  const int64_t M = x2.size(0);
  const int n = int(w.size());
  std::vector<at::Tensor> outs;
  auto shaped = [&](const at::Tensor& y, int64_t N) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    return y.view(shape);
  };
  // Per matrix where the linear's rule picks the tiled or wgmma kernel (faster there than one skinny launch)
  if (M > 64 || n > kNvfp4MaxSegments || (kernel_choice() == Choice::kAuto && M > 8)) {
    for (int i = 0; i < n; ++i)
      outs.push_back(shaped(linear_impl(x2, w[i], s[i], gs[i], nullptr, ns[i], at::kBFloat16, op), ns[i]));
    return outs;
  }
  TORCH_CHECK(M < (int64_t(1) << 31) && K < (int64_t(1) << 31), op, ": sizes must fit in int32");
  Nvfp4LinearArgs a{};
  std::vector<at::Tensor> keep;  // contiguous / aligned copies live until the launch is enqueued
  a.x = x2.data_ptr();
  a.out_kind = 0;
  a.M = M;
  a.K = K;
  a.nseg = n;
  for (int i = 0; i < n; ++i) {
    TORCH_CHECK(ns[i] < (int64_t(1) << 31), op, ": sizes must fit in int32");
    keep.push_back(prep(w[i], 16));
    keep.push_back(prep(s[i], 8));
    keep.push_back(gs[i].contiguous());
    outs.push_back(at::empty({M, ns[i]}, x2.options()));
    a.seg_w[i] = keep[3 * i].data_ptr<uint8_t>();
    a.seg_s[i] = keep[3 * i + 1].data_ptr<uint8_t>();
    a.seg_gs[i] = keep[3 * i + 2].data_ptr<float>();
    a.seg_y[i] = outs[i].data_ptr();
    a.seg_n[i] = ns[i];
  }
  a.gemv = kernel_choice() == Choice::kSkinny ? 0 : 1;
  a.pdl = use_pdl(M) ? 1 : 0;
  a.trigger_now = trigger_now ? 1 : 0;
  check_launch(dsv4_nvfp4_linear_launch(&a, c10::cuda::getCurrentCUDAStream().stream()), op);
  bool any_rows = false;
  for (int i = 0; i < n; ++i) any_rows = any_rows || ns[i] > 0;
  if (triggered != nullptr) *triggered = trigger_now && any_rows && dsv4_nvfp4_takes_gemv(&a);
  if (hold != nullptr) {
    hold->push_back(x2);
    hold->insert(hold->end(), keep.begin(), keep.end());
  }
  for (int i = 0; i < n; ++i) outs[i] = shaped(outs[i], ns[i]);
  return outs;
}

std::vector<at::Tensor> nvfp4_linear_multi_cuda(const at::Tensor& x, at::TensorList w, at::TensorList s,
                                                at::TensorList gs) {
  const char* op = "dsv4::nvfp4_linear_multi";
  check_cuda(x, op, "x");
  return multi_impl(x, w, s, gs, check_multi(x, w, s, gs, op), false, op);
}

// nvfp4_linear_multi's outputs, then fp32_linear's, of one x. Every argument is checked before either launch.
// Under PDL (and the beside override) the fp32 kernel runs beside the gemv instead of after it: the gemv lets it
// launch as soon as x is final, it reads only x and its weights, and its last CTA waits for the gemv before it exits
// (fp32_linear.cu), so whatever follows the op still starts after both.
std::vector<at::Tensor> nvfp4_fp32_linear_multi_cuda(const at::Tensor& x, at::TensorList w, at::TensorList s,
                                                     at::TensorList gs, at::TensorList fp32_weight) {
  const char* op = "dsv4::nvfp4_fp32_linear_multi";
  check_cuda(x, op, "x");
  const std::vector<int64_t> ns = check_multi(x, w, s, gs, op);
  dsv4_fp32_linear::check(x, fp32_weight, op, "fp32_weight");
  const bool want = dsv4_overrides::get().pdl != 0 && dsv4_overrides::get().beside != 0;
  bool beside = false;            // whether the gemv that lets the fp32 kernel launch early was enqueued
  std::vector<at::Tensor> hold;   // what that gemv reads lives until the fp32 outputs are allocated
  std::vector<at::Tensor> outs = multi_impl(x, w, s, gs, ns, want, op, &beside, &hold);
  for (at::Tensor& y : dsv4_fp32_linear::cuda_impl(x, fp32_weight, beside)) outs.push_back(std::move(y));
  return outs;
}

at::Tensor nvfp4_linear_w4a4_cuda(const at::Tensor& xp, const at::Tensor& xs, const at::Tensor& xg,
                                  const at::Tensor& w, const at::Tensor& s, const at::Tensor& gs,
                                  at::ScalarType out_dtype) {
  const char* op = "dsv4::nvfp4_linear_w4a4";
  check_cuda(xp, op, "x_packed");
  const int64_t K = check_w4a4_activation(xp, xs, xg, op);
  const int64_t N = check_weight(w, s, K, 0, xp, op, "w_packed", "w_scale");
  check_global_scale(gs, xp, op, "w_global_scale");
  out_kind_of(out_dtype, op);
  const c10::cuda::CUDAGuard guard(xp.device());
  const at::Tensor p2 = xp.reshape({-1, K / 2}).contiguous();
  const at::Tensor s2 = (xs.scalar_type() == at::kByte ? xs : xs.view(at::kByte)).reshape({-1, K / kBlock}).contiguous();
  const int64_t rows = p2.size(0);
  at::Tensor xb = at::empty({rows, K}, xp.options().dtype(at::kBFloat16));
  Nvfp4DequantActArgs d{};
  d.packed = p2.data_ptr<uint8_t>();
  d.scale = s2.data_ptr<uint8_t>();
  d.out = xb.data_ptr();
  d.rows = rows;
  d.K = K;
  check_launch(dsv4_nvfp4_dequant_act_launch(&d, c10::cuda::getCurrentCUDAStream().stream()), op);
  std::vector<int64_t> out_shape(xp.sizes().begin(), xp.sizes().end());
  out_shape.back() = N;
  return linear_impl(xb, w, s, gs, &xg, N, out_dtype, op).view(out_shape);
}

// dsv4::nvfp4_moe (rows = false: y [T, d]) and dsv4::nvfp4_moe_rows (rows = true: the down projection's
// per-assignment rows o [T*k + T*has_shared, d], no combine kernel; rows of non-local ids are never written).
at::Tensor moe_impl(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, const at::Tensor& w13,
                    const at::Tensor& s13, const at::Tensor& g13, const at::Tensor& w2, const at::Tensor& s2,
                    const at::Tensor& g2, const std::optional<at::Tensor>& sw13, const std::optional<at::Tensor>& ss13,
                    const std::optional<at::Tensor>& sg13, const std::optional<at::Tensor>& sw2,
                    const std::optional<at::Tensor>& ss2, const std::optional<at::Tensor>& sg2, double limit, bool rows,
                    const char* op) {
  check_cuda(x, op, "x");
  const MoeDims m = check_moe(x, ids, wts, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, op);
  TORCH_CHECK(m.E <= 4096, op, ": at most 4096 experts (routing histogram in shared memory), got ", m.E);
  const int64_t TK = m.T * m.k;
  TORCH_CHECK(TK + m.T < (int64_t(1) << 31) && m.d < (int64_t(1) << 31), op, ": sizes must fit in int32");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor o = at::empty({TK + (m.has_shared ? m.T : 0), m.d}, x.options());
  at::Tensor y = rows ? o : at::empty({m.T, m.d}, x.options());
  if (m.T == 0) return y;
  const at::Tensor xc = prep(x, 16), idc = ids.contiguous(), wtc = wts.contiguous();
  const at::Tensor w13c = prep(w13, 16), s13c = prep(s13, 8), g13c = g13.contiguous();
  const at::Tensor w2c = prep(w2, 16), s2c = prep(s2, 8), g2c = g2.contiguous();
  at::Tensor sw13c, ss13c, sg13c, sw2c, ss2c, sg2c;
  if (m.has_shared) {
    sw13c = prep(*sw13, 16), ss13c = prep(*ss13, 8), sg13c = sg13->contiguous();
    sw2c = prep(*sw2, 16), ss2c = prep(*ss2, 8), sg2c = sg2->contiguous();
  }
  at::Tensor route = at::empty({3 * m.E + 1 + TK}, x.options().dtype(at::kInt));
  at::Tensor h = at::empty({TK * m.I + m.T * m.Is}, x.options());
  Nvfp4MoeArgs a{};
  a.x = xc.data_ptr();
  a.ids = idc.data_ptr();
  a.ids_int64 = idc.scalar_type() == at::kLong ? 1 : 0;
  a.wts = wtc.data_ptr<float>();
  a.w13 = w13c.data_ptr<uint8_t>();
  a.s13 = s13c.data_ptr<uint8_t>();
  a.g13 = g13c.data_ptr<float>();
  a.w2 = w2c.data_ptr<uint8_t>();
  a.s2 = s2c.data_ptr<uint8_t>();
  a.g2 = g2c.data_ptr<float>();
  if (m.has_shared) {
    a.sw13 = sw13c.data_ptr<uint8_t>();
    a.ss13 = ss13c.data_ptr<uint8_t>();
    a.sg13 = sg13c.data_ptr<float>();
    a.sw2 = sw2c.data_ptr<uint8_t>();
    a.ss2 = ss2c.data_ptr<uint8_t>();
    a.sg2 = sg2c.data_ptr<float>();
  }
  a.T = m.T;
  a.d = m.d;
  a.k = m.k;
  a.E = m.E;
  a.I = m.I;
  a.Is = m.has_shared ? m.Is : 0;
  a.limit = float(limit);
  a.route = route.data_ptr<int>();
  a.h = h.data_ptr();
  a.o = o.data_ptr();
  a.y = y.data_ptr();
  a.pdl = use_pdl(m.T) ? 1 : 0;
  const Choice choice = kernel_choice();
  a.gemv = choice == Choice::kSkinny ? 0 : 1;
  // wgmma MoE kernels wherever skinny would run, unless a kernel is forced (tiled / skinny keep skinny): auto picks
  // their tile rows (3), wgmma / wgmma_wide force 128 / 256
  a.wgmma = choice == Choice::kWgmmaWide ? 2 : choice == Choice::kWgmma ? 1 : choice == Choice::kAuto ? 3 : 0;
  a.skip_combine = rows ? 1 : 0;
  check_launch(dsv4_nvfp4_moe_launch(&a, c10::cuda::getCurrentCUDAStream().stream()), op);
  return y;
}

at::Tensor nvfp4_moe_cuda(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts, const at::Tensor& w13,
                          const at::Tensor& s13, const at::Tensor& g13, const at::Tensor& w2, const at::Tensor& s2,
                          const at::Tensor& g2, const std::optional<at::Tensor>& sw13,
                          const std::optional<at::Tensor>& ss13, const std::optional<at::Tensor>& sg13,
                          const std::optional<at::Tensor>& sw2, const std::optional<at::Tensor>& ss2,
                          const std::optional<at::Tensor>& sg2, double limit) {
  return moe_impl(x, ids, wts, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, limit, false,
                  "dsv4::nvfp4_moe");
}

at::Tensor nvfp4_moe_rows_cuda(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts,
                               const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& g13,
                               const at::Tensor& w2, const at::Tensor& s2, const at::Tensor& g2,
                               const std::optional<at::Tensor>& sw13, const std::optional<at::Tensor>& ss13,
                               const std::optional<at::Tensor>& sg13, const std::optional<at::Tensor>& sw2,
                               const std::optional<at::Tensor>& ss2, const std::optional<at::Tensor>& sg2,
                               double limit) {
  return moe_impl(x, ids, wts, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, limit, true,
                  "dsv4::nvfp4_moe_rows");
}

}  // namespace

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("nvfp4_linear", &nvfp4_linear_cuda);
  m.impl("nvfp4_linear_grouped", &nvfp4_linear_grouped_cuda);
  m.impl("nvfp4_linear_multi", &nvfp4_linear_multi_cuda);
  m.impl("nvfp4_fp32_linear_multi", &nvfp4_fp32_linear_multi_cuda);
  m.impl("nvfp4_linear_w4a4", &nvfp4_linear_w4a4_cuda);
  m.impl("nvfp4_moe", &nvfp4_moe_cuda);
  m.impl("nvfp4_moe_rows", &nvfp4_moe_rows_cuda);
}
