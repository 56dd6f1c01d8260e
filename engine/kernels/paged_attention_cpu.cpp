// Decode attention over the paged KV cache on CPU: one query token per sequence, keys and
// values read in place from the sequence's blocks. Gathering the blocks into a padded tensor
// first (the portable path) copies every key and value once more per layer and step.
//
// One task per (sequence, KV head, part of its context): its query heads share every key and
// value read. A context longer than kMaxTokensPerPart is split into parts of equal whole blocks,
// each an online softmax of its own, merged after (max, sum and weighted values combine as the
// blocks' do): at batch 1 SmolLM2's three KV heads were three tasks for two threads, and a long
// context one thread's work (a layer at batch 1: 1.3x faster at 370 tokens, 1.6x at 700; the
// parts' setup and merging cost steps of 8-32 sequences past 512 tokens 3-5%). With AVX-512
// and the common head shapes (head_dim 64 or 128, a few query heads per KV head) the queries
// and accumulators stay in registers and each key and value is widened to fp32 as it is
// loaded; otherwise a plain loop over fp32 copies of each block, left to the vectorizer. Either
// way a sequence's result does not depend on what else the step holds: its parts follow from
// its own length.
//
// The cache holds q's dtype or fp8 (kv_cache_dtype "fp8"), widened to fp32 as it is read, so
// an 8-bit cache halves the bytes a step reads here.
//
// Layouts: q (B, H, D); k_cache, v_cache (num_blocks, block_size, KVH, D);
// block_tables (B, max_blocks) int64; context_lens (B,) int64; out (B, H, D).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <limits>
#include <optional>
#include <vector>

namespace meridian {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Context tokens (of one KV head) worth a thread of their own: ~15 us of reading from memory
// (SmolLM2's heads of 64 in bf16), several times what a parallel region costs.
constexpr int64_t kMinTokensPerThread = 512;
// The most context tokens one task reads (a longer context is split, above).
constexpr int64_t kMaxTokensPerPart = 512;

// The running state of one query head's online softmax over the blocks of its context.
struct HeadState {
  float max;
  float denom;
};

// One task: a KV head of a sequence over its blocks from `first_block` (`num_tokens` tokens).
// Where that is a part of a split context, `partial` indexes its slot in the parts' buffers
// and `merge` the context's entry in the plan's merges; else both are -1 (the task writes the
// output itself).
struct AttendTask {
  int64_t seq, kv_head, first_block, num_tokens, partial, merge;
};

// A split context's parts: tasks [first, first + num_parts), partial slots likewise.
struct PartsMerge {
  int64_t first, num_parts;
};

struct AttendPlan {
  std::vector<AttendTask> tasks;
  std::vector<PartsMerge> merges;
  std::vector<uint8_t> merged;  // per merge: done inside the parallel region
  int64_t num_partials = 0;
};

// The tasks of a step: per sequence and KV head, its context in parts of equal whole blocks.
void plan_attention(const int64_t* lens, int64_t num_seqs, int64_t num_kv_heads,
                    int64_t block_size, AttendPlan& plan) {
  plan.tasks.clear();
  plan.merges.clear();
  plan.num_partials = 0;
  const int64_t max_blocks_per_part = std::max<int64_t>(1, kMaxTokensPerPart / block_size);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t blocks = (lens[seq] + block_size - 1) / block_size;
    const int64_t parts = std::max<int64_t>(1, (blocks + max_blocks_per_part - 1) /
                                                   max_blocks_per_part);
    const int64_t blocks_per_part = std::max<int64_t>(1, (blocks + parts - 1) / parts);
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      const int64_t merge = parts > 1 ? int64_t(plan.merges.size()) : -1;
      if (parts > 1) plan.merges.push_back({int64_t(plan.tasks.size()), parts});
      for (int64_t first = 0; first < std::max<int64_t>(blocks, 1); first += blocks_per_part) {
        const int64_t tokens =
            std::min(lens[seq], (first + blocks_per_part) * block_size) - first * block_size;
        const int64_t partial = parts > 1 ? plan.num_partials++ : -1;
        plan.tasks.push_back({seq, kv_head, first, tokens, partial, merge});
      }
    }
  }
  plan.merged.assign(plan.merges.size(), 0);
}

// Out (the G query heads of one KV head) = the weighted values over their softmax sums.
template <typename scalar_t>
void write_normalized(const HeadState* state, float* acc, int64_t group, int64_t head_dim,
                      scalar_t* out) {
  for (int64_t g = 0; g < group; ++g) {
    const float inv = state[g].denom > 0.f ? 1.f / state[g].denom : 0.f;
    float* ag = acc + g * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) ag[d] *= inv;
    from_float(ag, out + g * head_dim, head_dim);
  }
}

