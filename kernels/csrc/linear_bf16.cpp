// bf16 linear for decode-sized batches (up to 16 rows) on AVX-512 BF16 (CPUs without AMX, such as
// AMD Zen 4).
//
// A decode step multiplies a handful of rows by every weight of the model once. Here each weight
// is read once per call: the packed weight is one sequential stream per 16 output columns (64
// bytes per pair of K values), and each 64-byte vector of it feeds all 16 rows' accumulators
// (one `vdpbf16ps` per row, the row's pair broadcast), so at 16 rows a core does 16 dot-product
// instructions per line of weight it reads, which is about what one core can both read and
// compute.
//
// The sums follow oneDNN's order, so that which path a row takes never changes a token: K is cut
// into blocks of `block` values, each block summed into fresh float32 accumulators in K order,
// the block sums added in order, one rounding to bf16 at the end. oneDNN picks its block from the
// shape; engine/packed_linear.py finds it by comparing the two on a random batch and uses this
// kernel only where the bits agree.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "shared_queue.h"

#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_HAS_AVX512_BF16 1
#endif

namespace {

constexpr int64_t kRows = 16;  // rows of x per call, at most: one accumulator register each
constexpr int64_t kCols = 16;  // output columns per accumulator: one float32 vector
// How many K pairs (64-byte lines of the stream) ahead to prefetch the weights.
constexpr int64_t kPrefetchPairs = 32;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

#ifdef TANDEM_HAS_AVX512_BF16

// One group of 16 columns for all 16 rows: sums[r * 16 + c] = row r times the group's column c.
// The block sums wait in memory (the 16 accumulators take half the registers).
void group_kernel(const uint32_t* pairs /* [16][kp] */, int64_t kp, const uint32_t* stream,
                  int64_t block_pairs, float* sums) {
  for (int64_t p0 = 0; p0 < kp; p0 += block_pairs) {
    const int64_t p1 = std::min(kp, p0 + block_pairs);
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = p0; p < p1; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(stream + (p + kPrefetchPairs) * kCols),
                   _MM_HINT_T0);
      const __m512bh w = (__m512bh)_mm512_loadu_si512(stream + p * kCols);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r * kp + p]));
        acc[r] = _mm512_dpbf16_ps(acc[r], x, w);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      float* sum = sums + r * kCols;
      _mm512_storeu_ps(sum, p0 == 0 ? acc[r] : _mm512_add_ps(_mm512_loadu_ps(sum), acc[r]));
    }
  }
}

#endif  // TANDEM_HAS_AVX512_BF16

}  // namespace

bool bf16_linear_available() {
#ifdef TANDEM_HAS_AVX512_BF16
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// weight [N, K] bf16 -> for each group of 16 output columns, for each pair of K values, the
// group's 16 columns' pairs side by side (64 bytes); N and K zero-padded to 16 and 2.
torch::Tensor bf16_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16 [N, K] weight");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t n_padded = round_up(n, kCols), kp = round_up(k, 2) / 2;
  auto packed = torch::zeros({n_padded * kp * 2}, weight.options());
  const auto* w = weight.data_ptr<at::BFloat16>();
  auto* out = packed.data_ptr<at::BFloat16>();
  for (int64_t col = 0; col < n; ++col) {
    at::BFloat16* group = out + (col / kCols) * kp * kCols * 2;
    for (int64_t kk = 0; kk < k; ++kk) {
      group[((kk / 2) * kCols + col % kCols) * 2 + kk % 2] = w[col * k + kk];
    }
  }
  return packed;
}

// x [M <= 16, K] bf16 times a packed [N, K] weight, K summed in blocks of `block` values.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16 [M, K] input");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m <= kRows, "bf16_linear takes at most 16 rows");
  TORCH_CHECK(block > 0 && block % 2 == 0, "block must be a positive even number of K values");
  const int64_t n_padded = round_up(n, kCols), kp = round_up(k, 2) / 2;
  TORCH_CHECK(packed.numel() == n_padded * kp * 2, "packed weight does not fit [", n, ", ", k,
              "]");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
#ifdef TANDEM_HAS_AVX512_BF16
  TORCH_CHECK(bf16_linear_available(), "this CPU has no AVX-512 BF16");
  // Rows padded to 16 (zeros) and K to even, as pairs: every group reads the same small copy.
  std::vector<uint32_t> pairs(kRows * kp, 0);
  auto xc = x.contiguous();
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(pairs.data() + r * kp, xc.data_ptr<at::BFloat16>() + r * k, k * 2);
  const auto* stream = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  auto* o = out.data_ptr<at::BFloat16>();
  const int64_t groups = n_padded / kCols;
  // About 8 chunks per thread: small enough to even out a preempted thread, large enough that
  // the shared counter is touched rarely.
  const int64_t chunk = groups / (8 * at::get_num_threads());
  struct Sums {
    alignas(64) float values[kRows * kCols];
  };
  auto work = [&](Sums& state, int64_t begin, int64_t end) {
    float* sums = state.values;
    for (int64_t g = begin; g < end; ++g) {
      group_kernel(pairs.data(), kp, stream + g * kp * kCols, block / 2, sums);
      const int64_t col0 = g * kCols, cols = std::min(kCols, n - col0);
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
      for (int64_t r = 0; r < m; ++r) {
        const __m256i bf = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + r * kCols));
        _mm256_mask_storeu_epi16(o + r * n + col0, mask, bf);
      }
    }
  };
  tandem::parallel_chunks(groups, chunk, [] { return Sums(); }, work);
#else
  TORCH_CHECK(false, "built without AVX-512 BF16 support");
#endif
  return out;
}
