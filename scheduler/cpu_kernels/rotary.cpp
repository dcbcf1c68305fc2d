// Rotary position embedding applied in one pass on a CPU, where PyTorch runs eight small
// ops (two unsqueezes, chunk, neg, cat, two products, a sum) per query or key tensor.
// For each token n and head h, over the first R dims of the head (the rest pass through):
//   out = round(round(x · cos) + round(rotate_half(x) · sin)),  rotate_half(x) = (−x₂, x₁)
// with every product and the sum rounded in x's dtype, as those ops round them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"

namespace {

using iris::with_element_type;

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

template <typename T>
void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t dim, int64_t rotary) {
  const int64_t half = rotary / 2;
  for (int64_t i = 0; i < rotary; ++i) {
    const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const float direct = static_cast<float>(round_to<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i])));
    const float turned = static_cast<float>(round_to<T>(rotated * static_cast<float>(sin[i])));
    out[i] = round_to<T>(direct + turned);
  }
  std::copy(x + rotary, x + dim, out + rotary);
}

// x [N, H, D] with each token's heads contiguous (a slice of a fused projection's rows);
// cos, sin [N, R] contiguous, R even and <= D; all one dtype. Returns a contiguous tensor.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes(), "x [N, H, D], cos/sin [N, R]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "each token's heads contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "contiguous cos and sin");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(), "one dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), rotary_dims = cos.size(1);
  TORCH_CHECK(cos.size(0) == tokens && rotary_dims % 2 == 0 && rotary_dims <= dim, "rotary dims");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t token_stride = x.stride(0);
  auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const T *xs = x.data_ptr<T>(), *cs = cos.data_ptr<T>(), *ss = sin.data_ptr<T>();
    T* outs = out.data_ptr<T>();
    at::parallel_for(0, tokens * heads, 256, [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        const int64_t n = row / heads, h = row % heads;
        rotate_head(xs + n * token_stride + h * dim, cs + n * rotary_dims, ss + n * rotary_dims, outs + row * dim, dim,
                    rotary_dims);
      }
    });
  };
  with_element_type(x.scalar_type(), "rotary", run);
  return out;
}

}  // namespace

TORCH_LIBRARY(iris_rotary, m) { m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rotary); }
