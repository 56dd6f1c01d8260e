// bf16 and block-quantized (Q4_1, Q8_0) matmuls of a few tokens (decode steps), the weight read
// once per step: out (M, N) = x (M, K) W^T.
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
// Block weights (q4_1_linear, q8_0_linear) are llama.cpp's blocks of 32 weights with the fp16
// scales widened to fp32 at load (exact; engine/model/block_weights.py), the quants as in the
// file:
//   Q4_1: fp32 d, fp32 m, 16 bytes of nibbles (weight j in the low nibble of byte j, weight
//         j + 16 in its high nibble), w = d * q + m: 24 bytes per 32 weights;
//   Q8_0: fp32 d, 32 int8 q, w = d * q: 36 bytes per 32 weights.
// The loop forms each block's weights in fp32 registers (Q4_1: one FMA per 16 weights, as cheap
// as d * q alone, so the m * sum(x) split buys nothing here) and multiplies them with every
// token's x while they are there. It is bound by those instructions as much as by the bytes:
// with the file's fp16 scales, their conversions and broadcasts shared a vector port with the
// weights' and the loop ran 1.4x slower for 17% fewer bytes on a Sapphire Rapids (1.04-1.17x
// on an AMD EPYC, where the prefetch below gained 1.7x).
//
// Rounding: products summed in fp32 (the CPU's dot-product instruction sums pairs in fp32), the
// result rounded once to bf16, as F.linear does; only the order of the fp32 sums differs. Block
// weights with bf16 x, where the CPU has AVX-512 BF16, are first rounded to bf16 as the
// dequantized model's are, so that its near ties fall the same way; elsewhere they stay fp32.
#include "block_formats.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <vector>

namespace meridian {
namespace {

constexpr int kRowsPerGroup = 4;  // weight rows whose dot products run side by side
constexpr int kMaxTileTokens = 4;  // tokens sharing each loaded weight vector
// A tile's R x T accumulators stay in registers only where every loop over them is unrolled:
// GCC 12 left the 4 x 4 tile's outer loops rolled and kept its 16 accumulators on the stack,
// storing each one every step (a product took 2.6x as long as in the 4 x 3 tile, AMD EPYC).
// Hence `#pragma GCC unroll` on those loops.
// Block weights' bf16 steps of this many tokens or more run on AMX tiles where the CPU has them
// (amx_cpu.cpp), whose cost barely grows with the tokens. At one token the loop below takes 0.8x
// their time (a decode step's matmuls of SmolLM2, Sapphire Rapids): a sequence decoded alone then
// sums in another order than in a batch, as any step past a kernel's range does.
constexpr int64_t kAmxMinTokens = 2;

// The dot products of R bf16 weight rows (stride ldw) with T tokens' rows of x (stride k),
// over k columns: out[t * R + r]. x in bf16 (for AVX-512 BF16's dot products) and in fp32
// (xf, for the portable loop).
template <int R, int T>
inline void tile_bf16(const uint16_t* x, const float* xf, int64_t k, const uint16_t* w,
                      int64_t ldw, float* out) {
#if defined(MERIDIAN_AVX512_BF16)
  (void)xf;
  __m512 acc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  auto step = [&](int64_t i, __mmask32 mask) {
    __m512bh xv[T];
    for (int t = 0; t < T; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + t * k + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // As in tile_blocks: the same columns of the next group's row.
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * ldw + i), _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * ldw + i);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) step(i, __mmask32(0xffffffffu));
  if (i < k) step(i, __mmask32((uint64_t(1) << (k - i)) - 1));
#pragma GCC unroll 4
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

// Runs group(first_row, num_rows) over the weight's rows in groups of kRowsPerGroup (a last
// partial group row by row), split across torch's threads.
template <typename Fn>
void for_row_groups(int64_t num_rows, int64_t row_bytes, Fn&& group) {
  const int64_t grain = std::max<int64_t>(kRowsPerGroup, kBytesPerTask / row_bytes);
  const int64_t num_groups = (num_rows + kRowsPerGroup - 1) / kRowsPerGroup;
  const int64_t grain_groups = (grain + kRowsPerGroup - 1) / kRowsPerGroup;
  at::parallel_for(0, num_groups, grain_groups, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t row = g * kRowsPerGroup;
      const int64_t rows = std::min<int64_t>(kRowsPerGroup, num_rows - row);
      const int64_t step = rows == kRowsPerGroup ? kRowsPerGroup : 1;
      for (int64_t r = row; r < row + rows; r += step) group(r, step);
    }
  });
}

// For one group of `rows` weight rows from `row`: runs dots_of(R, T, first_token, dots) over the
// tokens in tiles of kMaxTileTokens (R and T compile-time constants, see with_tile), each
// filling dots[t * R + r], and stores them to out (M, N), so each weight row is read once for
// every tile from the cache it is in.
template <typename scalar_t, typename Fn>
inline void group_tiles(int64_t num_tokens, int64_t row, int64_t rows, scalar_t* out, int64_t n,
                        Fn&& dots_of) {
  for (int64_t token = 0; token < num_tokens; token += kMaxTileTokens) {
    const int64_t tokens = std::min<int64_t>(kMaxTileTokens, num_tokens - token);
    float dots[kRowsPerGroup * kMaxTileTokens];
    with_tile(rows, tokens, [&](auto r, auto t) { dots_of(r, t, token, dots); });
    for (int64_t t = 0; t < tokens; ++t) {
      from_float(dots + t * rows, out + (token + t) * n + row, rows);
    }
  }
}

