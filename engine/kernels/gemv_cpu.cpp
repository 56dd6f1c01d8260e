// bf16 and Q4_1 matmuls of a few tokens (decode steps), the weight read once per step:
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
// Q4_1 weights (q4_1_linear) are read as llama.cpp stores them, 4 bits a weight: blocks of 32
// weights, each an fp16 scale d, an fp16 min m and 16 bytes of nibbles (weight j in the low
// nibble of byte j, weight j + 16 in its high nibble), w = d * q + m. The loop forms each
// block's weights in fp32 registers, one FMA per 16 weights (as cheap as d * q alone, so the
// m * sum(x) split buys nothing here), and multiplies them with every token's x while they are
// there: a fifth of bf16's bytes read (20 bytes per 32 weights), the same weights as the file.
//
// Rounding: products summed in fp32 (the CPU's dot-product instruction sums pairs in fp32), the
// result rounded once to bf16, as F.linear does; only the order of the fp32 sums differs.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MERIDIAN_AVX512_BF16 1
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

constexpr int64_t kQ4_1BlockWeights = 32;
constexpr int64_t kQ4_1BlockBytes = 20;  // fp16 d, fp16 m, 16 bytes of nibbles

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return float(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The dot products of R rows of Q4_1 blocks (stride ldw bytes) with T tokens' fp32 rows of x
// (stride k), over k columns (whole blocks): out[t * R + r].
template <int R, int T>
inline void tile_q4_1(const float* x, int64_t k, const uint8_t* w, int64_t ldw, float* out) {
  const int64_t num_blocks = k / kQ4_1BlockWeights;
#if defined(__AVX512F__)
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m128i low_nibbles = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512 x_low[T], x_high[T];  // the block's weights 0-15 and 16-31 meet these
    for (int t = 0; t < T; ++t) {
      x_low[t] = _mm512_loadu_ps(x + t * k + b * kQ4_1BlockWeights);
      x_high[t] = _mm512_loadu_ps(x + t * k + b * kQ4_1BlockWeights + 16);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * ldw + b * kQ4_1BlockBytes;
      const __m512 d = _mm512_set1_ps(fp16_at(block));
      const __m512 m = _mm512_set1_ps(fp16_at(block + 2));
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
      const __m128i q_low = _mm_and_si128(qs, low_nibbles);
      const __m128i q_high = _mm_and_si128(_mm_srli_epi16(qs, 4), low_nibbles);
      const __m512 w_low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q_low)), d, m);
      const __m512 w_high =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q_high)), d, m);
      for (int t = 0; t < T; ++t) {
        acc[r][t] = _mm512_fmadd_ps(w_low, x_low[t], acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(w_high, x_high[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
#else
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * ldw + b * kQ4_1BlockBytes;
      float wb[kQ4_1BlockWeights];
      const float d = fp16_at(block), m = fp16_at(block + 2);
      for (int j = 0; j < 16; ++j) {
        wb[j] = d * float(block[4 + j] & 0x0f) + m;
        wb[j + 16] = d * float(block[4 + j] >> 4) + m;
      }
      for (int t = 0; t < T; ++t) {
        const float* xb = x + t * k + b * kQ4_1BlockWeights;
        float acc = 0.f;
        for (int j = 0; j < kQ4_1BlockWeights; ++j) acc += wb[j] * xb[j];
        out[t * R + r] += acc;
      }
    }
  }
#endif
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

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor blocks) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected contiguous x (M, K)");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kQ4_1BlockWeights == 0, "q4_1_linear needs K a multiple of 32, not ", k);
  const int64_t row_bytes = k / kQ4_1BlockWeights * kQ4_1BlockBytes;
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) == row_bytes,
              "expected contiguous uint8 Q4_1 blocks (N, ", row_bytes, ") for x's K = ", k);
  const int64_t n = blocks.size(0);
  auto out = torch::empty({m, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  std::vector<float> xf(m * k);
  dispatch_storage_type(x.scalar_type(), "q4_1_linear", [&](auto type) {
    using scalar_t = decltype(type);
    to_float(x.data_ptr<scalar_t>(), xf.data(), m * k);
    auto* dst = out.data_ptr<scalar_t>();
    for_tiles(n, m, row_bytes, [&](int64_t row, int64_t rows, int64_t token, int64_t tokens) {
      float dots[kRowsPerGroup * kMaxTileTokens];
      with_tile(rows, tokens, [&](auto r, auto t) {
        tile_q4_1<decltype(r)::value, decltype(t)::value>(xf.data() + token * k, k,
                                                          w + row * row_bytes, row_bytes, dots);
      });
      for (int64_t t = 0; t < tokens; ++t) {
        from_float(dots + t * rows, dst + (token + t) * n + row, rows);
      }
    });
  });
  return out;
}

// One block's 32 weights d * q + m (a product and a sum, each rounded in fp32, as gguf's
// dequantizer computes them), stored rounded to nearest even in the output's dtype.
template <typename scalar_t>
inline void dequantize_q4_1_block(const uint8_t* block, scalar_t* dst) {
  const float d = fp16_at(block), m = fp16_at(block + 2);
#if defined(MERIDIAN_AVX512_BF16)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    // 5x the plain loop below (3072x576: 0.4 against 2.2 ms), the same bits.
    const __m128i low_nibbles = _mm_set1_epi8(0x0f);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i q_high = _mm_and_si128(_mm_srli_epi16(qs, 4), low_nibbles);
    auto weights = [&](__m128i q) {
      const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
      return _mm512_add_ps(_mm512_mul_ps(qf, _mm512_set1_ps(d)), _mm512_set1_ps(m));
    };
    const __m512bh both =
        _mm512_cvtne2ps_pbh(weights(q_high), weights(_mm_and_si128(qs, low_nibbles)));
    _mm512_storeu_si512(dst, (__m512i)both);
    return;
  }
#endif
  float row[kQ4_1BlockWeights];
  for (int j = 0; j < 16; ++j) {
    row[j] = float(block[4 + j] & 0x0f) * d;
    row[j + 16] = float(block[4 + j] >> 4) * d;
  }
  for (int j = 0; j < kQ4_1BlockWeights; ++j) row[j] += m;
  from_float(row, dst, kQ4_1BlockWeights);
}

torch::Tensor q4_1_dequantize(torch::Tensor blocks, int64_t in_features, at::ScalarType dtype) {
  TORCH_CHECK(in_features % kQ4_1BlockWeights == 0, "q4_1_dequantize needs K a multiple of 32");
  const int64_t row_bytes = in_features / kQ4_1BlockWeights * kQ4_1BlockBytes;
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) == row_bytes,
              "expected contiguous uint8 Q4_1 blocks (N, ", row_bytes, ")");
  const int64_t n = blocks.size(0), num_blocks = in_features / kQ4_1BlockWeights;
  auto out = torch::empty({n, in_features}, blocks.options().dtype(dtype));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  dispatch_storage_type(dtype, "q4_1_dequantize", [&](auto type) {
    using scalar_t = decltype(type);
    auto* dst = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kBytesPerTask / row_bytes);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t b = 0; b < num_blocks; ++b) {
          dequantize_q4_1_block(w + i * row_bytes + b * kQ4_1BlockBytes,
                                dst + i * in_features + b * kQ4_1BlockWeights);
        }
      }
    });
  });
  return out;
}

}  // namespace meridian