// The parts of a split context into the first's state and values, each part rescaled to the
// largest score among them; then written out.
template <typename scalar_t>
void merge_parts(HeadState* states, float* accs, int64_t num_parts, int64_t group,
                 int64_t head_dim, scalar_t* out) {
  for (int64_t g = 0; g < group; ++g) {
    float max = kNegInf;
    for (int64_t p = 0; p < num_parts; ++p) max = std::max(max, states[p * group + g].max);
    float* merged = accs + g * head_dim;
    float weight = vector_exp(states[g].max - max);
    float denom = states[g].denom * weight;
    for (int64_t d = 0; d < head_dim; ++d) merged[d] *= weight;
    for (int64_t p = 1; p < num_parts; ++p) {
      weight = vector_exp(states[p * group + g].max - max);
      denom += states[p * group + g].denom * weight;
      const float* acc = accs + (p * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) merged[d] += acc[d] * weight;
    }
    states[g] = {max, denom};
  }
  write_normalized(states, accs, group, head_dim, out);
}

// Portable: one (sequence, KV head) over its blocks, the loops left to the vectorizer.
template <typename scalar_t>
void attend_portable(const float* qf, const scalar_t* k_ptr, const scalar_t* v_ptr,
                     const int64_t* table, int64_t len, int64_t block_size, int64_t token_stride,
                     int64_t kv_offset, int64_t group, int64_t head_dim, float* kf, float* vf,
                     float* scores, HeadState* state, float* acc) {
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t n = std::min(block_size, len - start);
    const int64_t base = table[start / block_size] * block_size * token_stride + kv_offset;
    for (int64_t t = 0; t < n; ++t) {
      to_float(k_ptr + base + t * token_stride, kf + t * head_dim, head_dim);
      to_float(v_ptr + base + t * token_stride, vf + t * head_dim, head_dim);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * head_dim;
      float block_max = kNegInf;
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = kf + t * head_dim;
        float s = 0.f;
        for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kt[d];
        scores[t] = s;
        block_max = std::max(block_max, s);
      }
      const float new_max = std::max(state[g].max, block_max);
      const float correction = vector_exp(state[g].max - new_max);
      float* ag = acc + g * head_dim;
      state[g].denom *= correction;
      for (int64_t d = 0; d < head_dim; ++d) ag[d] *= correction;
      for (int64_t t = 0; t < n; ++t) scores[t] = vector_exp(scores[t] - new_max);
      for (int64_t t = 0; t < n; ++t) {
        const float p = scores[t];
        state[g].denom += p;
        const float* vt = vf + t * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vt[d];
      }
      state[g].max = new_max;
    }
  }
}

#if defined(__AVX512F__)
// One (sequence, KV head) with AVX-512: a head is NV vectors of 16, its queries (G of them) and
// accumulators held in registers, each key and value read once for all G query heads.
//
// Tiles (AMX, bf16 cache, heads of 64, blocks a multiple of 16): the scores of 16 keys at a time
// are one tile product of their rows as stored (an A tile of 16 keys by 32 components, the slot
// stride apart) with the queries transposed into pairs (B, resident for the task), instead of a
// horizontal sum per key and query head; the products summed in fp32 (bf16 times bf16 is exact),
// then scaled. The values' half stays on AVX-512.
template <int NV, int G, typename scalar_t, bool Tiles = false>
void attend_avx512(const float* qf, const uint16_t* q_bits, const scalar_t* k_ptr,
                   const scalar_t* v_ptr, const int64_t* table, int64_t len, int64_t block_size,
                   int64_t token_stride, int64_t kv_offset, float scale, float* scores,
                   HeadState* state, float* acc_out) {
  // Keys and values load as kLoadScale times their value (fp8: 2^-8 of it, one multiply saved
  // per 16): the queries and the outputs take the factor back, exactly.
  const __m512 load_scale = _mm512_set1_ps(kLoadScale<scalar_t>);
  __m512 qv[G][NV], acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) {
      qv[g][i] = _mm512_mul_ps(_mm512_loadu_ps(qf + (g * NV + i) * 16), load_scale);
      acc[g][i] = _mm512_setzero_ps();
    }
#if defined(MERIDIAN_AMX)
  if constexpr (Tiles) {
    static_assert(NV == 4 && G <= 16, "the tiles' path holds heads of 64");
    // The queries as B tiles: row e holds components 2e and 2e + 1 of each query head.
    alignas(64) uint32_t qt[32][16] = {};
    const auto* q_pairs = reinterpret_cast<const uint32_t*>(q_bits);
    for (int g = 0; g < G; ++g)
      for (int e = 0; e < 32; ++e) qt[e][g] = q_pairs[g * 32 + e];
    MERIDIAN_TILE_LOAD(2, qt[0], 64);
    MERIDIAN_TILE_LOAD(3, qt[16], 64);
  }
