// The Python module only anchors the op library: importing it loads libdsv4_ops.so (a DT_NEEDED
// dependency), whose static initializers register torch.ops.dsv4.*. Kernels are reachable only
// through the dispatcher, never through pybind11, so Dynamo and export see them as custom ops.
#include <pybind11/pybind11.h>

extern "C" int dsv4_ops_built_with_cuda();  // defined in libdsv4_ops.so

namespace {
bool built_with_cuda() { return dsv4_ops_built_with_cuda() != 0; }
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dsv4 op library anchor (ops live in torch.ops.dsv4)";
  m.def("built_with_cuda", &built_with_cuda, "Whether the CUDA kernels were compiled in.");
}
