// Prefill attention over the paged KV cache on CPU: a chunk of one sequence's prompt attends,
// causally, to the sequence's cached context and to itself, both read from its blocks.
//
// The portable path gathers the keys into one tensor and, with a context, builds a dense mask
// for torch's CPU flash kernel, which then computes the scores above the diagonal too. On
// SmolLM2's heads of 64 (bf16, two Zen 4 cores) it did 55-80 GFLOP/s of useful work; this
// kernel does 165-260 there, and 83-161 in fp32 (bench/prefill_attention.py).
//
// Two passes. First each KV head's keys and values are packed, in chunks of 64 keys, so that a
// vector holds one component of 16 keys (see the formats below). Then one task per (KV head,
// tile of 16 query tokens): the tile's query heads of that KV head are the rows of one small
// matrix, taken six at a time through the key chunks with an online softmax: their 6 x 64
// scores and then their outputs in registers, no horizontal sums. A row block stops at its
// last token's position: the chunks above the diagonal cost nothing. Chunks start at absolute
// key positions and a masked key's weight is exactly 0, so a row's result depends only on its
// query and its keys: not on how its prompt was chunked, nor on what else the step holds.
//
// Layouts: q (T, H, D), each token's heads packed, tokens possibly apart (a view of QKV);
// k_cache, v_cache (num_blocks, block_size, KVH, D); block_ids (blocks of the sequence,) int64,
// covering its context and the chunk, whose own keys are already written; out (T, H, D). The
// cache holds q's dtype or fp8 (kv_cache_dtype "fp8"), widened exactly as it is packed.
// Needs AVX-512 and D a multiple of 64, at most 256 (paged_prefill_supported); the engine
// keeps the portable path elsewhere. With AMX, bf16's products run on tiles (see below).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <limits>
#include <optional>
#include <vector>

namespace meridian {

#if defined(__AVX512F__)
namespace {

constexpr int64_t kTileTokens = 16;  // query tokens per task
constexpr int64_t kChunkKeys = 64;   // keys per step of the online softmax: 4 vectors of scores
constexpr int64_t kChunkVectors = kChunkKeys / 16;
// Rows whose scores (then outputs) are held in registers at once: 24 of the 32 vectors. Six
// rows did 1.3-2x the work of four in fp32 (one load of keys per six FMAs, not four).
constexpr int kBlockRows = 6;
constexpr int kTileRows = 16;  // rows a block on AMX tiles (below)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxHeadDim = 256;  // the packing's per-key buffers

using Scores = __m512[kBlockRows][kChunkVectors];

// The online softmax's step over one chunk's scores of Rows rows: keys after a row's position
// weigh exactly 0; weights[r] the rows' exponentials, correction[r] the factor for what they had
// summed.
template <int Rows>
inline void softmax_step(__m512 (&s)[Rows][kChunkVectors], const int64_t* pos, int64_t c0,
                         float* row_max, float* row_sum, float (&weights)[Rows][kChunkKeys],
                         float* correction) {
  for (int r = 0; r < Rows; ++r) {
    __mmask16 valid[kChunkVectors];
    __m512 chunk_max = _mm512_set1_ps(kNegInf);
    for (int i = 0; i < kChunkVectors; ++i) {
      const int64_t visible = pos[r] - (c0 + i * 16) + 1;
      valid[i] = visible >= 16 ? __mmask16(0xffff)
                 : visible <= 0 ? __mmask16(0)
                                : __mmask16((1u << visible) - 1);
      chunk_max = _mm512_mask_max_ps(chunk_max, valid[i], chunk_max, s[r][i]);
    }
    const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(chunk_max));
    correction[r] = vector_exp(row_max[r] - new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < kChunkVectors; ++i) {
      const __m512 p =
          _mm512_maskz_mov_ps(valid[i], exp16(_mm512_sub_ps(s[r][i], _mm512_set1_ps(new_max))));
      _mm512_store_ps(weights[r] + i * 16, p);
      sum = _mm512_add_ps(sum, p);
    }
    row_sum[r] = row_sum[r] * correction[r] + _mm512_reduce_add_ps(sum);
    row_max[r] = new_max;
  }
}

// 64 components of the block's outputs (at d0), the second product's accumulators.
using Outputs = __m512[kBlockRows][4];

inline void load_rescaled(const float* out, int64_t d, int64_t d0, const float* correction,
                          Outputs& acc) {
  for (int r = 0; r < kBlockRows; ++r) {
    const __m512 c = _mm512_set1_ps(correction[r]);
    for (int i = 0; i < 4; ++i)
      acc[r][i] = _mm512_mul_ps(_mm512_loadu_ps(out + r * d + d0 + i * 16), c);
  }
}

inline void store_outputs(const Outputs& acc, int64_t d, int64_t d0, float* out) {
  for (int r = 0; r < kBlockRows; ++r)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + r * d + d0 + i * 16, acc[r][i]);
}

