// Decode attention on CPU straight from the paged KV cache: one query token per sequence,
// grouped-query heads, no gathered copy of K/V. One task per (sequence, KV head), spread over
// torch's own thread pool: the group's query heads score every cached key (pass 1 over K, in
// cache order), softmax in float32, then accumulate V (pass 2, same order).
// Same contract as kernels/decode_attention.py::decode_attention_ref.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
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

// Each of `rows` rows of `len` scores becomes its softmax, in float32.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * len;
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
}

template <typename T, int kHeadDim>
void decode_attention_kernel(const T* query, const T* key_cache, const T* value_cache,
                             const int64_t* block_tables, const int64_t* context_lens, T* out,
                             int64_t batch, int64_t heads, int64_t kv_heads, int64_t block_size,
                             int64_t max_blocks, float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * kHeadDim), acc(group * kHeadDim), scores;
    alignas(64) float row[kHeadDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, len = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      widen(query + (b * heads + h * group) * kHeadDim, queries.data(), group * kHeadDim);
      for (float& x : queries) x *= scale;
      scores.resize(group * len);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t first_slot = table[start / block_size] * block_size;
        for (int64_t i = 0; i < n; ++i) {
          widen(key_cache + ((first_slot + i) * kv_heads + h) * kHeadDim, row, kHeadDim);
          for (int64_t g = 0; g < group; ++g) {
            const float* q = queries.data() + g * kHeadDim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < kHeadDim; ++d) dot += q[d] * row[d];
            scores[g * len + start + i] = dot;
          }
        }
      }
      softmax_rows(scores.data(), group, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t first_slot = table[start / block_size] * block_size;
        for (int64_t i = 0; i < n; ++i) {
          widen(value_cache + ((first_slot + i) * kv_heads + h) * kHeadDim, row, kHeadDim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + start + i];
            float* a = acc.data() + g * kHeadDim;
#pragma omp simd
            for (int d = 0; d < kHeadDim; ++d) a[d] += p * row[d];
          }
        }
      }
      T* o = out + (b * heads + h * group) * kHeadDim;
      for (int64_t i = 0; i < group * kHeadDim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

#ifdef __AVX512F__
using BF16 = c10::BFloat16;

inline __m512 load_bf16(const BF16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Pulls one cache block's rows (`bytes` from each token's first head of the task) toward the
// core while the block before it is read: blocks sit anywhere in the pool, so the hardware
// prefetcher cannot see the next one coming.
inline void prefetch_block(const BF16* cache, int64_t first_slot, int64_t tokens,
                           int64_t row_elems, int64_t offset, int64_t bytes) {
  for (int64_t i = 0; i < tokens; ++i) {
    const char* row = reinterpret_cast<const char*>(cache + (first_slot + i) * row_elems + offset);
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(row + line, _MM_HINT_T0);
  }
}

// The bf16 kernel with explicit 16-lane vectors. A task is a whole sequence, so each cache
// block is read as one contiguous run (all KV heads of a token sit side by side); a batch too
// small to keep every thread busy splits its sequences by KV head instead.
template <int kHeadDim>
void decode_attention_bf16(const BF16* query, const BF16* key_cache, const BF16* value_cache,
                           const int64_t* block_tables, const int64_t* context_lens, BF16* out,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t block_size,
                           int64_t max_blocks, float scale) {
  constexpr int kChunks = kHeadDim / 16;
  const int64_t group = heads / kv_heads;
  const int64_t splits = batch >= 2 * at::get_num_threads() ? 1 : kv_heads;
  const int64_t task_kv_heads = kv_heads / splits, task_heads = task_kv_heads * group;
  const int64_t row_elems = kv_heads * kHeadDim;  // one token's K (or V), every KV head
  const int64_t task_bytes = task_kv_heads * kHeadDim * sizeof(BF16);
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(task_heads * kHeadDim), acc(task_heads * kHeadDim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, h0 = (task % splits) * task_kv_heads;
      const int64_t len = context_lens[b], offset = h0 * kHeadDim;
      const int64_t* table = block_tables + b * max_blocks;
      widen(query + (b * heads + h0 * group) * kHeadDim, queries.data(), task_heads * kHeadDim);
      for (float& x : queries) x *= scale;
      scores.resize(task_heads * len);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t first_slot = table[start / block_size] * block_size;
        if (start + block_size < len)
          prefetch_block(key_cache, table[start / block_size + 1] * block_size,
                         std::min(block_size, len - start - block_size), row_elems, offset,
                         task_bytes);
        for (int64_t i = 0; i < n; ++i) {
          const BF16* row = key_cache + (first_slot + i) * row_elems + offset;
          for (int64_t kh = 0; kh < task_kv_heads; ++kh) {
            __m512 k[kChunks];
            for (int c = 0; c < kChunks; ++c) k[c] = load_bf16(row + kh * kHeadDim + 16 * c);
            for (int64_t g = 0; g < group; ++g) {
              const float* q = queries.data() + (kh * group + g) * kHeadDim;
              __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
              for (int c = 1; c < kChunks; ++c)
                dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), k[c], dot);
              scores[(kh * group + g) * len + start + i] = _mm512_reduce_add_ps(dot);
            }
          }
        }
      }
      softmax_rows(scores.data(), task_heads, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      prefetch_block(value_cache, table[0] * block_size, std::min(block_size, len), row_elems,
                     offset, task_bytes);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t first_slot = table[start / block_size] * block_size;
        if (start + block_size < len)
          prefetch_block(value_cache, table[start / block_size + 1] * block_size,
                         std::min(block_size, len - start - block_size), row_elems, offset,
                         task_bytes);
        for (int64_t i = 0; i < n; ++i) {
          const BF16* row = value_cache + (first_slot + i) * row_elems + offset;
          for (int64_t kh = 0; kh < task_kv_heads; ++kh) {
            __m512 v[kChunks];
            for (int c = 0; c < kChunks; ++c) v[c] = load_bf16(row + kh * kHeadDim + 16 * c);
            for (int64_t g = 0; g < group; ++g) {
              const __m512 p = _mm512_set1_ps(scores[(kh * group + g) * len + start + i]);
              float* a = acc.data() + (kh * group + g) * kHeadDim;
              for (int c = 0; c < kChunks; ++c)
                _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(a + 16 * c)));
            }
          }
        }
      }
      BF16* o = out + (b * heads + h0 * group) * kHeadDim;
      for (int64_t i = 0; i < task_heads * kHeadDim; ++i) o[i] = static_cast<BF16>(acc[i]);
    }
  });
}
#endif  // __AVX512F__

template <typename T, int kHeadDim>
void launch(const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const torch::Tensor& tables,
            const torch::Tensor& lens, torch::Tensor& out, float scale) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    decode_attention_bf16<kHeadDim>(
        query.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
        tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), query.size(0),
        query.size(1), key_cache.size(2), key_cache.size(1), tables.size(1), scale);
    return;
  }
#endif
  decode_attention_kernel<T, kHeadDim>(
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
