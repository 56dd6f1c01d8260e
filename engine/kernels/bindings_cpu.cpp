// The CPU kernels' Python module: one build, one load, for every op in the sources beside it.
#include "cpu_kernels.h"

// pybind11 with torch's casters (Tensor, dtype, lists of tensors), not <torch/extension.h>,
// whose C++ API made this file take 18 s to compile instead of 8.
#include <torch/csrc/utils/pybind.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &meridian::paged_decode_attention,
        "Decode attention reading K and V in place from paged blocks");
  m.def("paged_prefill_supported", &meridian::paged_prefill_supported,
        "Whether this build has the prefill kernel for heads of this size");
  m.def("paged_prefill_attention", &meridian::paged_prefill_attention,
        "Causal prefill attention of one chunk, reading K and V in place from paged blocks");
  m.def("rms_norm", &meridian::rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &meridian::add_rms_norm,
        "residual += x in place, then RMSNorm of the new residual");
  m.def("rope_and_write_kv", &meridian::rope_and_write_kv,
        "Rotate Q and K in place in the fused QKV rows, then write K and V to their cache slots");
  m.def("silu_and_mul", &meridian::silu_and_mul, "silu(gate) * up of the fused gate-up rows");
  m.def("bf16_linear", &meridian::bf16_linear, "x W^T for few tokens, x and W bf16");
  m.def("q4_1_linear", &meridian::q4_1_linear,
        "x W^T for few tokens, W as Q4_1 blocks with fp32 scales (N, K / 32 * 24 bytes)");
  m.def("amx_tiles_ready", &meridian::amx_tiles_ready,
        "Whether block weights' steps of more than 4 bf16 tokens run on AMX tiles");
  m.def("q4_1_dequantize", &meridian::q4_1_dequantize,
        "Q4_1 blocks with fp32 scales (N, K / 32 * 24 bytes) -> the weight (N, K) in dtype");
  m.def("q8_0_linear", &meridian::q8_0_linear,
        "x W^T for few tokens, W as Q8_0 blocks with fp32 scales (N, K / 32 * 36 bytes)");
  m.def("q8_0_dequantize", &meridian::q8_0_dequantize,
        "Q8_0 blocks with fp32 scales (N, K / 32 * 36 bytes) -> the weight (N, K) in dtype");
  // Without the GIL: the call runs a whole step's layers (~8 ms at batch 1), and a server's
  // event loop thread must not wait for it.
  m.def("decode_layers", &meridian::decode_layers,
        "A decode step's decoder layers in one call -> (x, residual)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
