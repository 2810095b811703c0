// The shapes the kernels take, in one torch-free place: the argument checks and the CUDA launchers use these, and
// Python reads them once through dsv4_ops_kernel_limit (dsv4_ops/limits.py), so no caller restates a limit.
#pragma once
#include <cstdint>

namespace dsv4_limits {

constexpr int64_t kRouterMaxExperts = 1024;  // V4: 256 (Flash), 384 (Pro)
constexpr int64_t kRouterMaxTopk = 16;       // V4: 6
// The CUDA indexer scoring kernel: DeepSeek-V4's index_head_dim, heads zero-padded to 64, the winners sorted in
// one CTA's shared memory.
constexpr int64_t kIndexerCudaHeadDim = 128;
constexpr int64_t kIndexerCudaMaxHeads = 64;
constexpr int64_t kIndexerCudaMaxTopk = 4096;
constexpr int64_t kNormRopeCudaMaxDim = 4096;  // one thread per 4 elements, <= 1024 threads
constexpr int64_t kAttnMmaDimMultiple = 64;    // the tensor-core attention partial kernel: D % 64 == 0, D <= 512
constexpr int64_t kAttnMmaMaxDim = 512;

constexpr bool hadamard_fp4_dim_ok(int64_t d) { return d == 64 || d == 128 || d == 256; }
constexpr bool store_keys_dim_ok(int64_t d) { return d == 64 || d == 128 || d == 256 || d == 512; }
constexpr bool attn_mma_dim_ok(int64_t d) { return d % kAttnMmaDimMultiple == 0 && d <= kAttnMmaMaxDim; }

}  // namespace dsv4_limits
