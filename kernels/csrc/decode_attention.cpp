// Decode attention on CPU straight from the paged KV cache: one query token per sequence,
// grouped-query heads, no gathered copy of K/V. One task per sequence, spread over torch's own
// thread pool: every query head scores every cached key (pass 1 over K, in cache order),
// softmax in float32, then accumulates V (pass 2, same order). bfloat16 caches on a CPU with
// AVX-512 take decode_attention_bf16, which scores keys 16 at a time and keeps pass 2's sums in
// registers (about 4x faster at SmolLM2's shape); other types and CPUs take the portable loops.
// Same contract as kernels/decode_attention.py::decode_attention_ref.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "shared_queue.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// bfloat16 is the top half of a float32: widening is a shift, which the compiler vectorizes.
inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Asks for a cache block before it is read: blocks sit anywhere in the cache, so the hardware
// prefetcher, which follows one stream, stalls at every jump from one block to the next.
template <typename T>
inline void prefetch_block(const T* cache, int64_t block, int64_t bytes) {
  const char* first = reinterpret_cast<const char*>(cache) + block * bytes;
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(first + offset);
}

// Softmax of one query head's scores, in place, in float32.
inline void softmax(float* s, int64_t len) {
  const float top = *std::max_element(s, s + len);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - top);
    total += s[t];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

template <typename T, int kHeadDim>
void decode_attention_kernel(const T* query, const T* key_cache, const T* value_cache,
                             const int64_t* block_tables, const int64_t* context_lens, T* out,
                             int64_t batch, int64_t heads, int64_t kv_heads, int64_t block_size,
                             int64_t max_blocks, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t block_bytes = block_size * kv_heads * kHeadDim * sizeof(T);
  // One task per sequence: a cache block holds every KV head of its tokens side by side, so a
  // sequence's blocks are read front to back, once for K and once for V.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(heads * kHeadDim), acc(heads * kHeadDim), scores;
    alignas(64) float row[kHeadDim];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      widen(query + b * heads * kHeadDim, queries.data(), heads * kHeadDim);
      for (float& x : queries) x *= scale;
      scores.resize(heads * len);  // query head q's scores at [q * len, (q + 1) * len)
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const T* keys = key_cache + table[start / block_size] * block_size * kv_heads * kHeadDim;
        if (start + block_size < len) {
          prefetch_block(key_cache, table[start / block_size + 1], block_bytes);
        }
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t h = 0; h < kv_heads; ++h) {
            widen(keys + (i * kv_heads + h) * kHeadDim, row, kHeadDim);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t head = h * group + g;
              const float* q = queries.data() + head * kHeadDim;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int d = 0; d < kHeadDim; ++d) dot += q[d] * row[d];
              scores[head * len + start + i] = dot;
            }
          }
        }
      }
      for (int64_t head = 0; head < heads; ++head) softmax(scores.data() + head * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const T* values =
            value_cache + table[start / block_size] * block_size * kv_heads * kHeadDim;
        if (start + block_size < len) {
          prefetch_block(value_cache, table[start / block_size + 1], block_bytes);
        }
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t h = 0; h < kv_heads; ++h) {
            widen(values + (i * kv_heads + h) * kHeadDim, row, kHeadDim);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t head = h * group + g;
              const float p = scores[head * len + start + i];
              float* a = acc.data() + head * kHeadDim;
#pragma omp simd
              for (int d = 0; d < kHeadDim; ++d) a[d] += p * row[d];
            }
          }
        }
      }
      T* o = out + b * heads * kHeadDim;
      for (int64_t i = 0; i < heads * kHeadDim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

#if defined(__AVX512F__)
// The bfloat16 kernel with AVX-512: the same passes, but a query's dot products with 16
// consecutive keys end in one shared reduction (sum_lanes16) instead of 16 horizontal sums,
// and every multiply-add is one fused instruction. A key's score depends only on the query and
// that key (its lanes are summed in a fixed order, whatever else is in the tile), so a
// sequence's result does not depend on its batch.

// How far ahead (in tokens) the bfloat16 kernel asks for cache rows, into L2. A step reads every
// layer's cache once, far more than L3 holds, and a block's successor sits anywhere, so without
// this a core waits on memory at every block. Measured at SmolLM2's shape (30 layers, 16 x 194
// tokens, the variants interleaved in one process): the portable kernel 7.3 ms a step, this one
// asking 64 tokens ahead 5.6, and also asking for the first rows up front 4.7-5.0 (32, 16 or 64
// tokens ahead, all within the noise; 128 slower).
constexpr int64_t kAhead = 32;

inline void prefetch_bytes(const void* first, int64_t bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(p + offset, /*read*/ 0, /*L2*/ 1);
  }
}

