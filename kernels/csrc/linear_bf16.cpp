// bf16 linear on AVX-512 CPUs without AMX: with AVX-512 BF16 (such as AMD Zen 4) for decode-sized
// batches (up to 16 rows), or without it, where the bf16 products are emulated in float32 (Intel
// Xeons before Cooper Lake), for any batch.
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
//
// Without AVX-512 BF16, oneDNN widens each bf16 to float32 and adds the two products of a pair
// into the sum one after the other, the second (odd) K value first. The emulated kernel does the
// same: the product of two bf16 values is exact in float32, so each fused multiply-add rounds
// once, as oneDNN's does. On such a CPU a decode step is bound by arithmetic, not by reading the
// weights, so this kernel computes only the rows it is given (a template per row count) and
// keeps every row's accumulator in a register.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "shared_queue.h"

#include <array>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_HAS_AVX512_BF16 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TANDEM_HAS_AVX512_EMULATED 1
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

#ifdef TANDEM_HAS_AVX512_EMULATED

// One group of 16 columns for the first `Rows` rows, K pairs widened to float32: xs[r * 2 * kp +
// 2 * p] is row r's odd K value of pair p, the next one its even K value.
template <int Rows>
void emulated_group_kernel(const float* xs, int64_t kp, const uint32_t* stream,
                           int64_t block_pairs, float* sums) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p0 = 0; p0 < kp; p0 += block_pairs) {
    const int64_t p1 = std::min(kp, p0 + block_pairs);
    __m512 acc[Rows];
    for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = p0; p < p1; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(stream + (p + kPrefetchPairs) * kCols),
                   _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(stream + p * kCols);
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, high_half));
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      for (int r = 0; r < Rows; ++r) {
        const float* x = xs + r * 2 * kp + 2 * p;
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[0]), odd, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[1]), even, acc[r]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      float* sum = sums + r * kCols;
      _mm512_storeu_ps(sum, p0 == 0 ? acc[r] : _mm512_add_ps(_mm512_loadu_ps(sum), acc[r]));
    }
  }
}

using EmulatedKernel = void (*)(const float*, int64_t, const uint32_t*, int64_t, float*);

// The kernel for tiles of 1, 2, ... 16 rows: kEmulatedKernels[rows - 1].
template <int... Rows>
constexpr std::array<EmulatedKernel, sizeof...(Rows)> emulated_kernels(
    std::integer_sequence<int, Rows...>) {
  return {&emulated_group_kernel<Rows + 1>...};
}
constexpr auto kEmulatedKernels = emulated_kernels(std::make_integer_sequence<int, kRows>());

// float32 -> bf16, rounding to nearest even as torch and oneDNN do; a NaN stays a quiet NaN with
// its sign and top payload bits (as vcvtneps2bf16 keeps them; torch writes 0x7FC0).
__m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

#endif  // TANDEM_HAS_AVX512_EMULATED

#if defined(TANDEM_HAS_AVX512_BF16) || defined(TANDEM_HAS_AVX512_EMULATED)

// Calls work(sums, g, col0, mask) for every group g of 16 output columns of an [M, n] output, on
// all threads; `sums` is the calling thread's [16 rows][16 columns] float32 scratch, col0 the
// group's first column and mask its columns that exist (the last group may be partial). About 8
// chunks per thread: small enough to even out a preempted thread, large enough that the shared
// counter is touched rarely.
template <typename Work>
void for_each_group(int64_t n, Work work) {
  struct Sums {
    alignas(64) float values[kRows * kCols];
  };
  const int64_t groups = round_up(n, kCols) / kCols;
  const int64_t chunk = groups / (8 * at::get_num_threads());
  auto run = [&](Sums& state, int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t col0 = g * kCols, cols = std::min(kCols, n - col0);
      work(state.values, g, col0, static_cast<__mmask16>((1u << cols) - 1));
    }
  };
  tandem::parallel_chunks(groups, chunk, [] { return Sums(); }, run);
}

