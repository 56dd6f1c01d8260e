// The CPU kernels' Python module: one build, one load, for every op in the sources beside it.
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &meridian::paged_decode_attention,
        "Decode attention reading K and V in place from paged blocks");
}
