// Programmatic dependent launch (PDL). A kernel launched with the PDL attribute may be scheduled while its
// predecessor in the stream is still running, so its launch latency hides under the predecessor's tail (in a
// CUDA graph too: the edge becomes programmatic). Such a kernel calls grid_dep_wait() before touching global
// memory another kernel reads or writes: the wait returns once the predecessor grids have completed and their
// writes are visible (at once for a kernel launched without the attribute). grid_dep_launch() lets the
// successor's CTAs be scheduled before this grid ends; their own wait still orders them after it.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "overrides.h"

namespace dsv4_cuda {

__device__ __forceinline__ void grid_dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_dep_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// The decode kernels outside the NVFP4 chain (attention, mHC, norm + RoPE, compressor, Hadamard, key store,
// indexer scoring, fp32 linear, router) and the NVFP4 quantizers launch with PDL unless the pdl override is off
// (overrides.h: read at each launch, so at capture).
// Each of them waits at its top, so the attribute never reorders memory accesses; the one exception is the
// fp32 linear kernel that dsv4::nvfp4_fp32_linear_multi launches beside its gemv (fp32_linear.cu, kBeside: it
// reads only what the gemv reads, final once the gemv lets it launch, and its last CTA waits before it exits).
inline bool decode_pdl() { return dsv4_overrides::get().pdl != 0; }

// The PDL launch attribute (launchers with other attributes, e.g. a cooperative grid, add it themselves).
inline void set_pdl_attribute(cudaLaunchAttribute& a) {
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when pdl.
template <typename... Params, typename... Args>
cudaError_t launch_ex(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  set_pdl_attribute(attr[0]);
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace dsv4_cuda
