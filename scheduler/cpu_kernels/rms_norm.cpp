// RMSNorm in one pass per row on a CPU, in transformers' order of roundings, where PyTorch
// runs six to eight small ops (float, pow, mean, add, rsqrt, mul, cast, mul): a decode
// step's norms are one row each, so those ops' launch cost is most of what they take.
//
// Each row x of H values, widened to float32: xn = x · 1/sqrt(mean(x²) + eps), then
//   RMSNorm:               out = w · round(xn)          (the product rounded in x's dtype)
//   zero-centred (Qwen3.5): out = round(xn · (1 + w))   (scaled in float32, rounded once)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "vec.h"

namespace {

using namespace iris;

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t h, float eps, bool zero_centered) {
  Vec acc = zero();
  int64_t i = 0;
  for (; i + kLanes <= h; i += kLanes) {
    const Vec v = load(x + i);
    acc = fma(v, v, acc);
  }
  float squares = sum(acc);
  for (; i < h; ++i) squares += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(h) + eps);
  for (int64_t j = 0; j < h; ++j) {
    const float normed = static_cast<float>(x[j]) * inverse;
    const float weight = static_cast<float>(w[j]);
    out[j] = zero_centered ? static_cast<T>(normed * (1.0f + weight))
                           : static_cast<T>(static_cast<float>(static_cast<T>(normed)) * weight);
  }
}

// x [..., H] (float32 or bfloat16, contiguous) and weight [H] of x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1, "contiguous x, 1-D weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "weight in x's dtype");
  const int64_t h = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == h, "x's last dimension is the weight's");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = h ? x.numel() / h : 0;
  const float epsilon = static_cast<float>(eps);
  auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const T* xs = x.data_ptr<T>();
    const T* ws = weight.data_ptr<T>();
    T* outs = out.data_ptr<T>();
    at::parallel_for(0, rows, 64, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) norm_row(xs + r * h, ws, outs + r * h, h, epsilon, zero_centered);
    });
  };
  with_element_type(x.scalar_type(), "rms_norm", run);
  return out;
}

}  // namespace

TORCH_LIBRARY(iris_norm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool zero_centered) -> Tensor", &rms_norm);
}