// fp32 products, for every storage type (bf16 too where the CPU lacks AVX-512 BF16): keys
// widened and transposed, kt[chunk][d][64], values widened, vf[key][d]; queries widened and
// scaled.
struct Fp32Format {
  using Elem = float;
  static int64_t key_elems(int64_t padded_keys, int64_t d) { return padded_keys * d; }
  static int64_t query_elems(int64_t d) { return d; }

  template <typename scalar_t, typename RowOf>
  static void pack_chunk(RowOf row_of, int64_t c0, int64_t num_keys, int64_t d, float* kt,
                         float* vf) {
    std::vector<float> key(d);
    float* kt_chunk = kt + c0 * d;
    for (int64_t j = c0; j < c0 + kChunkKeys; ++j) {
      float* v_row = vf + j * d;
      if (j >= num_keys) {  // padding: zeros, never weighted
        for (int64_t e = 0; e < d; ++e) kt_chunk[e * kChunkKeys + j - c0] = 0.f;
        std::fill(v_row, v_row + d, 0.f);
        continue;
      }
      const auto [k_row, v_src] = row_of(j);
      to_float(k_row, key.data(), d);
      for (int64_t e = 0; e < d; ++e) kt_chunk[e * kChunkKeys + j - c0] = key[e];
      to_float(v_src, v_row, d);
    }
  }

  template <typename scalar_t>
  static void load_query(const scalar_t* q, int64_t d, float scale, float* dst) {
    to_float(q, dst, d);
    for (int64_t e = 0; e < d; ++e) dst[e] *= scale;
  }

  // The block's rows of qf (D apart) at positions pos[] (non-decreasing) over the key chunk
  // at c0: into their running maxima, sums and unnormalized outputs (rows x D).
  static void attend_chunk(const float* qf, const int64_t* pos, const float* kt,
                           const float* vf, int64_t c0, int64_t d, float, float* row_max,
                           float* row_sum, float* out) {
    Scores s;
    for (int r = 0; r < kBlockRows; ++r)
      for (int i = 0; i < kChunkVectors; ++i) s[r][i] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      __m512 k[kChunkVectors];
      for (int i = 0; i < kChunkVectors; ++i) k[i] = _mm512_loadu_ps(kt + e * kChunkKeys + i * 16);
      for (int r = 0; r < kBlockRows; ++r) {
        const __m512 q = _mm512_set1_ps(qf[r * d + e]);
        for (int i = 0; i < kChunkVectors; ++i) s[r][i] = _mm512_fmadd_ps(q, k[i], s[r][i]);
      }
    }
    alignas(64) float weights[kBlockRows][kChunkKeys];
    float correction[kBlockRows];
    softmax_step<kBlockRows>(s, pos, c0, row_max, row_sum, weights, correction);
    const int64_t num_keys = std::min(kChunkKeys, pos[kBlockRows - 1] - c0 + 1);
    for (int64_t d0 = 0; d0 < d; d0 += 64) {
      Outputs acc;
      load_rescaled(out, d, d0, correction, acc);
      for (int64_t j = 0; j < num_keys; ++j) {
        __m512 v[4];
        for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_ps(vf + j * d + d0 + i * 16);
        for (int r = 0; r < kBlockRows; ++r) {
          const __m512 p = _mm512_set1_ps(weights[r][j]);
          for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(p, v[i], acc[r][i]);
        }
      }
      store_outputs(acc, d, d0, out);
    }
  }
};

