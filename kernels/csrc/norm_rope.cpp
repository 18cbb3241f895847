// RMSNorm and rotary embedding for CPU, one pass each instead of a chain of small torch ops.
// Rounding follows the reference implementation: normalise in float32, round to the model dtype,
// then multiply by the weight; rotary rounds x*cos and rotate_half(x)*sin before adding them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int64_t kRowsPerTask = 64;

template <typename T>
inline T round_to(float value) {
  return static_cast<T>(value);
}

// With a `residual`, each row of x + residual is first rounded into `summed` (the residual
// stream's add, as torch rounds it) and normalised from there.
template <typename T>
void rms_norm_kernel(const T* x, const T* residual, T* summed, const T* weight, T* out,
                     int64_t rows, int64_t dim, int64_t row_stride, float eps) {
  // Rows in parallel on torch's thread pool; a decode batch is one chunk, run inline.
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * row_stride;
      if (residual != nullptr) {
        const T* res = residual + r * dim;
        T* sum_row = summed + r * dim;
        for (int64_t d = 0; d < dim; ++d)
          sum_row[d] = round_to<T>(static_cast<float>(xr[d]) + static_cast<float>(res[d]));
        xr = sum_row;
      }
      float sum = 0.f;
  #pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < dim; ++d) {
        const float v = static_cast<float>(xr[d]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / dim + eps);
      T* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const T normed = round_to<T>(static_cast<float>(xr[d]) * inv);
        o[d] = round_to<T>(static_cast<float>(weight[d]) * static_cast<float>(normed));
      }
    }
  });
}

template <typename T>
inline T rotate_one(T x, float rotated, T cos, T sin) {
  const T a = round_to<T>(static_cast<float>(x) * static_cast<float>(cos));
  const T b = round_to<T>(static_cast<float>(round_to<T>(rotated)) * static_cast<float>(sin));
  return round_to<T>(static_cast<float>(a) + static_cast<float>(b));
}

// x: rows of `heads` head vectors, row stride `row_stride`; cos/sin: [rows, head_dim].
template <typename T>
void rotary_kernel(const T* x, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
                   int64_t head_dim, int64_t row_stride) {
  const int64_t half = head_dim / 2;
  // Rows in parallel on torch's thread pool; a decode batch is one chunk, run inline.
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * head_dim;
      const T* s = sin + r * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + r * row_stride + h * head_dim;
        T* o = out + (r * heads + h) * head_dim;
        // first half: x*cos - x[d+half]*sin; second half: x*cos + x[d-half]*sin
        for (int64_t d = 0; d < half; ++d)
          o[d] = rotate_one<T>(xh[d], -static_cast<float>(xh[d + half]), c[d], s[d]);
        for (int64_t d = half; d < head_dim; ++d)
          o[d] = rotate_one<T>(xh[d], static_cast<float>(xh[d - half]), c[d], s[d]);
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [N, D] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [D]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight dtypes differ");
  auto w = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), nullptr, nullptr, w.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                              static_cast<float>(eps));
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [N, D] with contiguous rows");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [D]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight dtypes differ");
  auto res = residual.contiguous();
  auto w = weight.contiguous();
  auto summed = torch::empty({x.size(0), x.size(1)}, x.options());
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), res.data_ptr<scalar_t>(),
                              summed.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                              static_cast<float>(eps));
  });
  return {out, summed};
}

torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [N, heads, head_dim] with contiguous heads");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  auto c = cos.reshape({x.size(0), x.size(2)}).contiguous();
  auto s = sin.reshape({x.size(0), x.size(2)}).contiguous();
  TORCH_CHECK(c.scalar_type() == x.scalar_type(), "cos/sin dtype must match x");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_kernel<scalar_t>(x.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(),
                            s.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), x.size(2), x.stride(0));
  });
  return out;
}