// The dot products of R rows of blocks (stride ldw bytes) with T tokens' fp32 rows of x
// (stride k), over k columns (whole blocks): out[t * R + r].
template <typename Format, int R, int T>
inline void tile_blocks(const float* x, int64_t k, const uint8_t* w, int64_t ldw, float* out) {
  const int64_t num_blocks = k / kBlockWeights;
#if defined(__AVX512F__)
  __m512 acc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512 x_low[T], x_high[T];  // the block's weights 0-15 and 16-31 meet these
    for (int t = 0; t < T; ++t) {
      x_low[t] = _mm512_loadu_ps(x + t * k + b * kBlockWeights);
      x_high[t] = _mm512_loadu_ps(x + t * k + b * kBlockWeights + 16);
    }
    for (int r = 0; r < R; ++r) {
      __m512 w_low, w_high;
      // The same block of the next group's row: the rows are short (576 weights: 432 bytes),
      // and without it a loop over weights that are not in cache ran at half its speed on
      // the EPYC (hardware prefetch did not keep up). Past the last row it is a no-op.
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * ldw + b * Format::kBlockBytes),
                   _MM_HINT_T0);
      Format::weights(w + r * ldw + b * Format::kBlockBytes, w_low, w_high, true);
      for (int t = 0; t < T; ++t) {
        acc[r][t] = _mm512_fmadd_ps(w_low, x_low[t], acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(w_high, x_high[t], acc[r][t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
#else
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int r = 0; r < R; ++r) {
      float wb[kBlockWeights];
      Format::exact(w + r * ldw + b * Format::kBlockBytes, wb);
      for (int t = 0; t < T; ++t) {
        const float* xb = x + t * k + b * kBlockWeights;
        float acc = 0.f;
        for (int j = 0; j < kBlockWeights; ++j) acc += wb[j] * xb[j];
        out[t * R + r] += acc;
      }
    }
  }
#endif
}

#if defined(MERIDIAN_AVX512_BF16)
// tile_blocks for bf16 x: each block's weights rounded to bf16 (round to nearest even, from the
// product and sum rounded as gguf's dequantizer rounds them), as the dequantized model holds
// them, and vdpbf16ps with x: the dequantized model's own products (bf16 times bf16 is exact in
// fp32), so only the order of the fp32 sums differs from it. No dearer than the fp32 loop: one
// instruction per token for 32 weights against two FMAs.
template <typename Format, int R, int T>
inline void tile_blocks_bf16(const uint16_t* x, int64_t k, const uint8_t* w, int64_t ldw,
                             float* out) {
  const int64_t num_blocks = k / kBlockWeights;
  __m512 acc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512bh xv[T];
    for (int t = 0; t < T; ++t) {
      xv[t] = (__m512bh)_mm512_loadu_si512(x + t * k + b * kBlockWeights);
    }
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + R) * ldw + b * Format::kBlockBytes),
                   _MM_HINT_T0);
      const __m512bh wv = Format::bf16_weights(w + r * ldw + b * Format::kBlockBytes);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

void check_linear_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected contiguous x (M, K)");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "expected a contiguous weight (N, K) with x's K = ", x.size(1));
}

// Blocks (N, K / 32 * kBlockBytes) uint8 for K columns.
template <typename Format>
void check_blocks(const at::Tensor& blocks, int64_t k) {
  TORCH_CHECK(k % kBlockWeights == 0, Format::kName, " needs K a multiple of 32, not ", k);
  const int64_t row_bytes = k / kBlockWeights * Format::kBlockBytes;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) == row_bytes,
              "expected contiguous uint8 ", Format::kName, " blocks (N, ", row_bytes,
              ") for K = ", k);
}

#if defined(MERIDIAN_AVX512_BF16)
// Rows of blocks in bf16, each weight as dequantize_block forms it, in a buffer of the calling
// thread's that the next group reuses (a group's rows are a few KB: they stay in L1).
template <typename Format>
const uint16_t* dequantize_rows(const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t k) {
  thread_local std::vector<at::BFloat16> dense;
  dense.resize(rows * k);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < k / kBlockWeights; ++b) {
      const __m512bh weights = Format::bf16_weights(w + r * row_bytes + b * Format::kBlockBytes);
      _mm512_storeu_si512(dense.data() + r * k + b * kBlockWeights, (__m512i)weights);
    }
  }
  return reinterpret_cast<const uint16_t*>(dense.data());
}

#endif

