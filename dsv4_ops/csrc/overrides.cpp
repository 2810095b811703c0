#include "overrides.h"

#include <cstring>

namespace dsv4_overrides {

Overrides& get() {
  static Overrides o;
  return o;
}

namespace {
int* field(const char* name) {
  Overrides& o = get();
  if (!std::strcmp(name, "nvfp4_gemm_kernel")) return &o.nvfp4_gemm_kernel;
  if (!std::strcmp(name, "pdl")) return &o.pdl;
  if (!std::strcmp(name, "moe_local_route")) return &o.moe_local_route;
  if (!std::strcmp(name, "attn_kernel")) return &o.attn_kernel;
  if (!std::strcmp(name, "nvfp4_fused_path")) return &o.nvfp4_fused_path;
  if (!std::strcmp(name, "topk_kernel")) return &o.topk_kernel;
  if (!std::strcmp(name, "moe_gemv_rows")) return &o.moe_gemv_rows;
  if (!std::strcmp(name, "gemv_pdl")) return &o.gemv_pdl;
  if (!std::strcmp(name, "gemv_pdl_rows")) return &o.gemv_pdl_rows;
  if (!std::strcmp(name, "beside")) return &o.beside;
  return nullptr;
}
}  // namespace

}  // namespace dsv4_overrides

// C entry points for dsv4_ops/overrides.py (ctypes): 0 on success, -1 for an unknown name.
extern "C" __attribute__((visibility("default"))) int dsv4_ops_set_override(const char* name, int value) {
  int* f = dsv4_overrides::field(name);
  if (f == nullptr) return -1;
  *f = value;
  return 0;
}

extern "C" __attribute__((visibility("default"))) int dsv4_ops_get_override(const char* name, int* value) {
  const int* f = dsv4_overrides::field(name);
  if (f == nullptr) return -1;
  *value = *f;
  return 0;
}
