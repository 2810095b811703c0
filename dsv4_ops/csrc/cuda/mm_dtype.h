// aten::mm.dtype (bf16 x bf16 -> fp32 product on CUDA through cuBLAS), looked up at run time so that torch builds
// without it still load the library: callers fall back to widening the operands.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace dsv4_cuda {

using MmDtypeFn = at::Tensor(const at::Tensor&, const at::Tensor&, c10::ScalarType);

inline const c10::TypedOperatorHandle<MmDtypeFn>* mm_dtype_op() {
  static const std::optional<c10::TypedOperatorHandle<MmDtypeFn>> op = []() {
    const auto h = c10::Dispatcher::singleton().findSchema({"aten::mm", "dtype"});
    return h ? std::optional<c10::TypedOperatorHandle<MmDtypeFn>>(h->typed<MmDtypeFn>()) : std::nullopt;
  }();
  return op ? &*op : nullptr;
}

}  // namespace dsv4_cuda