#if defined(MERIDIAN_AVX512_BF16)
// bf16 storage on CPUs with AVX-512 BF16: the products are vdpbf16ps (pairs of bf16 products
// summed in fp32), twice the fp32 FMA's work an instruction. A 32-bit element holds a pair:
// keys kp[chunk][d / 2][64] (components 2e and 2e + 1 of one key), values vp[key / 2][d]
// (component d of keys 2j and 2j + 1), queries as stored, the scale applied to the scores.
// The softmax weights are rounded to bf16 for the second product, as torch's bf16 kernels do.
struct Bf16Format {
  using Elem = uint32_t;
  static int64_t key_elems(int64_t padded_keys, int64_t d) { return padded_keys * d / 2; }
  static int64_t query_elems(int64_t d) { return d / 2; }

  template <typename scalar_t, typename RowOf>
  static void pack_chunk(RowOf row_of, int64_t c0, int64_t num_keys, int64_t d, uint32_t* kp,
                         uint32_t* vp) {
    const int64_t pairs = d / 2;
    uint32_t* kp_chunk = kp + c0 * pairs;
    for (int64_t j = c0; j < c0 + kChunkKeys; j += 2) {
      uint32_t* v_pair = vp + (j / 2) * d;
      uint16_t v_rows[2][kMaxHeadDim];
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t key = j + h;
        if (key >= num_keys) {  // padding: zeros, never weighted
          for (int64_t e = 0; e < pairs; ++e) kp_chunk[e * kChunkKeys + key - c0] = 0;
          std::fill(v_rows[h], v_rows[h] + d, uint16_t(0));
          continue;
        }
        const auto [k_row, v_src] = row_of(key);
        uint32_t k_pairs[kMaxHeadDim / 2];
        to_bf16_bits(k_row, reinterpret_cast<uint16_t*>(k_pairs), d);
        for (int64_t e = 0; e < pairs; ++e) kp_chunk[e * kChunkKeys + key - c0] = k_pairs[e];
        to_bf16_bits(v_src, v_rows[h], d);
      }
      for (int64_t e = 0; e < d; ++e)
        v_pair[e] = uint32_t(v_rows[0][e]) | uint32_t(v_rows[1][e]) << 16;
    }
  }

  template <typename scalar_t>
  static void load_query(const scalar_t* q, int64_t d, float, uint32_t* dst) {
    std::memcpy(dst, q, d * 2);
  }

  static void attend_chunk(const uint32_t* qp, const int64_t* pos, const uint32_t* kp,
                           const uint32_t* vp, int64_t c0, int64_t d, float scale,
                           float* row_max, float* row_sum, float* out) {
    const int64_t pairs = d / 2;
    Scores s;
    for (int r = 0; r < kBlockRows; ++r)
      for (int i = 0; i < kChunkVectors; ++i) s[r][i] = _mm512_setzero_ps();
    for (int64_t e = 0; e < pairs; ++e) {
      __m512bh k[kChunkVectors];
      for (int i = 0; i < kChunkVectors; ++i)
        k[i] = (__m512bh)_mm512_loadu_si512(kp + e * kChunkKeys + i * 16);
      for (int r = 0; r < kBlockRows; ++r) {
        const __m512bh q = (__m512bh)_mm512_set1_epi32(int(qp[r * pairs + e]));
        for (int i = 0; i < kChunkVectors; ++i) s[r][i] = _mm512_dpbf16_ps(s[r][i], q, k[i]);
      }
    }
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int r = 0; r < kBlockRows; ++r)
      for (int i = 0; i < kChunkVectors; ++i) s[r][i] = _mm512_mul_ps(s[r][i], scale_v);
    alignas(64) float weights[kBlockRows][kChunkKeys];
    float correction[kBlockRows];
    softmax_step<kBlockRows>(s, pos, c0, row_max, row_sum, weights, correction);
    // The weights as bf16 pairs, in key order: wp[r][j / 2].
    alignas(64) uint32_t wp[kBlockRows][kChunkKeys / 2];
    for (int r = 0; r < kBlockRows; ++r)
      for (int i = 0; i < kChunkVectors; i += 2) {
        const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_load_ps(weights[r] + (i + 1) * 16),
                                               _mm512_load_ps(weights[r] + i * 16));
        _mm512_store_si512(wp[r] + i * 8, (__m512i)w);
      }
    const int64_t num_pairs = (std::min(kChunkKeys, pos[kBlockRows - 1] - c0 + 1) + 1) / 2;
    for (int64_t d0 = 0; d0 < d; d0 += 64) {
      Outputs acc;
      load_rescaled(out, d, d0, correction, acc);
      for (int64_t j = 0; j < num_pairs; ++j) {
        __m512bh v[4];
        for (int i = 0; i < 4; ++i)
          v[i] = (__m512bh)_mm512_loadu_si512(vp + j * d + d0 + i * 16);
        for (int r = 0; r < kBlockRows; ++r) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(int(wp[r][j]));
          for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w, v[i]);
        }
      }
      store_outputs(acc, d, d0, out);
    }
  }
};