inline __m512 load_bf16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Lane j of the result is the sum of the 16 lanes of v[j]: a transpose and a tree of adds,
// 45 instructions for 16 sums.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = v[2 * i], y = v[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 x = quads[2 * i], y = quads[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// Pass 2 for `heads` query heads (kHeads at most) that share a KV head: out[x] = sum over the
// context of probs[x][t] * V[t], in token order, the sums in registers throughout. `value_of(t)`
// is token t's V row for that KV head.
template <int kHeadDim, int kHeads, typename ValueOf>
void accumulate_values(int64_t heads, const float* probs, int64_t len, const ValueOf& value_of,
                       float* out) {
  if constexpr (kHeads > 1) {
    if (heads < kHeads) {
      accumulate_values<kHeadDim, kHeads - 1>(heads, probs, len, value_of, out);
      return;
    }
  }
  constexpr int kChunks = kHeadDim / 16;
  __m512 sum[kHeads][kChunks];
  for (int x = 0; x < kHeads; ++x) {
    for (int c = 0; c < kChunks; ++c) sum[x][c] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < len; ++t) {
    if (t + kAhead < len) prefetch_bytes(value_of(t + kAhead), kHeadDim * sizeof(c10::BFloat16));
    const c10::BFloat16* row = value_of(t);
    __m512 value[kChunks];
    for (int c = 0; c < kChunks; ++c) value[c] = load_bf16(row + 16 * c);
    for (int x = 0; x < kHeads; ++x) {
      const __m512 p = _mm512_set1_ps(probs[x * len + t]);
      for (int c = 0; c < kChunks; ++c) sum[x][c] = _mm512_fmadd_ps(p, value[c], sum[x][c]);
    }
  }
  for (int x = 0; x < kHeads; ++x) {
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(out + x * kHeadDim + 16 * c, sum[x][c]);
  }
}

