// bf16 linear for decode-sized batches (up to 16 rows) on the AMX tile unit.
//
// A decode step multiplies a handful of rows by every weight of the model once, so it is bound by
// how fast the weights stream from memory. The weights are pre-packed into the tile unit's
// pair-interleaved layout, in the exact order the kernel reads them: one sequential stream per
// group of 64 output columns. Each output element is one float32 accumulator fed 32 products per
// tile instruction in K order, then rounded to bf16 once (after the bias), so a row's result does
// not depend on how many rows ride along with it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TANDEM_HAS_AMX 1
#endif

namespace {

constexpr int64_t kTileRows = 16;   // rows of A (batch rows) and of a packed B tile (K pairs)
constexpr int64_t kTileK = 32;      // bf16 values of K per tile instruction
constexpr int64_t kTileN = 16;      // output columns per accumulator tile
constexpr int64_t kGroupTiles = 4;  // accumulator tiles per pass over K: 64 output columns
constexpr int64_t kTileElems = kTileRows * kTileK;  // 512 bf16, 1 KiB
// How many K blocks ahead of the tile loads to prefetch the weight stream (16 KiB for a full
// group): the hardware prefetcher alone leaves the stream at about 70% of what 2 cores can read.
constexpr int64_t kPrefetchBlocks = 4;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

#ifdef TANDEM_HAS_AMX

// Linux hands out the tile state only to threads of a process that asked for it.
bool request_tile_state() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool granted =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate, 4 holds A, 5 and 6 hold B.
void configure_tiles(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.rows[t] = rows;
    config.colsb[t] = kTileN * sizeof(float);
  }
  config.rows[4] = rows;
  config.colsb[4] = kTileK * 2;
  for (int t = 5; t < 7; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = kTileN * 4;
  }
  _tile_loadconfig(&config);
}

// One group: `kTiles` accumulators over the whole of K, streaming the group's packed tiles once.
template <int kTiles>
void group_kernel(const at::BFloat16* a, int64_t a_stride_bytes, const at::BFloat16* packed,
                  int64_t k_blocks, float* acc /* [16][kTiles * 16] */) {
  _tile_zero(0);
  if constexpr (kTiles > 1) _tile_zero(1);
  if constexpr (kTiles > 2) _tile_zero(2);
  if constexpr (kTiles > 3) _tile_zero(3);
  constexpr int64_t kStep = kTiles * kTileElems;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const at::BFloat16* b = packed + kb * kStep;
    const char* ahead = reinterpret_cast<const char*>(b + kPrefetchBlocks * kStep);
    for (int64_t line = 0; line < kStep * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(4, a + kb * kTileK, a_stride_bytes);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (kTiles > 1) {
      _tile_loadd(6, b + kTileElems, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (kTiles > 2) {
      _tile_loadd(5, b + 2 * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (kTiles > 3) {
      _tile_loadd(6, b + 3 * kTileElems, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  constexpr int64_t kAccStride = kTiles * kTileN * sizeof(float);
  _tile_stored(0, acc, kAccStride);
  if constexpr (kTiles > 1) _tile_stored(1, acc + kTileN, kAccStride);
  if constexpr (kTiles > 2) _tile_stored(2, acc + 2 * kTileN, kAccStride);
  if constexpr (kTiles > 3) _tile_stored(3, acc + 3 * kTileN, kAccStride);
}

#endif  // TANDEM_HAS_AMX

}  // namespace

bool amx_available() {
#ifdef TANDEM_HAS_AMX
  return __builtin_cpu_supports("amx-bf16") && request_tile_state();
#else
  return false;
#endif
}

// weight [N, K] bf16 -> the kernel's layout: for each group of 64 output columns, for each block
// of 32 along K, the group's tiles of 16 K-pairs x 16 columns x 2, zero-padded at the edges.
torch::Tensor amx_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16 [N, K] weight");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t n_padded = round_up(n, kTileN), k_padded = round_up(k, kTileK);
  auto packed = torch::zeros({n_padded * k_padded}, weight.options());
  const auto* w = weight.data_ptr<at::BFloat16>();
  auto* p = packed.data_ptr<at::BFloat16>();
  const int64_t k_blocks = k_padded / kTileK;
  for (int64_t group_col = 0; group_col < n_padded; group_col += kGroupTiles * kTileN) {
    const int64_t tiles = std::min(kGroupTiles, (n_padded - group_col) / kTileN);
    at::BFloat16* group = p + group_col * k_padded;
    for (int64_t kb = 0; kb < k_blocks; ++kb)
      for (int64_t t = 0; t < tiles; ++t) {
        at::BFloat16* tile = group + (kb * tiles + t) * kTileElems;
        for (int64_t pair = 0; pair < kTileRows; ++pair)
          for (int64_t col = 0; col < kTileN; ++col)
            for (int64_t half = 0; half < 2; ++half) {
              const int64_t row = group_col + t * kTileN + col;
              const int64_t kk = kb * kTileK + 2 * pair + half;
              if (row < n && kk < k) tile[(pair * kTileN + col) * 2 + half] = w[row * k + kk];
            }
      }
  }
  return packed;
}

// x [M <= 16, K] bf16 times the packed weight of an [N, K] linear, plus an optional bias given
// in float32 (converted once, at load time, not on every call).
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16 [M, K] input");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m <= kTileRows, "amx_linear takes at most 16 rows");
  const int64_t n_padded = round_up(n, kTileN), k_padded = round_up(k, kTileK);
  TORCH_CHECK(packed.numel() == n_padded * k_padded, "packed weight does not fit [", n, ", ", k,
              "]");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
#ifdef TANDEM_HAS_AMX
  TORCH_CHECK(amx_available(), "this CPU has no AMX bf16 tile unit");
  // A tile reads 32 values of K per row: pad K (a copy) when it is not a multiple.
  torch::Tensor a = x.contiguous();
  if (k_padded != k) a = torch::constant_pad_nd(a, {0, k_padded - k}, 0);
  const auto* a_ptr = a.data_ptr<at::BFloat16>();
  const auto* w = packed.data_ptr<at::BFloat16>();
  const float* bias_ptr = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  auto* o = out.data_ptr<at::BFloat16>();
  const int64_t group_cols = kGroupTiles * kTileN;
  const int64_t groups = (n_padded + group_cols - 1) / group_cols;
  const int64_t k_blocks = k_padded / kTileK;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    configure_tiles(m);
    alignas(64) float acc[kTileRows * kGroupTiles * kTileN];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t col0 = g * group_cols;
      const int64_t tiles = std::min(kGroupTiles, (n_padded - col0) / kTileN);
      const at::BFloat16* group = w + col0 * k_padded;
      const int64_t stride = k_padded * 2;
      switch (tiles) {
        case 4: group_kernel<4>(a_ptr, stride, group, k_blocks, acc); break;
        case 3: group_kernel<3>(a_ptr, stride, group, k_blocks, acc); break;
        case 2: group_kernel<2>(a_ptr, stride, group, k_blocks, acc); break;
        default: group_kernel<1>(a_ptr, stride, group, k_blocks, acc); break;
      }
      const int64_t width = tiles * kTileN, cols = std::min(width, n - col0);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          float v = acc[r * width + c];
          if (bias_ptr) v += bias_ptr[col0 + c];
          o[r * n + col0 + c] = static_cast<at::BFloat16>(v);
        }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "built without AMX support");
#endif
  return out;
}
