// Block weights times a few bf16 tokens on AMX tiles (Intel Sapphire Rapids and later).
//
// Over four tokens the block kernel (gemv_cpu.cpp) dequantizes each group of weight rows to bf16
// in L1 and multiplies them with every token there. With AVX-512 BF16 alone the multiplying is
// one vdpbf16ps per 32 weights and token, so its cost grows with the tokens; from about 8 tokens
// oneDNN's AMX GEMM on the dense bf16 weight overtook it, reading 2.7x the blocks' bytes from
// memory. A tile product multiplies 16 rows by 32 weights by 16 tokens in one instruction, so
// here dequantizing is the cost, paid once for up to 32 tokens, and the weights are read as
// blocks.
//
// A group is 32 weight rows. Block by block, the group's 32 blocks are dequantized into a 2 KB
// buffer (two A tiles: rows 0-15 and 16-31, 32 weights each), then multiplied with the tokens'
// B tiles: x transposed into pairs (row p of a B tile holds, for each of 16 tokens, x's columns
// 2p and 2p + 1 of the block), into C tiles of 16 rows by 16 tokens in fp32. Two buffers in
// turn, so that dequantizing the next block does not wait for the tiles to load this one.
// Products of bf16 pairs summed in fp32, as vdpbf16ps sums them, in another order.
#include "block_formats.h"

#include <ATen/Parallel.h>

#if defined(MERIDIAN_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace meridian {

#if defined(MERIDIAN_AMX)
namespace {

// Linux hands a process AMX's 8 KB of tile state only once asked (arch_prctl, since 5.16).
constexpr int kArchRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr int kTileDataFeature = 18;            // XFEATURE_XTILEDATA

constexpr int64_t kGroupRows = 32;    // weight rows of a group: two A tiles
constexpr int64_t kPassTokens = 32;   // tokens of one pass over a group's blocks: two B tiles
constexpr int64_t kTileTokens = 16;   // tokens of a B tile

// ldtilecfg's 64 bytes: palette 1, every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

const TileConfig& tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  return config;
}

// Tiles: A0, A1 a block of the group's rows 0-15 and 16-31; B0, B1 two tiles of 16 tokens; Cab
// the dot products of Aa with Bb. Macros: the intrinsics paste a tile's number into their
// assembly, so it must be a literal once expanded.
#define MERIDIAN_A0 0
#define MERIDIAN_A1 1
#define MERIDIAN_B0 2
#define MERIDIAN_B1 3
#define MERIDIAN_C00 4
#define MERIDIAN_C01 5
#define MERIDIAN_C10 6
#define MERIDIAN_C11 7

// x (m, k) bf16 -> xt (k / 2, m_pad) of bf16 pairs, the tokens past m zero.
void pack_tokens(const uint16_t* x, int64_t m, int64_t k, uint32_t* xt, int64_t m_pad) {
  const auto* pairs = reinterpret_cast<const uint32_t*>(x);
  const int64_t num_pairs = k / 2;
  for (int64_t p = 0; p < num_pairs; ++p) {
    uint32_t* row = xt + p * m_pad;
    for (int64_t t = 0; t < m; ++t) row[t] = pairs[t * num_pairs + p];
    std::fill(row + m, row + m_pad, 0u);
  }
}