#if defined(MERIDIAN_AMX)
// Bf16Format's products on AMX tiles, 16 rows at a time (a Sapphire Rapids): a tile product
// multiplies 16 rows by 32 components by 16 keys (or dims) in one instruction, where vdpbf16ps
// does 16 by 2. The packed keys and values are already the tiles' layout: a row of a chunk's
// keys holds one pair of components of 16 keys, a row of values the pair of two keys for 16
// components. Per chunk: the scores into four tiles of 16 keys, the online softmax on AVX-512
// as above, then the weights times the values into tiles of 16 components, added to the rows'
// rescaled outputs. Tiles: 0 the A operand (queries, then weights), 1-2 B (keys, then values),
// 4-7 the products.

inline void scores_tiles(const uint32_t* q, int64_t pairs, const uint32_t* kp) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  constexpr int64_t key_stride = 4 * kChunkKeys;
  for (int64_t e0 = 0; e0 < pairs; e0 += 16) {
    MERIDIAN_TILE_LOAD(0, q + e0, 4 * pairs);
    const uint32_t* k = kp + e0 * kChunkKeys;
    MERIDIAN_TILE_LOAD(1, k, key_stride);
    MERIDIAN_TILE_LOAD(2, k + 16, key_stride);
    _tile_dpbf16ps(4, 0, 1);
    _tile_dpbf16ps(5, 0, 2);
    MERIDIAN_TILE_LOAD(1, k + 32, key_stride);
    MERIDIAN_TILE_LOAD(2, k + 48, key_stride);
    _tile_dpbf16ps(6, 0, 1);
    _tile_dpbf16ps(7, 0, 2);
  }
}

// The weights (16 rows of a chunk's 64 keys, bf16) times 64 components of the chunk's values
// (vp: pairs of keys, d components a row, from component d0).
inline void values_tiles(const uint16_t* weights, const uint32_t* vp, int64_t d) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t half = 0; half < 2; ++half) {
    MERIDIAN_TILE_LOAD(0, weights + half * 32, 2 * kChunkKeys);
    const uint32_t* v = vp + half * 16 * d;
    MERIDIAN_TILE_LOAD(1, v, 4 * d);
    MERIDIAN_TILE_LOAD(2, v + 16, 4 * d);
    _tile_dpbf16ps(4, 0, 1);
    _tile_dpbf16ps(5, 0, 2);
    MERIDIAN_TILE_LOAD(1, v + 32, 4 * d);
    MERIDIAN_TILE_LOAD(2, v + 48, 4 * d);
    _tile_dpbf16ps(6, 0, 1);
    _tile_dpbf16ps(7, 0, 2);
  }
}

inline void store_products(float (*out)[kChunkKeys]) {
  _tile_stored(4, out[0], 4 * kChunkKeys);
  _tile_stored(5, out[0] + 16, 4 * kChunkKeys);
  _tile_stored(6, out[0] + 32, 4 * kChunkKeys);
  _tile_stored(7, out[0] + 48, 4 * kChunkKeys);
}

