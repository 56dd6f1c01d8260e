// Block-quantized weights as the kernels read them (gemv_cpu.cpp, amx_cpu.cpp): llama.cpp's
// blocks of 32 weights, their fp16 scales widened to fp32 at load (engine/model/block_weights.py).
#pragma once

#include "cpu_kernels.h"

namespace meridian {

constexpr int64_t kBlockWeights = 32;
// Weight bytes per parallel task: fewer and a parallel region costs more than the rows' reads.
constexpr int64_t kBytesPerTask = 64 * 1024;

inline float fp32_at(const uint8_t* p) {
  float value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

// What a format's block holds, and its 32 weights in fp32: `exact` as gguf's dequantizer rounds
// them (each product and sum rounded), `fused` as the matmul forms them (Q4_1: one FMA).
struct Q4_1 {
  static constexpr const char* kName = "Q4_1";
  static constexpr int64_t kBlockBytes = 24;  // fp32 d, fp32 m, 16 bytes of nibbles

  static void exact(const uint8_t* block, float* w) {
    const float d = fp32_at(block), m = fp32_at(block + 4);
    for (int j = 0; j < 16; ++j) {
      w[j] = float(block[8 + j] & 0x0f) * d;
      w[j + 16] = float(block[8 + j] >> 4) * d;
    }
    for (int j = 0; j < kBlockWeights; ++j) w[j] += m;
  }
#if defined(__AVX512F__)
  static __m512 dequantized(__m128i q, __m512 d, __m512 m, bool fused) {
    const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
    return fused ? _mm512_fmadd_ps(qf, d, m) : _mm512_add_ps(_mm512_mul_ps(qf, d), m);
  }
  // Weights 0-15 in low, 16-31 in high.
  static void weights(const uint8_t* block, __m512& low, __m512& high, bool fused) {
    const __m512 d = _mm512_set1_ps(fp32_at(block)), m = _mm512_set1_ps(fp32_at(block + 4));
    const __m128i low_nibbles = _mm_set1_epi8(0x0f);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 8));
    low = dequantized(_mm_and_si128(qs, low_nibbles), d, m, fused);
    high = dequantized(_mm_and_si128(_mm_srli_epi16(qs, 4), low_nibbles), d, m, fused);
  }
#endif
#if defined(MERIDIAN_AVX512_BF16)
  // The block's 32 weights rounded to bf16, as `weights` (unfused) forms them, for the GEMV
  // loops (gemv_cpu.cpp): a block holds at most 16 values (q = 0..15), so those are formed and
  // rounded once, into both halves of a table, and each weight is the table's entry at its
  // nibble. vpermw reads an index's low 5 bits: a byte's low nibble (weights 0-15) picks the
  // same entry in either half, so only the high nibbles (16-31) need a shift. 10 instructions a
  // block against 16, the same bits. dequantize_block keeps the arithmetic: in the AMX loop the
  // permutes shared a port with the tiles' work and lost (Sapphire Rapids, docs/benchmarks.md).
  static __m512bh bf16_weights(const uint8_t* block) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = _mm512_add_ps(_mm512_mul_ps(q, _mm512_set1_ps(fp32_at(block))),
                                        _mm512_set1_ps(fp32_at(block + 4)));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
    const __m128i quants = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 8));
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(quants));
    const __m512i nibbles = _mm512_mask_srli_epi16(bytes, __mmask32(0xffff0000u), bytes, 4);
    return (__m512bh)_mm512_permutexvar_epi16(nibbles, table);
  }
#endif
};

struct Q8_0 {
  static constexpr const char* kName = "Q8_0";
  static constexpr int64_t kBlockBytes = 36;  // fp32 d, 32 int8

  static void exact(const uint8_t* block, float* w) {
    const float d = fp32_at(block);
    const auto* q = reinterpret_cast<const int8_t*>(block + 4);
    for (int j = 0; j < kBlockWeights; ++j) w[j] = float(q[j]) * d;
  }
#if defined(__AVX512F__)
  static void weights(const uint8_t* block, __m512& low, __m512& high, bool /*fused*/) {
    const __m512 d = _mm512_set1_ps(fp32_at(block));
    auto half = [&](const uint8_t* q) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qs)), d);
    };
    low = half(block + 4);
    high = half(block + 20);
  }
#endif
#if defined(MERIDIAN_AVX512_BF16)
  static __m512bh bf16_weights(const uint8_t* block) {
    __m512 low, high;
    weights(block, low, high, false);
    return _mm512_cvtne2ps_pbh(high, low);
  }
#endif
};

// One block's 32 weights as gguf's dequantizer computes them in fp32, stored rounded to nearest
// even in the output's dtype.
template <typename Format, typename scalar_t>
inline void dequantize_block(const uint8_t* block, scalar_t* dst) {
#if defined(MERIDIAN_AVX512_BF16)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    // 5x the plain loop below (Q4_1 3072x576: 0.4 against 2.2 ms), the same bits.
    __m512 low, high;
    Format::weights(block, low, high, false);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    return;
  }
#endif
  float row[kBlockWeights];
  Format::exact(block, row);
  from_float(row, dst, kBlockWeights);
}

#if defined(MERIDIAN_AMX)
// out (m, n) = x (m, k) W^T for W as n rows of Format's blocks, x bf16, on AMX tiles (amx_cpu.cpp).
template <typename Format>
void amx_block_linear(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                      at::BFloat16* out);
#endif

}  // namespace meridian