// One pass of a group over its blocks for the 16 (or, TwoTokenTiles, 32) tokens from `token`:
// dots (kGroupRows, m_pad) fp32 for them. `buffers` hold two blocks of the group's rows, bf16;
// rows past `rows` stay zero.
template <typename Format, bool TwoTokenTiles>
void group_pass(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t k,
                const uint32_t* xt, int64_t m_pad, int64_t token,
                uint16_t (*buffers)[kGroupRows * kBlockWeights], float* dots) {
  _tile_zero(MERIDIAN_C00);
  _tile_zero(MERIDIAN_C10);
  if constexpr (TwoTokenTiles) {
    _tile_zero(MERIDIAN_C01);
    _tile_zero(MERIDIAN_C11);
  }
  constexpr int64_t kRowStride = 2 * kBlockWeights;  // bytes between a buffer's rows
  const int64_t x_stride = 4 * m_pad;
  const int64_t num_blocks = k / kBlockWeights;
  const uint8_t* next_group = w + kGroupRows * row_bytes;
  const int64_t prefetch_lines = (kGroupRows * row_bytes / 64 + num_blocks - 1) / num_blocks;
  for (int64_t b = 0; b < num_blocks; ++b) {
    uint16_t* a = buffers[b % 2];
    const uint8_t* block = w + b * Format::kBlockBytes;
    // The next group's rows, a share each block: the group's loop reads 32 rows side by side,
    // which the hardware prefetcher does not follow.
    for (int64_t line = b * prefetch_lines; line < (b + 1) * prefetch_lines; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(next_group + line * 64), _MM_HINT_T0);
    }
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_block<Format>(block + r * row_bytes,
                               reinterpret_cast<at::BFloat16*>(a + r * kBlockWeights));
    }
    const uint32_t* x_block = xt + b * (kBlockWeights / 2) * m_pad + token;
    MERIDIAN_TILE_LOAD(MERIDIAN_A0, a, kRowStride);
    MERIDIAN_TILE_LOAD(MERIDIAN_A1, a + kTileTokens * kBlockWeights, kRowStride);
    MERIDIAN_TILE_LOAD(MERIDIAN_B0, x_block, x_stride);
    _tile_dpbf16ps(MERIDIAN_C00, MERIDIAN_A0, MERIDIAN_B0);
    _tile_dpbf16ps(MERIDIAN_C10, MERIDIAN_A1, MERIDIAN_B0);
    if constexpr (TwoTokenTiles) {
      MERIDIAN_TILE_LOAD(MERIDIAN_B1, x_block + kTileTokens, x_stride);
      _tile_dpbf16ps(MERIDIAN_C01, MERIDIAN_A0, MERIDIAN_B1);
      _tile_dpbf16ps(MERIDIAN_C11, MERIDIAN_A1, MERIDIAN_B1);
    }
  }
  float* lower = dots + kTileTokens * m_pad;  // rows 16-31
  _tile_stored(MERIDIAN_C00, dots + token, x_stride);
  _tile_stored(MERIDIAN_C10, lower + token, x_stride);
  if constexpr (TwoTokenTiles) {
    _tile_stored(MERIDIAN_C01, dots + token + kTileTokens, x_stride);
    _tile_stored(MERIDIAN_C11, lower + token + kTileTokens, x_stride);
  }
}

// out[t][row + r] = dots[r][t] rounded to bf16, for the group's rows.
void store_transposed(const float* dots, int64_t m_pad, int64_t m, int64_t rows,
                      at::BFloat16* out, int64_t n) {
  const __m512i row_offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(int32_t(m_pad)));
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const __mmask16 mask = rows - r0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (rows - r0)) - 1);
    for (int64_t t = 0; t < m; ++t) {
      const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, row_offsets,
                                                     dots + r0 * m_pad + t, 4);
      _mm256_mask_storeu_epi16(out + t * n + r0, mask, (__m256i)_mm512_cvtneps_pbh(column));
    }
  }
}

}  // namespace

AmxTileScope::AmxTileScope() { _tile_loadconfig(&tile_config()); }
AmxTileScope::~AmxTileScope() { _tile_release(); }

bool amx_tiles_ready() {
  static const bool ready =
      syscall(SYS_arch_prctl, kArchRequestPermission, kTileDataFeature) == 0;
  return ready;
}

template <typename Format>
void amx_block_linear(const uint16_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                      at::BFloat16* out) {
  const int64_t row_bytes = k / kBlockWeights * Format::kBlockBytes;
  const int64_t m_pad = (m + kTileTokens - 1) / kTileTokens * kTileTokens;
  std::vector<uint32_t> xt(k / 2 * m_pad);
  pack_tokens(x, m, k, xt.data(), m_pad);
  const int64_t num_groups = (n + kGroupRows - 1) / kGroupRows;
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / (kGroupRows * row_bytes));
  at::parallel_for(0, num_groups, grain, [&](int64_t begin, int64_t end) {
    AmxTileScope tiles;
    alignas(64) uint16_t buffers[2][kGroupRows * kBlockWeights] = {};
    std::vector<float> dots(kGroupRows * m_pad);
    for (int64_t group = begin; group < end; ++group) {
      const int64_t row = group * kGroupRows;
      const int64_t rows = std::min(kGroupRows, n - row);
      if (rows < kGroupRows) {  // the rows past the weight's stay zero
        for (auto& buffer : buffers) std::fill(std::begin(buffer), std::end(buffer), 0);
      }
      const uint8_t* w_rows = w + row * row_bytes;
      int64_t token = 0;
      for (; token + kPassTokens <= m_pad; token += kPassTokens) {
        group_pass<Format, true>(w_rows, row_bytes, rows, k, xt.data(), m_pad, token, buffers,
                                 dots.data());
      }
      if (token < m_pad) {
        group_pass<Format, false>(w_rows, row_bytes, rows, k, xt.data(), m_pad, token, buffers,
                                  dots.data());
      }
      store_transposed(dots.data(), m_pad, m, rows, out + row, n);
    }
  });
}

template void amx_block_linear<Q4_1>(const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t,
                                     at::BFloat16*);
template void amx_block_linear<Q8_0>(const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t,
                                     at::BFloat16*);

#else

bool amx_tiles_ready() { return false; }

#endif

}  // namespace meridian
