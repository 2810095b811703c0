// The ONE schema table of the dsv4 namespace. Kernels register elsewhere with TORCH_LIBRARY_IMPL
// (cpu/*.cpp always, cuda/*.cpp when built with CUDA); fakes live in dsv4_ops/fakes/.
// Rules: outputs never alias inputs; ops that mutate (caches) take Tensor(a!) and return ().
// Every schema is documented in docs/ops.md.
#include <torch/library.h>

// Exported so the Python module has a real link-time dependency on this library (otherwise
// --as-needed drops it and no op gets registered), and so callers can ask what was compiled in.
extern "C" __attribute__((visibility("default"))) int dsv4_ops_built_with_cuda() {
#ifdef DSV4_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

TORCH_LIBRARY(dsv4, m) {
  // ---- NVFP4 quantization (issue 2) ----
  m.def("nvfp4_quantize(Tensor x, Tensor global_scale) -> (Tensor packed, Tensor block_scale)");
  m.def("nvfp4_dequantize(Tensor packed, Tensor block_scale, Tensor global_scale, ScalarType dtype) -> Tensor");
  m.def("fused_amax_quantize(Tensor x) -> (Tensor packed, Tensor block_scale, Tensor global_scale)");
  m.def("fused_amax_quantize_per_row(Tensor x) -> (Tensor packed, Tensor block_scale, Tensor global_scale)");
  m.def(
      "fused_deinterleave_amax_quantize(Tensor gate_up, Tensor? row_weight, float limit, bool per_row) "
      "-> (Tensor packed, Tensor block_scale, Tensor global_scale)");

  // ---- lightning indexer (issue 2) ----
  // (defined by the indexer section owner)

  // ---- sampler (issue 3) ----

  // ---- NVFP4 GEMM / MoE (issue 7) ----

  // ---- decode state (issue 3) ----
}
