// Greedy sampling's argmax over each row of the logits, read in the model's dtype.
//
// torch's CPU argmax is slow, and converting bf16 logits to float first writes twice the bytes
// the argmax then reads again. Here each value's bits become an unsigned key that orders as the
// value does: a vectorised max of the keys per block, then a scan of the first block holding the
// largest. Integer keys also keep the answer exact under -ffast-math, which assumes no NaN:
// torch's argmax ranks NaN above everything (the first one wins) and treats -0 and +0 as equal,
// and so do the keys.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace {

constexpr int64_t kRowsPerTask = 8;

// The key of a value: larger value, larger key; every NaN gets the largest key, and -0 the key
// of +0. The sign is the top bit of every type here; `inf_bits` is the pattern of +infinity
// (magnitudes above it are NaN). Branch-free, so the max below runs in vector registers.
template <typename Bits>
inline Bits key_of(Bits bits, Bits inf_bits) {
  constexpr int kSignShift = sizeof(Bits) * 8 - 1;
  constexpr Bits kSign = static_cast<Bits>(Bits(1) << kSignShift);
  const Bits magnitude = bits & static_cast<Bits>(~kSign);
  bits = magnitude == 0 ? Bits(0) : bits;                              // -0 is +0
  const Bits flip = static_cast<Bits>(Bits(0) - (bits >> kSignShift)) | kSign;  // negatives: all
  const Bits key = bits ^ flip;
  return magnitude > inf_bits ? static_cast<Bits>(~Bits(0)) : key;  // NaN above everything
}

constexpr int64_t kBlock = 256;  // the max is kept per block; only the winning block is rescanned

template <typename Bits>
int64_t row_argmax(const Bits* row, int64_t n, Bits inf_bits) {
  Bits best = 0;
  int64_t best_start = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = start + kBlock < n ? start + kBlock : n;
    Bits block_max = 0;
#pragma omp simd reduction(max : block_max)
    for (int64_t i = start; i < end; ++i) {
      const Bits k = key_of(row[i], inf_bits);
      block_max = k > block_max ? k : block_max;
    }
    if (block_max > best || start == 0) {  // strictly greater: the first block holding it wins
      best = block_max;
      best_start = start;
    }
  }
  for (int64_t i = best_start; i < n; ++i)
    if (key_of(row[i], inf_bits) == best) return i;
  return best_start;  // not reached: the block holds its maximum
}

template <typename Bits>
void argmax_rows_kernel(const void* data, int64_t rows, int64_t n, int64_t row_stride,
                        Bits inf_bits, int64_t* out) {
  const Bits* base = static_cast<const Bits*>(data);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_argmax(base + r * row_stride, n, inf_bits);
  });
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [rows, vocab]");
  TORCH_CHECK(logits.size(1) > 0, "logits must have at least one column");
  TORCH_CHECK(logits.stride(1) == 1, "each row of logits must be contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, torch::dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  switch (logits.scalar_type()) {
    case at::kBFloat16:
      argmax_rows_kernel<uint16_t>(logits.data_ptr(), rows, n, stride, 0x7F80, o);
      break;
    case at::kHalf:
      argmax_rows_kernel<uint16_t>(logits.data_ptr(), rows, n, stride, 0x7C00, o);
      break;
    case at::kFloat:
      argmax_rows_kernel<uint32_t>(logits.data_ptr(), rows, n, stride, 0x7F800000u, o);
      break;
    default:
      TORCH_CHECK(false, "argmax_rows takes bf16, fp16 or float32 logits");
  }
  return out;
}
