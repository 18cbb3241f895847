// Decode attention on CPU straight from the paged KV cache: one query token per sequence,
// grouped-query heads, no gathered copy of K/V. One task per (sequence, KV head): its G query
// heads score every cached key (first pass over K), softmax in float32, then accumulate V
// (second pass). Same contract as kernels/decode_attention.py::decode_attention_ref.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kMaxHeadDim = 256;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void decode_attention_kernel(const T* q, const T* key_cache, const T* value_cache,
                             const int64_t* block_tables, const int64_t* context_lens, T* out,
                             int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * head_dim;  // between consecutive slots
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * head_dim), acc(group * head_dim), scores;
    float row[kMaxHeadDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, len = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      const T* q_head = q + (b * heads + h * group) * head_dim;  // this group's first head
      for (int64_t i = 0; i < group * head_dim; ++i)
        queries[i] = static_cast<float>(q_head[i]) * scale;
      scores.resize(group * len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        load_row(key_cache + slot * token_stride + h * head_dim, row, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = queries.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
          scores[g * len + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float top = *std::max_element(s, s + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - top));
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        load_row(value_cache + slot * token_stride + h * head_dim, row, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
        }
      }
      T* o = out + (b * heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
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
  const int64_t batch = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(head_dim <= kMaxHeadDim && key_cache.size(3) == head_dim, "head_dim mismatch");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode", [&] {
    decode_attention_kernel<scalar_t>(
        query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
        value_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), batch, heads, kv_heads, head_dim, block_size, tables.size(1),
        static_cast<float>(scale));
  });
  return out;
}