#endif

}  // namespace

bool bf16_linear_available() {
#if defined(TANDEM_HAS_AVX512_BF16)
  return __builtin_cpu_supports("avx512bf16");
#elif defined(TANDEM_HAS_AVX512_EMULATED)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// With AVX-512 BF16, oneDNN's own kernels are faster past 16 rows; emulated, oneDNN's path
// reaches ~40% of what this kernel does at any row count (prefill chunks included), with the
// same sums.
int64_t bf16_linear_max_rows() {
#ifdef TANDEM_HAS_AVX512_EMULATED
  return std::numeric_limits<int64_t>::max();
#else
  return kRows;
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

// x [M, K] bf16 (M <= bf16_linear_max_rows()) times a packed [N, K] weight, K summed in blocks
// of `block` values.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16 [M, K] input");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m <= bf16_linear_max_rows(), "bf16_linear takes at most ", bf16_linear_max_rows(),
              " rows");
  TORCH_CHECK(block > 0 && block % 2 == 0, "block must be a positive even number of K values");
  const int64_t n_padded = round_up(n, kCols), kp = round_up(k, 2) / 2;
  TORCH_CHECK(packed.numel() == n_padded * kp * 2, "packed weight does not fit [", n, ", ", k,
              "]");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(TANDEM_HAS_AVX512_BF16) || defined(TANDEM_HAS_AVX512_EMULATED)
  const auto* stream = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  auto* o = out.data_ptr<at::BFloat16>();
#endif
#ifdef TANDEM_HAS_AVX512_BF16
  TORCH_CHECK(bf16_linear_available(), "this CPU has no AVX-512 BF16");
  // Rows padded to 16 (zeros) and K to even, as pairs: every group reads the same small copy.
  std::vector<uint32_t> pairs(kRows * kp, 0);
  auto xc = x.contiguous();
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(pairs.data() + r * kp, xc.data_ptr<at::BFloat16>() + r * k, k * 2);
  for_each_group(n, [&](float* sums, int64_t g, int64_t col0, __mmask16 mask) {
    group_kernel(pairs.data(), kp, stream + g * kp * kCols, block / 2, sums);
    for (int64_t r = 0; r < m; ++r) {
      const __m256i bf = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + r * kCols));
      _mm256_mask_storeu_epi16(o + r * n + col0, mask, bf);
    }
  });
#elif defined(TANDEM_HAS_AVX512_EMULATED)
  TORCH_CHECK(bf16_linear_available(), "this CPU has no AVX-512 F, BW and VL");
  // Each row's K values widened to float32 once, in the order the kernel adds them: per pair,
  // the odd K value (the pair's high half) and then the even one.
  std::vector<float> xs(m * kp * 2, 0.0f);
  auto xc = x.contiguous();
  const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  at::parallel_for(0, m, kRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = xb + r * k;
      float* widened = xs.data() + r * kp * 2;
      for (int64_t kk = 0; kk < k; ++kk) {  // a bf16 is the top half of its float32
        const uint32_t bits = static_cast<uint32_t>(row[kk]) << 16;
        std::memcpy(widened + (kk ^ 1), &bits, sizeof(bits));
      }
    }
  });
  // A group's weights (18 KB at K = 576) stay in cache while every 16 rows of x pass over them:
  // the weights are read from memory once per call, whatever the rows.
  for_each_group(n, [&](float* sums, int64_t g, int64_t col0, __mmask16 mask) {
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int64_t rows = std::min(kRows, m - r0);
      kEmulatedKernels[rows - 1](xs.data() + r0 * kp * 2, kp, stream + g * kp * kCols,
                                 block / 2, sums);
      for (int64_t r = 0; r < rows; ++r) {
        _mm256_mask_storeu_epi16(o + (r0 + r) * n + col0, mask,
                                 round_to_bf16(_mm512_load_ps(sums + r * kCols)));
      }
    }
  });
#else
  TORCH_CHECK(false, "built without AVX-512 support");
#endif
  return out;
}
