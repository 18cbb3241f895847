// Small CPU ops around the matmuls: writing new K/V into the paged cache, and SiLU(gate) * up.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kRowsPerTask = 64;
constexpr float kExpLimit = 88.7f;  // exp of more overflows float

template <typename T>
void store_rows(const T* src, int64_t src_stride, T* cache, const int64_t* slots, int64_t rows,
                int64_t row_elems) {
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(cache + slots[r] * row_elems, src + r * src_stride, row_elems * sizeof(T));
}

// Rounds like the reference: silu(gate) is rounded to T before the multiply.
template <typename T>
void silu_and_mul_kernel(const T* x, T* out, int64_t rows, int64_t width) {
  // Rows in parallel on torch's thread pool; a decode batch is one chunk, run inline.
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        // Past -88.7, exp(-g) overflows float and silu(g) is -0, as torch computes it; the
        // finite-math exp of -ffast-math must not see that range (it returns NaN there).
        const float silu = -g > kExpLimit ? -0.f : g / (1.f + std::exp(std::min(-g, kExpLimit)));
        const T activated = static_cast<T>(silu);
        o[i] = static_cast<T>(static_cast<float>(activated) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key and value must be [N, kv_heads, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t rows = key.size(0), row_elems = key.size(1) * key.size(2);
  TORCH_CHECK(key_cache.size(2) * key_cache.size(3) == row_elems, "head shape mismatch");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "key and value heads must be contiguous within a row");
  auto slots = slot_mapping.contiguous();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(s[r] >= 0 && s[r] < num_slots, "slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "store_kv", [&] {
    store_rows<scalar_t>(key.data_ptr<scalar_t>(), key.stride(0),
                         key_cache.data_ptr<scalar_t>(), s, rows, row_elems);
    store_rows<scalar_t>(value.data_ptr<scalar_t>(), value.stride(0),
                         value_cache.data_ptr<scalar_t>(), s, rows, row_elems);
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be [N, 2*I]");
  const int64_t width = x.size(1) / 2;
  auto out = torch::empty({x.size(0), width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    silu_and_mul_kernel<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                                  width);
  });
  return out;
}