// Bf16Format::attend_chunk's work for 16 rows (queries as stored, d / 2 pairs a row).
void attend_chunk_tiles(const uint32_t* qp, const int64_t* pos, const uint32_t* kp,
                        const uint32_t* vp, int64_t c0, int64_t d, float scale, float* row_max,
                        float* row_sum, float* out) {
  alignas(64) float products[kTileRows][kChunkKeys];
  scores_tiles(qp, d / 2, kp);
  store_products(products);
  __m512 s[kTileRows][kChunkVectors];
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int r = 0; r < kTileRows; ++r)
    for (int i = 0; i < kChunkVectors; ++i)
      s[r][i] = _mm512_mul_ps(_mm512_load_ps(products[r] + i * 16), scale_v);
  alignas(64) float weights[kTileRows][kChunkKeys];
  float correction[kTileRows];
  softmax_step<kTileRows>(s, pos, c0, row_max, row_sum, weights, correction);
  alignas(64) uint16_t wb[kTileRows][kChunkKeys];  // the weights rounded to bf16, key order
  for (int r = 0; r < kTileRows; ++r)
    for (int i = 0; i < kChunkVectors; i += 2) {
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_load_ps(weights[r] + (i + 1) * 16),
                                             _mm512_load_ps(weights[r] + i * 16));
      _mm512_store_si512(wb[r] + i * 16, (__m512i)w);
    }
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    values_tiles(wb[0], vp + d0, d);
    store_products(products);
    for (int r = 0; r < kTileRows; ++r) {
      const __m512 c = _mm512_set1_ps(correction[r]);
      float* row = out + r * d + d0;
      for (int i = 0; i < 4; ++i) {
        const __m512 v = _mm512_loadu_ps(row + i * 16);
        _mm512_storeu_ps(row + i * 16,
                         _mm512_fmadd_ps(v, c, _mm512_load_ps(products[r] + i * 16)));
      }
    }
  }
}
#endif
#endif

// Whether this call's products run on AMX tiles, 16 rows a block, or on AVX-512, kBlockRows.
template <typename Format>
bool on_tiles() {
#if defined(MERIDIAN_AMX)
  if constexpr (std::is_same_v<Format, Bf16Format>) return amx_tiles_ready();
#endif
  return false;
}

template <typename Format, typename scalar_t, typename cache_t>
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_ids,
                       int64_t num_context, at::Tensor& out, double scale) {
  using Elem = typename Format::Elem;
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t q_stride = q.stride(0);
  const int64_t num_keys = num_context + num_tokens;
  const int64_t num_chunks = (num_keys + kChunkKeys - 1) / kChunkKeys;
  const int64_t head_elems = Format::key_elems(num_chunks * kChunkKeys, head_dim);
  const int64_t query_elems = Format::query_elems(head_dim);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  // Reused between calls: one layer's keys and values of the sequence, packed.
  static thread_local std::vector<Elem> packed;
  if (int64_t(packed.size()) < 2 * num_kv_heads * head_elems)
    packed.resize(2 * num_kv_heads * head_elems);
  Elem* keys_all = packed.data();
  Elem* values_all = keys_all + num_kv_heads * head_elems;

  at::parallel_for(0, num_kv_heads * num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv_head = task / num_chunks, chunk = task % num_chunks;
      const auto row_of = [&](int64_t j) {
        const int64_t slot = ids[j / block_size] * block_size + j % block_size;
        const int64_t base = slot * token_stride + kv_head * head_dim;
        return std::pair{k_ptr + base, v_ptr + base};
      };
      Format::template pack_chunk<cache_t>(row_of, chunk * kChunkKeys, num_keys, head_dim,
                                            keys_all + kv_head * head_elems,
                                            values_all + kv_head * head_elems);
    }
  });

  // Later tiles see more keys: tasks alternate between the ends, so that the contiguous ranges
  // parallel_for hands each thread hold about equal work.
  const int64_t num_tiles = (num_tokens + kTileTokens - 1) / kTileTokens;
  const bool tiles = on_tiles<Format>();
  const int64_t block_rows = tiles ? kTileRows : kBlockRows;
  auto attend = Format::attend_chunk;
#if defined(MERIDIAN_AMX)
  if constexpr (std::is_same_v<Format, Bf16Format>) {
    if (tiles) attend = attend_chunk_tiles;
  }