// With bf16 x on AVX-512 BF16, a step of more tokens than a tile dequantizes each group of rows
// once into L1 and runs the bf16 tiles on it: the blocks' own tiles would dequantize every
// block once per tile, and dequantizing the whole layer first (as the steps above the kernel's
// range do) writes and reads it back through memory. All three give the same bits. With AMX
// tiles, steps of kAmxMinTokens or more dequantize the same way and multiply on the tiles
// (amx_cpu.cpp): the same products, summed in another order.
template <typename Format>
at::Tensor block_linear(at::Tensor x, at::Tensor blocks) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected contiguous x (M, K)");
  const int64_t m = x.size(0), k = x.size(1);
  check_blocks<Format>(blocks, k);
  const int64_t row_bytes = blocks.size(1), n = blocks.size(0);
  auto out = at::empty({m, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  dispatch_storage_type(x.scalar_type(), "block_linear", [&](auto type) {
    using scalar_t = decltype(type);
    auto* dst = out.data_ptr<scalar_t>();
#if defined(MERIDIAN_AVX512_BF16)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
#if defined(MERIDIAN_AMX)
      if (m >= kAmxMinTokens && amx_tiles_ready()) {
        amx_block_linear<Format>(xb, m, k, w, n, dst);
        return;
      }
#endif
      for_row_groups(n, row_bytes, [&](int64_t row, int64_t rows) {
        const uint8_t* w_rows = w + row * row_bytes;
        if (m > kMaxTileTokens) {
          const uint16_t* dense = dequantize_rows<Format>(w_rows, rows, row_bytes, k);
          group_tiles(m, row, rows, dst, n, [&](auto r, auto t, int64_t token, float* dots) {
            tile_bf16<decltype(r)::value, decltype(t)::value>(xb + token * k, nullptr, k, dense,
                                                              k, dots);
          });
          return;
        }
        group_tiles(m, row, rows, dst, n, [&](auto r, auto t, int64_t token, float* dots) {
          tile_blocks_bf16<Format, decltype(r)::value, decltype(t)::value>(
              xb + token * k, k, w_rows, row_bytes, dots);
        });
      });
      return;
    }
#endif
    std::vector<float> xf(m * k);
    to_float(x.data_ptr<scalar_t>(), xf.data(), m * k);
    for_row_groups(n, row_bytes, [&](int64_t row, int64_t rows) {
      group_tiles(m, row, rows, dst, n, [&](auto r, auto t, int64_t token, float* dots) {
        tile_blocks<Format, decltype(r)::value, decltype(t)::value>(
            xf.data() + token * k, k, w + row * row_bytes, row_bytes, dots);
      });
    });
  });
  return out;
}

template <typename Format>
at::Tensor block_dequantize(at::Tensor blocks, int64_t in_features, at::ScalarType dtype) {
  check_blocks<Format>(blocks, in_features);
  const int64_t row_bytes = blocks.size(1), n = blocks.size(0);
  const int64_t num_blocks = in_features / kBlockWeights;
  auto out = at::empty({n, in_features}, blocks.options().dtype(dtype));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  dispatch_storage_type(dtype, "block_dequantize", [&](auto type) {
    using scalar_t = decltype(type);
    auto* dst = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kBytesPerTask / row_bytes);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t b = 0; b < num_blocks; ++b) {
          dequantize_block<Format>(w + i * row_bytes + b * Format::kBlockBytes,
                                   dst + i * in_features + b * kBlockWeights);
        }
      }
    });
  });
  return out;
}

}  // namespace

at::Tensor bf16_linear(at::Tensor x, at::Tensor weight) {
  check_linear_args(x, weight);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_linear takes bf16 x and weight");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({m, n}, x.options());
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
#if defined(MERIDIAN_AVX512_BF16)
  const float* xf = nullptr;  // the dot products take x in bf16
#else
  std::vector<float> x_float(m * k);
  to_float(x.data_ptr<at::BFloat16>(), x_float.data(), m * k);
  const float* xf = x_float.data();
#endif
  auto* dst = out.data_ptr<at::BFloat16>();
  for_row_groups(n, 2 * k, [&](int64_t row, int64_t rows) {
    group_tiles(m, row, rows, dst, n, [&](auto r, auto t, int64_t token, float* dots) {
      tile_bf16<decltype(r)::value, decltype(t)::value>(
          xb + token * k, xf == nullptr ? nullptr : xf + token * k, k, w + row * k, k, dots);
    });
  });
  return out;
}

at::Tensor q4_1_linear(at::Tensor x, at::Tensor blocks) {
  return block_linear<Q4_1>(x, blocks);
}

at::Tensor q8_0_linear(at::Tensor x, at::Tensor blocks) {
  return block_linear<Q8_0>(x, blocks);
}

at::Tensor q4_1_dequantize(at::Tensor blocks, int64_t in_features, at::ScalarType dtype) {
  return block_dequantize<Q4_1>(blocks, in_features, dtype);
}

at::Tensor q8_0_dequantize(at::Tensor blocks, int64_t in_features, at::ScalarType dtype) {
  return block_dequantize<Q8_0>(blocks, in_features, dtype);
}

}  // namespace meridian
