// Shared by the CPU kernels: the ops each file defines (bound in bindings_cpu.cpp) and the
// small numeric helpers they share.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace meridian {

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale);

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

}  // namespace meridian