#endif
  at::parallel_for(0, num_kv_heads * num_tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = (kTileTokens * group + block_rows - 1) / block_rows * block_rows;
#if defined(MERIDIAN_AMX)
    std::optional<AmxTileScope> tile_config;
    if (tiles) tile_config.emplace();
#endif
    std::vector<Elem> queries(max_rows * query_elems);
    std::vector<float> acc(max_rows * head_dim), row_max(max_rows), row_sum(max_rows);
    std::vector<int64_t> pos(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv_head = task % num_kv_heads, slot = task / num_kv_heads;
      const int64_t tile = slot % 2 == 0 ? slot / 2 : num_tiles - 1 - slot / 2;
      const int64_t t0 = tile * kTileTokens;
      const int64_t rows = std::min(kTileTokens, num_tokens - t0) * group;
      // Rows token-major, so positions are non-decreasing; padding repeats the last row.
      const int64_t padded_rows = (rows + block_rows - 1) / block_rows * block_rows;
      for (int64_t r = 0; r < padded_rows; ++r) {
        const int64_t row = std::min(r, rows - 1);
        const int64_t t = t0 + row / group, head = kv_head * group + row % group;
        Format::load_query(q_ptr + t * q_stride + head * head_dim, head_dim, float(scale),
                           queries.data() + r * query_elems);
        pos[r] = num_context + t;
      }
      // Chunk by chunk, every row block of the tile: a chunk's keys and values stay in cache.
      const Elem* keys = keys_all + kv_head * head_elems;
      const Elem* values = values_all + kv_head * head_elems;
      const int64_t chunk_elems = Format::key_elems(kChunkKeys, head_dim);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c0 = 0; c0 <= pos[padded_rows - 1]; c0 += kChunkKeys) {
        const int64_t chunk = c0 / kChunkKeys;
        for (int64_t r0 = 0; r0 < padded_rows; r0 += block_rows) {
          if (pos[r0 + block_rows - 1] < c0) continue;  // above the diagonal
          attend(queries.data() + r0 * query_elems, pos.data() + r0,
                 keys + chunk * chunk_elems, values + chunk * chunk_elems, c0, head_dim,
                 float(scale), row_max.data() + r0, row_sum.data() + r0,
                 acc.data() + r0 * head_dim);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / group, head = kv_head * group + r % group;
        const float inv = 1.f / row_sum[r];  // > 0: key 0 is visible to every row
        float* row = acc.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) row[d] *= inv;
        from_float(row, out_ptr + (t * num_heads + head) * head_dim, head_dim);
      }
    }
  });
}

}  // namespace
#endif

bool paged_prefill_supported(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim % 64 == 0 && head_dim <= kMaxHeadDim;
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache,
                                      at::Tensor v_cache, at::Tensor block_ids,
                                      int64_t num_context, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q (T, H, D) and caches (blocks, block_size, KVH, D)");
  TORCH_CHECK(paged_prefill_supported(q.size(2)), "no prefill kernel for heads of ", q.size(2),
              " on this CPU build");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the caches must share a dtype");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong, "block ids must be int64");
  TORCH_CHECK(num_context >= 0 && q.size(0) > 0, "need at least one query token");
  TORCH_CHECK(block_ids.numel() * k_cache.size(1) >= num_context + q.size(0),
              "the blocks do not cover the context and the chunk");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  block_ids = block_ids.contiguous();
  auto out = at::empty(q.sizes(), q.options());
#if defined(__AVX512F__)
#if defined(MERIDIAN_AVX512_BF16)
  if (q.scalar_type() == at::kBFloat16) {
    const char* op = "paged_prefill_attention";
    dispatch_cache_type<at::BFloat16>(k_cache.scalar_type(), op, [&](auto ct) {
      prefill_attention<Bf16Format, at::BFloat16, decltype(ct)>(q, k_cache, v_cache, block_ids,
                                                                num_context, out, scale);
    });
    return out;
  }
#endif
  dispatch_storage_type(q.scalar_type(), "paged_prefill_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_type<scalar_t>(k_cache.scalar_type(), "paged_prefill_attention", [&](auto ct) {
      prefill_attention<Fp32Format, scalar_t, decltype(ct)>(q, k_cache, v_cache, block_ids,
                                                            num_context, out, scale);
    });
  });
#endif
  return out;
}

}  // namespace meridian
