// Decode attention over the paged KV cache on CPU: one query token per sequence, keys and
// values read in place from the sequence's blocks. Gathering the blocks into a padded tensor
// first (the portable path) copies every key and value once more per layer and step.
//
// Layouts: q (B, H, D); k_cache, v_cache (num_blocks, block_size, KVH, D);
// block_tables (B, max_blocks) int64; context_lens (B,) int64; out (B, H, D).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <limits>
#include <vector>

namespace meridian {
namespace {

template <typename scalar_t>
void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& context_lens, torch::Tensor& out, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;  // between tokens of one block
  const int64_t q_stride = q.stride(0);  // q may be a view into the fused QKV rows
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  // One task per (sequence, KV head): its query heads share every key and value read.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), kf(block_size * head_dim),
        vf(block_size * head_dim), scores(block_size), running_max(group), denom(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = lens[seq];
      to_float(q_ptr + seq * q_stride + kv_head * group * head_dim, qf.data(),
               group * head_dim);
      for (float& x : qf) x *= scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(denom.begin(), denom.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = tables[seq * max_blocks + start / block_size];
        const int64_t n = std::min(block_size, len - start);
        const int64_t base = (block * block_size * num_kv_heads + kv_head) * head_dim;
        for (int64_t t = 0; t < n; ++t) {
          to_float(k_ptr + base + t * token_stride, kf.data() + t * head_dim, head_dim);
          to_float(v_ptr + base + t * token_stride, vf.data() + t * head_dim, head_dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) {
            const float* kt = kf.data() + t * head_dim;
            float s = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kt[d];
            scores[t] = s;
            block_max = std::max(block_max, s);
          }
          // Online softmax: rescale what was accumulated when the maximum grows.
          const float new_max = std::max(running_max[g], block_max);
          const float correction = vector_exp(running_max[g] - new_max);
          float* ag = acc.data() + g * head_dim;
          denom[g] *= correction;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= correction;
          // A loop of exp alone is one the compiler vectorizes.
          for (int64_t t = 0; t < n; ++t) scores[t] = vector_exp(scores[t] - new_max);
          for (int64_t t = 0; t < n; ++t) {
            const float p = scores[t];
            denom[g] += p;
            const float* vt = vf.data() + t * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vt[d];
          }
          running_max[g] = new_max;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = scalar_t(acc[g * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q (B, H, D) and caches (blocks, block_size, KVH, D)");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 &&
                  context_lens.scalar_type() == torch::kInt64, "tables and lengths must be int64");
  // Each token's heads must lie packed; the tokens themselves may be apart (a view of QKV).
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty(q.sizes(), q.options());
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_attention<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    case at::kBFloat16:
      decode_attention<at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    case at::kHalf:
      decode_attention<at::Half>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16");
  }
  return out;
}

}  // namespace meridian
