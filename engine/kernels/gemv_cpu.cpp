// bf16 matmuls of a few tokens (decode steps), the weight read once per step:
// out (M, N) = x (M, K) W^T.
//
// At M = 1..4 a matmul is a GEMV: each weight is used M times, so its time is reading the
// weight. oneDNN's bf16 GEMM (AMX tiles here) is built for bigger M; at M = 1 it took about
// twice as long as this loop (bench/linear_small_m.py). Each task streams its rows of W once and
// forms the dot products of up to four tokens with each weight vector while it is in registers.
// Where the CPU has AVX-512 BF16 the inner loop is vdpbf16ps (32 products an instruction);
// elsewhere the plain loop below it, which the compiler vectorizes for what -march=native offers.
// (An int8 twin of this loop, weights widened to fp32, was no faster than torch's
// _weight_int8pack_mm, so int8 weights keep torch's kernel.)
//
// Rounding: products summed in fp32 (the CPU's dot-product instruction sums pairs in fp32), the
// result rounded once to bf16, as F.linear does; only the order of the fp32 sums differs.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MERIDIAN_AVX512_BF16 1
#include <immintrin.h>
#endif

#include <vector>

namespace meridian {
namespace {

constexpr int kRowsPerGroup = 4;  // weight rows whose dot products run side by side
constexpr int kMaxTileTokens = 4;  // tokens sharing each loaded weight vector
// Rows per task: fewer and a parallel region costs more than the rows' reads.
constexpr int64_t kBytesPerTask = 64 * 1024;

// The dot products of R bf16 weight rows (stride ldw) with T tokens' rows of x (stride k),
// over k columns: out[t * R + r]. x in bf16 (for AVX-512 BF16's dot products) and in fp32
// (xf, for the portable loop).
template <int R, int T>
inline void tile_bf16(const uint16_t* x, const float* xf, int64_t k, const uint16_t* w,
                      int64_t ldw, float* out) {
#if defined(MERIDIAN_AVX512_BF16)
  (void)xf;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  auto step = [&](int64_t i, __mmask32 mask) {
    __m512bh xv[T];
    for (int t = 0; t < T; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + t * k + i);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * ldw + i);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) step(i, __mmask32(0xffffffffu));
  if (i < k) step(i, __mmask32((uint64_t(1) << (k - i)) - 1));
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
#else
  (void)x;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) {
        const uint32_t wide = uint32_t(w[r * ldw + i]) << 16;
        float wf;
        std::memcpy(&wf, &wide, sizeof(float));
        acc += wf * xf[t * k + i];
      }
      out[t * R + r] = acc;
    }
#endif
}

// Calls fn(rows, tokens) with both as compile-time constants: R = kRowsPerGroup or 1,
// T = 1..kMaxTileTokens.
template <typename Fn>
inline void with_tile(int64_t rows, int64_t tokens, Fn&& fn) {
  auto with_tokens = [&](auto r) {
    switch (tokens) {
      case 1: fn(r, std::integral_constant<int, 1>{}); break;
      case 2: fn(r, std::integral_constant<int, 2>{}); break;
      case 3: fn(r, std::integral_constant<int, 3>{}); break;
      default: fn(r, std::integral_constant<int, kMaxTileTokens>{}); break;
    }
  };
  if (rows == kRowsPerGroup) {
    with_tokens(std::integral_constant<int, kRowsPerGroup>{});
  } else {
    with_tokens(std::integral_constant<int, 1>{});
  }
}

// Runs tile(first_row, num_rows, first_token, num_tokens) over every tile of the output: the
// weight's rows in groups of kRowsPerGroup (a last partial group row by row), split across
// torch's threads; the tokens in tiles of kMaxTileTokens, so each task reads its rows once.
template <typename Fn>
void for_tiles(int64_t num_rows, int64_t num_tokens, int64_t row_bytes, Fn&& tile) {
  const int64_t grain = std::max<int64_t>(kRowsPerGroup, kBytesPerTask / row_bytes);
  const int64_t num_groups = (num_rows + kRowsPerGroup - 1) / kRowsPerGroup;
  const int64_t grain_groups = (grain + kRowsPerGroup - 1) / kRowsPerGroup;
  at::parallel_for(0, num_groups, grain_groups, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t row = g * kRowsPerGroup;
      const int64_t rows = std::min<int64_t>(kRowsPerGroup, num_rows - row);
      const int64_t step = rows == kRowsPerGroup ? kRowsPerGroup : 1;
      for (int64_t r = row; r < row + rows; r += step) {
        for (int64_t t = 0; t < num_tokens; t += kMaxTileTokens) {
          tile(r, step, t, std::min<int64_t>(kMaxTileTokens, num_tokens - t));
        }
      }
    }
  });
}

void check_linear_args(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected contiguous x (M, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "expected a contiguous weight (N, K) with x's K = ", x.size(1));
}

}  // namespace

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight) {
  check_linear_args(x, weight);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16,
              "bf16_linear takes bf16 x and weight");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = torch::empty({m, n}, x.options());
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  std::vector<float> xf(m * k);
  to_float(x.data_ptr<at::BFloat16>(), xf.data(), m * k);
  auto* dst = out.data_ptr<at::BFloat16>();
  for_tiles(n, m, 2 * k, [&](int64_t row, int64_t rows, int64_t token, int64_t tokens) {
    float dots[kRowsPerGroup * kMaxTileTokens];
    with_tile(rows, tokens, [&](auto r, auto t) {
      tile_bf16<decltype(r)::value, decltype(t)::value>(xb + token * k, xf.data() + token * k, k,
                                                        w + row * k, k, dots);
    });
    for (int64_t t = 0; t < tokens; ++t) {
      from_float(dots + t * rows, dst + (token + t) * n + row, rows);
    }
  });
  return out;
}

}  // namespace meridian
