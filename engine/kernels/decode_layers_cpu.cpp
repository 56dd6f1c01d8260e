// A decode step's decoder layers in one call: the same ops, in the same order, on the same
// kernels as engine/model/llama.py's layers, so the same bits, without ~14 Python calls and
// module dispatches per layer (at batch 1 those were about a fifth of a step: 2-2.5 ms of
// ~10.5 on the 30 layers of SmolLM2-135M, docs/benchmarks.md).
//
// For steps whose every token is a decode and every matmul is one of our GEMV kernels' steps
// (engine/model/fused_decode.py decides): each projection's weight is either Q4_1 blocks
// (uint8, q4_1_linear) or a dense bf16 matrix (bf16_linear), without bias.
#include "cpu_kernels.h"

#include <vector>

namespace meridian {
namespace {

constexpr size_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate-up, down

at::Tensor project(const at::Tensor& x, const at::Tensor& weight) {
  return weight.scalar_type() == at::kByte ? q4_1_linear(x, weight) : bf16_linear(x, weight);
}

}  // namespace

std::vector<at::Tensor> decode_layers(at::Tensor x, std::vector<at::Tensor> weights,
                                         std::vector<at::Tensor> kv_caches, at::Tensor cos,
                                         at::Tensor sin, at::Tensor slot_mapping,
                                         at::Tensor block_tables, at::Tensor context_lens,
                                         int64_t num_heads, double eps, double scale) {
  TORCH_CHECK(weights.size() % kWeightsPerLayer == 0 &&
                  kv_caches.size() == weights.size() / kWeightsPerLayer * 2,
              "expected 6 weights and 2 caches per layer");
  const int64_t num_tokens = x.size(0);
  at::Tensor residual;
  for (size_t layer = 0; layer < kv_caches.size() / 2; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const at::Tensor& k_cache = kv_caches[2 * layer];
    const at::Tensor& v_cache = kv_caches[2 * layer + 1];
    const int64_t num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
    // The residual stream is residual + x; before the first layer, x alone.
    if (layer == 0) {
      residual = x;
      x = rms_norm(x, w[0], eps);
    } else {
      x = add_rms_norm(x, residual, w[0], eps);
    }
    const at::Tensor qkv = project(x, w[1]);
    rope_and_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads);
    const at::Tensor q =
        qkv.narrow(1, 0, num_heads * head_dim).view({num_tokens, num_heads, head_dim});
    const at::Tensor attention =
        paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale);
    x = project(attention.reshape({num_tokens, num_heads * head_dim}).contiguous(), w[2]);
    x = add_rms_norm(x, residual, w[3], eps);
    x = project(silu_and_mul(project(x, w[4])), w[5]);
  }
  return {x, residual};
}

}  // namespace meridian