#endif
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t n = std::min(block_size, len - start);
    const int64_t base = table[start / block_size] * block_size * token_stride + kv_offset;
#if defined(MERIDIAN_AMX)
    if constexpr (Tiles) {
      alignas(64) float s16[16][16];
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const scalar_t* kt = k_ptr + base + t0 * token_stride;
        MERIDIAN_TILE_LOAD(0, kt, 2 * token_stride);
        MERIDIAN_TILE_LOAD(1, kt + 32, 2 * token_stride);
        _tile_zero(4);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(4, 1, 3);
        _tile_stored(4, s16[0], 64);
        for (int64_t t = t0; t < std::min(n, t0 + 16); ++t)
          for (int g = 0; g < G; ++g) scores[g * block_size + t] = s16[t - t0][g] * scale;
      }
    } else
#endif
    {
      (void)q_bits;
      (void)scale;
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* kt = k_ptr + base + t * token_stride;
        __m512 kv[NV];
        for (int i = 0; i < NV; ++i) kv[i] = load16_scaled(kt + i * 16);
        for (int g = 0; g < G; ++g) {
          __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);
          for (int i = 1; i < NV; ++i) s = _mm512_fmadd_ps(qv[g][i], kv[i], s);
          scores[g * block_size + t] = _mm512_reduce_add_ps(s);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      float* sg = scores + g * block_size;
      float block_max = kNegInf;
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sg[t]);
      const float new_max = std::max(state[g].max, block_max);
      const __m512 correction = _mm512_set1_ps(vector_exp(state[g].max - new_max));
      for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], correction);
      float sum = 0.f;
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const __mmask16 mask = n - t0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - t0)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(mask, sg + t0);
        const __m512 p = exp16(_mm512_sub_ps(x, _mm512_set1_ps(new_max)));
        _mm512_mask_storeu_ps(sg + t0, mask, p);
        sum += _mm512_mask_reduce_add_ps(mask, p);
      }
      state[g].denom = state[g].denom * _mm512_cvtss_f32(correction) + sum;
      state[g].max = new_max;
    }
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* vt = v_ptr + base + t * token_stride;
      __m512 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load16_scaled(vt + i * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * block_size + t]);
        for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(p, vv[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i)
      _mm512_storeu_ps(acc_out + (g * NV + i) * 16, _mm512_mul_ps(acc[g][i], load_scale));
}

template <typename scalar_t>
using AvxAttend = void (*)(const float*, const uint16_t*, const scalar_t*, const scalar_t*,
                           const int64_t*, int64_t, int64_t, int64_t, int64_t, float, float*,
                           HeadState*, float*);

// Whether a call of these types and shapes takes the tiles' scores.
template <typename scalar_t, typename cache_t>
bool decode_on_tiles(int64_t head_dim, int64_t group, int64_t block_size) {
#if defined(MERIDIAN_AMX)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>)
    return head_dim == 64 && group <= 4 && block_size % 16 == 0 && amx_tiles_ready();
#endif
  (void)head_dim, (void)group, (void)block_size;
  return false;
}

// The register-held shapes: heads of 64 or 128, 1 to 4 query heads per KV head.
template <typename scalar_t>
AvxAttend<scalar_t> avx512_attend_for(int64_t head_dim, int64_t group, bool tiles) {
#if defined(MERIDIAN_AMX)
  if (tiles) {
    switch (group) {
      case 1: return attend_avx512<4, 1, scalar_t, true>;
      case 2: return attend_avx512<4, 2, scalar_t, true>;
      case 3: return attend_avx512<4, 3, scalar_t, true>;
      case 4: return attend_avx512<4, 4, scalar_t, true>;
    }
  }
#endif
  (void)tiles;
  if (head_dim == 64) {
    switch (group) {
      case 1: return attend_avx512<4, 1, scalar_t>;
      case 2: return attend_avx512<4, 2, scalar_t>;
      case 3: return attend_avx512<4, 3, scalar_t>;
      case 4: return attend_avx512<4, 4, scalar_t>;
    }
  } else if (head_dim == 128) {
    switch (group) {
      case 1: return attend_avx512<8, 1, scalar_t>;
      case 2: return attend_avx512<8, 2, scalar_t>;
    }
  }
  return nullptr;
}
#endif

template <typename scalar_t, typename cache_t>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, at::Tensor& out, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t q_stride = q.stride(0);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
#if defined(__AVX512F__)
  const bool tiles = decode_on_tiles<scalar_t, cache_t>(head_dim, group, block_size);
  const AvxAttend<cache_t> fast = avx512_attend_for<cache_t>(head_dim, group, tiles);
