// The Python module that loading livemoe._C needs. The ops themselves register with the dispatcher
// from their own files (TORCH_LIBRARY_FRAGMENT(livemoe, m)) and are called as torch.ops.livemoe.*.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "livemoe C++/CUDA ops (see torch.ops.livemoe)";
}
