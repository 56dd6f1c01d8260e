// The elementwise work of a decoder layer, fused: each op here replaces 4 to 14 eager ATen ops
// whose own cost (dispatch, allocation, a parallel region each) is most of a decode step at
// small batches. Each rounds through the storage type wherever the eager ops it replaces do, so
// bf16 results equal theirs (fp32 ones to within fused multiply-adds).
//
// Shapes: x, residual (T, N); weight (N,); qkv (T, (H + 2 KVH) D), cos and sin (T, D);
// caches (num_blocks, block_size, KVH, D), slot_mapping (T,) int64; gate_up (T, 2 I).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <vector>

namespace meridian {
namespace {

// Rows per task such that a task holds about this many elements: a parallel region costs
// microseconds, more than a few rows of a 576-wide model take.
constexpr int64_t kElementsPerTask = 16384;

int64_t grain_rows(int64_t row_size) { return std::max<int64_t>(1, kElementsPerTask / row_size); }

template <typename scalar_t>
void norm_rows(const scalar_t* x, scalar_t* residual, const scalar_t* weight, scalar_t* out,
               int64_t num_rows, int64_t n, double eps) {
  at::parallel_for(0, num_rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> row(n), w(n), add(n);
    std::vector<scalar_t> scratch(n);
    to_float(weight, w.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * n, row.data(), n);
      if (residual != nullptr) {  // residual += x, rounded as the eager add rounds
        to_float(residual + r * n, add.data(), n);
        for (int64_t i = 0; i < n; ++i) row[i] += add[i];
        from_float(row.data(), residual + r * n, n);
        round_to(row.data(), scratch.data(), n);
      }
      float sum_sq = 0.f;
      for (int64_t i = 0; i < n; ++i) sum_sq += row[i] * row[i];
      const float inv_rms = 1.f / std::sqrt(sum_sq / float(n) + float(eps));
      for (int64_t i = 0; i < n; ++i) row[i] *= inv_rms;
      round_to(row.data(), scratch.data(), n);  // the eager path rounds before the weight
      for (int64_t i = 0; i < n; ++i) row[i] *= w[i];
      from_float(row.data(), out + r * n, n);
    }
  });
}

at::Tensor norm(at::Tensor x, const at::Tensor* residual, at::Tensor weight,
                   double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
                  weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "expected contiguous x (T, N) and a weight (N,) of its dtype");
  auto out = at::empty_like(x);
  dispatch_storage_type(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* res = nullptr;
    if (residual != nullptr) {
      TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                      residual->scalar_type() == x.scalar_type(),
                  "residual must be contiguous and match x");
      res = residual->data_ptr<scalar_t>();
    }
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), res, weight.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return out;
}

template <typename scalar_t, typename cache_t>
void rope_rows(scalar_t* qkv, const scalar_t* cos, const scalar_t* sin, cache_t* k_cache,
               cache_t* v_cache, const int64_t* slots, int64_t num_tokens, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim, half = head_dim / 2;
  const int64_t kv_size = num_kv_heads * head_dim;
  at::parallel_for(0, num_tokens, grain_rows(row), [&](int64_t begin, int64_t end) {
    std::vector<float> c(head_dim), s(head_dim), x(head_dim), a(head_dim), b(head_dim);
    std::vector<scalar_t> scratch(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      to_float(cos + t * head_dim, c.data(), head_dim);
      to_float(sin + t * head_dim, s.data(), head_dim);
      scalar_t* token = qkv + t * row;
      // Q heads then K heads, rotated in place: x cos + rotate_half(x) sin.
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        scalar_t* head = token + h * head_dim;
        to_float(head, x.data(), head_dim);
        for (int64_t d = 0; d < head_dim; ++d) a[d] = x[d] * c[d];
        for (int64_t d = 0; d < half; ++d) b[d] = -x[d + half] * s[d];
        for (int64_t d = half; d < head_dim; ++d) b[d] = x[d - half] * s[d];
        round_to(a.data(), scratch.data(), head_dim);
        round_to(b.data(), scratch.data(), head_dim);
        for (int64_t d = 0; d < head_dim; ++d) a[d] += b[d];
        from_float(a.data(), head, head_dim);
      }
      const scalar_t* k = token + num_heads * head_dim;
      if constexpr (std::is_same_v<cache_t, scalar_t>) {
        std::memcpy(k_cache + slots[t] * kv_size, k, kv_size * sizeof(scalar_t));
        std::memcpy(v_cache + slots[t] * kv_size, k + kv_size, kv_size * sizeof(scalar_t));
      } else {  // quantized on write, a head at a time
        for (int64_t h = 0; h < 2 * num_kv_heads; ++h) {  // K's heads, then V's
          to_float(k + h * head_dim, x.data(), head_dim);
          cache_t* cache = h < num_kv_heads ? k_cache : v_cache;
          from_float(x.data(), cache + slots[t] * kv_size + h % num_kv_heads * head_dim, head_dim);
        }
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  return norm(x, nullptr, weight, eps);
}

at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                           double eps) {
  return norm(x, &residual, weight, eps);
}

void rope_and_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                       at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                       int64_t num_heads, int64_t num_kv_heads) {
  const int64_t num_tokens = qkv.size(0), head_dim = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "expected contiguous qkv (T, (H + 2 KVH) D)");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == num_tokens * head_dim &&
                  sin.sizes() == cos.sizes(), "expected cos and sin (T, D)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(2) == num_kv_heads && v_cache.sizes() == k_cache.sizes(),
              "expected contiguous caches (blocks, block_size, KVH, D)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == num_tokens, "expected int64 slot_mapping (T,)");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type(), "qkv, cos and sin must share a dtype");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the caches must share a dtype");
  dispatch_storage_type(qkv.scalar_type(), "rope_and_write_kv", [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_type<scalar_t>(k_cache.scalar_type(), "rope_and_write_kv", [&](auto ct) {
      using cache_t = decltype(ct);
      rope_rows<scalar_t, cache_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                                   sin.data_ptr<scalar_t>(), k_cache.data_ptr<cache_t>(),
                                   v_cache.data_ptr<cache_t>(), slot_mapping.data_ptr<int64_t>(),
                                   num_tokens, num_heads, num_kv_heads, head_dim);
    });
  });
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "expected contiguous gate_up (T, 2 I)");
  const int64_t num_rows = gate_up.size(0), size = gate_up.size(1) / 2;
  auto out = at::empty({num_rows, size}, gate_up.options());
  dispatch_storage_type(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, grain_rows(size), [&](int64_t begin, int64_t end) {
      std::vector<float> g(size), u(size);
      std::vector<scalar_t> scratch(size);
      for (int64_t r = begin; r < end; ++r) {
        to_float(in + r * 2 * size, g.data(), size);
        to_float(in + r * 2 * size + size, u.data(), size);
        for (int64_t i = 0; i < size; ++i) g[i] = g[i] / (1.f + vector_exp(-g[i]));
        round_to(g.data(), scratch.data(), size);  // F.silu's output, in the storage type
        for (int64_t i = 0; i < size; ++i) g[i] *= u[i];
        from_float(g.data(), dst + r * size, size);
      }
    });
  });
  return out;
}

}  // namespace meridian