#endif

  // The calling thread's, kept between calls (named by reference: inside the parallel region
  // the thread_locals' own names would be each worker's). At batch 32 fresh buffers were large
  // enough to be mapped anew, and faulted in, at every layer.
  thread_local AttendPlan thread_plan;
  thread_local std::vector<HeadState> thread_states;
  thread_local std::vector<float> thread_accs;
  AttendPlan& plan = thread_plan;
  plan_attention(lens, num_seqs, num_kv_heads, block_size, plan);
  thread_states.resize(plan.num_partials * group);
  thread_accs.resize(plan.num_partials * group * head_dim);
  HeadState* const partial_states = thread_states.data();
  float* const partial_accs = thread_accs.data();
  const std::vector<AttendTask>& tasks = plan.tasks;
  auto merge_split = [&](const PartsMerge& parts) {
    const AttendTask& first = tasks[parts.first];
    scalar_t* dst = out_ptr + (first.seq * num_heads + first.kv_head * group) * head_dim;
    merge_parts(partial_states + first.partial * group,
                partial_accs + first.partial * group * head_dim, parts.num_parts, group,
                head_dim, dst);
  };
  // A step with little context to read runs on the calling thread: a parallel region costs more
  // than it saves there, and far more when another process holds the other core.
  int64_t num_tokens = 0;
  for (const AttendTask& task : tasks) num_tokens += task.num_tokens;
  const int64_t tokens_per_task = std::max<int64_t>(1, num_tokens / int64_t(tasks.size()));
  const int64_t grain = std::max<int64_t>(1, kMinTokensPerThread / tokens_per_task);
  at::parallel_for(0, int64_t(tasks.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), kf(block_size * head_dim),
        vf(block_size * head_dim), scores(group * block_size);
    std::vector<HeadState> state(group);
#if defined(MERIDIAN_AMX) && defined(__AVX512F__)
    std::optional<AmxTileScope> tile_config;
    if (tiles) tile_config.emplace();
#endif
    for (int64_t i = begin; i < end; ++i) {
      const AttendTask& task = tasks[i];
      // A part's state goes straight to its slot; a whole context's stays here.
      HeadState* task_state = state.data();
      float* task_acc = acc.data();
      if (task.partial >= 0) {
        task_state = partial_states + task.partial * group;
        task_acc = partial_accs + task.partial * group * head_dim;
      }
      const scalar_t* q_head = q_ptr + task.seq * q_stride + task.kv_head * group * head_dim;
      to_float(q_head, qf.data(), group * head_dim);
      for (float& x : qf) x *= scale;
      std::fill(task_state, task_state + group, HeadState{kNegInf, 0.f});
      std::fill(task_acc, task_acc + group * head_dim, 0.f);
      const int64_t* table = tables + task.seq * max_blocks + task.first_block;
      const int64_t kv_offset = task.kv_head * head_dim;
#if defined(__AVX512F__)
      if (fast != nullptr) {
        fast(qf.data(), reinterpret_cast<const uint16_t*>(q_head), k_ptr, v_ptr, table,
             task.num_tokens, block_size, token_stride, kv_offset, float(scale), scores.data(),
             task_state, task_acc);
      } else
#endif
      {
        attend_portable(qf.data(), k_ptr, v_ptr, table, task.num_tokens, block_size,
                        token_stride, kv_offset, group, head_dim, kf.data(), vf.data(),
                        scores.data(), task_state, task_acc);
      }
      if (task.partial < 0) {
        scalar_t* dst = out_ptr + (task.seq * num_heads + task.kv_head * group) * head_dim;
        write_normalized(task_state, task_acc, group, head_dim, dst);
        continue;
      }
      // The context's last part, with all its parts done on this thread: merged while they
      // are in cache (a context split across two threads' ranges is merged after).
      const PartsMerge& parts = plan.merges[task.merge];
      if (i == parts.first + parts.num_parts - 1 && parts.first >= begin) {
        merge_split(parts);
        plan.merged[task.merge] = 1;
      }
    }
  });
  for (size_t i = 0; i < plan.merges.size(); ++i) {
    if (!plan.merged[i]) merge_split(plan.merges[i]);
  }
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q (B, H, D) and caches (blocks, block_size, KVH, D)");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong, "tables and lengths must be int64");
  // Each token's heads must lie packed; the tokens themselves may be apart (a view of QKV).
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = at::empty(q.sizes(), q.options());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the caches must share a dtype");
  dispatch_storage_type(q.scalar_type(), "paged_decode_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_cache_type<scalar_t>(k_cache.scalar_type(), "paged_decode_attention", [&](auto ct) {
      decode_attention<scalar_t, decltype(ct)>(q, k_cache, v_cache, block_tables, context_lens,
                                               out, scale);
    });
  });
  return out;
}

}  // namespace meridian
