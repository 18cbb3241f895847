// Decode attention on CPU straight from the paged KV cache: one query token per sequence,
// grouped-query heads, no gathered copy of K/V. One task per sequence, spread over torch's own
// thread pool: every query head scores every cached key (pass 1 over K, in cache order),
// softmax in float32, then accumulates V (pass 2, same order).
// Same contract as kernels/decode_attention.py::decode_attention_ref.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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
      for (int64_t head = 0; head < heads; ++head) {
        float* s = scores.data() + head * len;
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

template <typename T, int kHeadDim>
void launch(const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const torch::Tensor& tables,
            const torch::Tensor& lens, torch::Tensor& out, float scale) {
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
