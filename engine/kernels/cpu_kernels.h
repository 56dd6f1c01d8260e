// Shared by the CPU kernels: the ops each file defines (bound in bindings_cpu.cpp) and the
// small numeric helpers they share.
#pragma once

// ATen's tensor and the two factories the kernels call, not <torch/extension.h>: that one
// (torch's whole C++ API and pybind11) took 19 of each file's 21 s to compile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MERIDIAN_AVX512_BF16 1
#endif
#if defined(MERIDIAN_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MERIDIAN_AMX 1
#endif

namespace meridian {

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens,
                                     double scale);
bool paged_prefill_supported(int64_t head_dim);
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache,
                                      at::Tensor v_cache, at::Tensor block_ids,
                                      int64_t num_context, double scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                           double eps);
void rope_and_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                       at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                       int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor bf16_linear(at::Tensor x, at::Tensor weight);
at::Tensor q4_1_linear(at::Tensor x, at::Tensor blocks);
at::Tensor q4_1_dequantize(at::Tensor blocks, int64_t in_features, at::ScalarType dtype);
at::Tensor q8_0_linear(at::Tensor x, at::Tensor blocks);
at::Tensor q8_0_dequantize(at::Tensor blocks, int64_t in_features, at::ScalarType dtype);
// Whether this process may use AMX tiles (amx_cpu.cpp): built for them, and granted by the OS.
bool amx_tiles_ready();
std::vector<at::Tensor> decode_layers(at::Tensor x, std::vector<at::Tensor> weights,
                                         std::vector<at::Tensor> kv_caches, at::Tensor cos,
                                         at::Tensor sin, at::Tensor slot_mapping,
                                         at::Tensor block_tables, at::Tensor context_lens,
                                         int64_t num_heads, double eps, double scale);

// exp(x) within 2 ulp, written so that a loop of it vectorizes (glibc declares its vector exp
// only under -ffast-math, which we do not build with). x = n ln2 + r, |r| <= ln2/2:
// exp(x) = 2^n exp(r), exp(r) by its Taylor polynomial. x is clamped to [-87, 88]: -inf gives
// ~1e-38 instead of 0 (no softmax weight or rescale can tell them apart), +inf ~1.6e38.
inline float vector_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  // ln2 split in two for accuracy; fma, so that reassociation cannot merge the halves again.
  const float r = std::fma(n, 2.12194440e-4f, std::fma(n, -0.693359375f, x));
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

// bf16 is the top half of an fp32: widening by hand lets the compiler vectorize the loop.
inline void to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t wide = uint32_t(bits[i]) << 16;
    std::memcpy(dst + i, &wide, sizeof(float));
  }
}

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

inline void to_float(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}

// An 8-bit KV cache (kv_cache_dtype "fp8"): float8_e4m3fn, no scale, as vLLM's default.
using Fp8 = c10::Float8_e4m3fn;
constexpr float kFp8Max = 448.f;  // e4m3fn's largest finite value; beyond it a cast gives NaN

inline void to_float(const Fp8* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}

// Saturating, as engine/model/kv_quant.py quantizes: the same bits on both paths.
inline void from_float(const float* src, Fp8* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Fp8(std::min(std::max(src[i], -kFp8Max), kFp8Max));
}

// A KV row as bf16 bits, for kernels that multiply bf16 pairs: exact from fp8 (3 mantissa
// bits, 4 exponent bits, all held by bf16's 7 and 8).
inline void to_bf16_bits(const at::BFloat16* src, uint16_t* dst, int64_t n) {
  std::memcpy(dst, src, n * 2);
}
inline void to_bf16_bits(const Fp8* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = float(src[i]);
    uint32_t wide;
    std::memcpy(&wide, &x, sizeof(float));
    dst[i] = uint16_t(wide >> 16);
  }
}

// Rounds to the storage type as torch does (bf16: round to nearest even), so that an op that
// rounds between steps, as the eager path does, gives the same bits.
inline void from_float(const float* src, at::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t wide;
    std::memcpy(&wide, src + i, sizeof(float));
    // NaN stays NaN (quiet); everything else rounds to nearest, ties to even.
    bits[i] = std::isnan(src[i]) ? uint16_t(0x7fc0)
                                 : uint16_t((wide + 0x7fffu + ((wide >> 16) & 1u)) >> 16);
  }
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

inline void from_float(const float* src, at::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = at::Half(src[i]);
}

// Round a float buffer through the storage type in place: what an eager op's output holds.
template <typename scalar_t>
inline void round_to(float* buf, scalar_t* scratch, int64_t n) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    from_float(buf, scratch, n);
    to_float(scratch, buf, n);
  }
}

// Calls fn(scalar_t{}) for the storage types the kernels support (fp32, bf16, fp16).
template <typename Fn>
void dispatch_storage_type(at::ScalarType type, const char* op, Fn&& fn) {
  switch (type) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    case at::kHalf: fn(at::Half{}); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16, not ", type);
  }
}

// Calls fn(cache_t{}) for a KV cache holding `cache_type` beside activations of `scalar_t`:
// the activations' own type, or fp8.
template <typename scalar_t, typename Fn>
void dispatch_cache_type(at::ScalarType cache_type, const char* op, Fn&& fn) {
  if (cache_type == at::kFloat8_e4m3fn) {
    fn(Fp8{});
  } else {
    TORCH_CHECK(cache_type == c10::CppTypeToScalarType<scalar_t>::value, op,
                ": the KV cache holds ", cache_type, ", neither the activations' dtype nor fp8");
    fn(scalar_t{});
  }
}

#if defined(__AVX512F__)
// 16 lanes of a storage type widened to fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// e4m3fn moved into fp16's fields (sign to bit 15, exponent and mantissa shifted up 7) is the
// same number times 2^-8 (the biases differ by 8), subnormals included; no NaN is ever stored.
// load16_scaled gives that (lanes times kLoadScale<T>), for loops that fold the 2^8 into their
// other operand once; a power of two, so the products round as the true values' do.
template <typename T>
constexpr float kLoadScale = std::is_same_v<T, Fp8> ? 256.f : 1.f;
inline __m512 load16_scaled(const Fp8* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}
template <typename T>
inline __m512 load16_scaled(const T* p) {
  return load16(p);
}

// vector_exp on 16 lanes (the same polynomial).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.98412698e-4f);
  for (float c : {1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f,
                  1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(MERIDIAN_AMX)
// A tile load, after every store before it. GCC's _tile_loadd is an asm statement that does not
// tell the compiler it reads memory: the stores that fill its source may be moved past it, or
// dropped as dead (a decode kernel's queries were, and its scores came out NaN).
#define MERIDIAN_TILE_LOAD(tile, base, stride) \
  do {                                         \
    asm volatile("" ::: "memory");             \
    _tile_loadd(tile, base, stride);           \
  } while (0)

// The calling thread's AMX tile configuration while in scope (amx_cpu.cpp): every tile 16 rows
// of 64 bytes, what the kernels' tile products use.
struct AmxTileScope {
  AmxTileScope();
  ~AmxTileScope();
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
};
#endif

}  // namespace meridian