template <int kHeadDim>
void decode_attention_bf16(const c10::BFloat16* query, const c10::BFloat16* key_cache,
                           const c10::BFloat16* value_cache, const int64_t* block_tables,
                           const int64_t* context_lens, c10::BFloat16* out, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t block_size,
                           int64_t max_blocks, float scale) {
  constexpr int kChunks = kHeadDim / 16;
  constexpr int kTile = 16;
  const int64_t group = heads / kv_heads;
  const int64_t row_stride = kv_heads * kHeadDim;  // one token's K (or V), every KV head
  const int64_t row_bytes = row_stride * sizeof(c10::BFloat16);
  struct Buffers {
    std::vector<float> queries, acc, scores;
    std::vector<__m512> partial;  // [query of the group][key of the tile]
    std::vector<const c10::BFloat16*> rows;
  };
  auto setup = [&] {
    return Buffers{std::vector<float>(heads * kHeadDim), std::vector<float>(heads * kHeadDim), {},
                   std::vector<__m512>(group * kTile), std::vector<const c10::BFloat16*>(kTile)};
  };
  // One sequence at a time from a shared queue: see shared_queue.h.
  tandem::parallel_chunks(batch, 1, setup, [&](Buffers& buffers, int64_t begin, int64_t end) {
    std::vector<float>& queries = buffers.queries;
    std::vector<float>& acc = buffers.acc;
    std::vector<float>& scores = buffers.scores;
    std::vector<__m512>& partial = buffers.partial;
    std::vector<const c10::BFloat16*>& rows = buffers.rows;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      auto token_row = [&](const c10::BFloat16* cache, int64_t t) {
        return cache + (table[t / block_size] * block_size + t % block_size) * row_stride;
      };
      widen(query + b * heads * kHeadDim, queries.data(), heads * kHeadDim);
      for (float& x : queries) x *= scale;
      scores.resize(heads * len);
      // The loops below ask for rows kAhead tokens on; the first kAhead are asked for here.
      for (int64_t t = 0; t < std::min(kAhead, len); ++t) {
        prefetch_bytes(token_row(key_cache, t), row_bytes);
      }
      for (int64_t start = 0; start < len; start += kTile) {
        const int64_t n = std::min<int64_t>(kTile, len - start);
        for (int64_t t = start + kAhead; t < std::min(start + kAhead + kTile, len); ++t) {
          prefetch_bytes(token_row(key_cache, t), row_bytes);
        }
        for (int64_t i = 0; i < n; ++i) rows[i] = token_row(key_cache, start + i);
        for (int64_t h = 0; h < kv_heads; ++h) {
          for (int64_t i = 0; i < kTile; ++i) {
            if (i >= n) {  // past the end: a zero row, summed on its own and never stored
              for (int64_t g = 0; g < group; ++g) partial[g * kTile + i] = _mm512_setzero_ps();
              continue;
            }
            __m512 key[kChunks];
            for (int c = 0; c < kChunks; ++c) key[c] = load_bf16(rows[i] + h * kHeadDim + 16 * c);
            for (int64_t g = 0; g < group; ++g) {
              const float* q = queries.data() + (h * group + g) * kHeadDim;
              __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q), key[0]);
              for (int c = 1; c < kChunks; ++c) {
                dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), key[c], dot);
              }
              partial[g * kTile + i] = dot;
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            const __m512 sums = sum_lanes16(partial.data() + g * kTile);
            float* s = scores.data() + (h * group + g) * len + start;
            _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << n) - 1), sums);
          }
        }
      }
      for (int64_t t = 0; t < std::min(kAhead, len); ++t) {  // V's, to arrive during softmax
        prefetch_bytes(token_row(value_cache, t), row_bytes);
      }
      for (int64_t head = 0; head < heads; ++head) softmax(scores.data() + head * len, len);
      // Pass 2, a few query heads of one KV head at a time, their sums held in registers.
      constexpr int kPass = std::max(1, 16 / kChunks);
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t g = 0; g < group; g += kPass) {
          const int64_t head = h * group + g;
          accumulate_values<kHeadDim, kPass>(
              std::min<int64_t>(kPass, group - g), scores.data() + head * len, len,
              [&](int64_t t) { return token_row(value_cache, t) + h * kHeadDim; },
              acc.data() + head * kHeadDim);
        }
      }
      c10::BFloat16* o = out + b * heads * kHeadDim;
      for (int64_t i = 0; i < heads * kHeadDim; ++i) o[i] = static_cast<c10::BFloat16>(acc[i]);
    }
  });
}
#endif

template <typename T, int kHeadDim>
void launch(const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const torch::Tensor& tables,
            const torch::Tensor& lens, torch::Tensor& out, float scale) {
  auto kernel = decode_attention_kernel<T, kHeadDim>;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) kernel = decode_attention_bf16<kHeadDim>;
#endif
  kernel(
      query.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), query.size(0),
      query.size(1), key_cache.size(2), key_cache.size(1), tables.size(1), scale);
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor query, torch::Tensor key_cache,
                               torch::Tensor value_cache, torch::Tensor block_tables,
                               torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D], cache [N, bs, kvH, D]");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "query and caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "head_dim mismatch");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(query);
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode", [&] {
    switch (head_dim) {
      case 32: launch<scalar_t, 32>(query, key_cache, value_cache, tables, lens, out, s); break;
      case 64: launch<scalar_t, 64>(query, key_cache, value_cache, tables, lens, out, s); break;
      case 128: launch<scalar_t, 128>(query, key_cache, value_cache, tables, lens, out, s); break;
      case 256: launch<scalar_t, 256>(query, key_cache, value_cache, tables, lens, out, s); break;
      default: TORCH_CHECK(false, "head_dim must be 32, 64, 128 or 256, not ", head_dim);
    }
  });
  return out;
}
