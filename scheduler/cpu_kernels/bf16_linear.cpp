// Bfloat16 x · Wᵀ (+ b) for a few rows on a CPU, W dense and row-major as checkpoints
// store it: the LM head (tied to the embedding or not, it stays dense) and other weights
// nobody packed ahead. A decode step's rows are few, so such a layer costs what its bytes
// cost to read; PyTorch's bf16 paths for a dense weight (MKL's, oneDNN's unpacked) read
// them at about half the machine's bandwidth, one sequential stream per thread at most of it.
//
// Products accumulate in float32, the bias is added there and each output rounded once, as
// a bf16 GEMM does: on a CPU with AVX512-BF16 by bf16 pair products (vdpbf16ps, both
// operands read as they are), elsewhere by widening both to float32 (exact: a bf16 is a
// float32's upper half) and fused multiply-adds. Either differs from PyTorch's only in the
// order of the float32 additions.
//
// Work is split over output rows. Up to kInputs rows, each thread streams its weight rows
// front to back once; more, a unit of rows is finished for every pass of input rows, kRows
// weight rows side by side (each input vector loaded once for them), before the next unit
// starts, so its weights come from memory once and from cache after.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "vec.h"

namespace {

using namespace iris;
using bf16 = c10::BFloat16;

constexpr int kInputs = 4;       // input rows per pass (their vectors stay in L1)
constexpr int kRows = 4;         // weight rows side by side (more rows: loads in flight)
constexpr int kChains = 4;       // accumulators per input row of a streamed weight row
constexpr int64_t kUnit = 16;    // output rows per unit of work (a multiple of kRows)
constexpr int64_t kColumns = 32;  // K is read 32 columns at a time (one pair vector)

struct Problem {
  const bf16* x;     // [M, K]
  const bf16* w;     // [N, K]
  const bf16* bias;  // [N] or null
  bf16* out;         // [M, N]
  int64_t k, n;
};

inline float bias_of(const Problem& p, int64_t row) {
  return p.bias == nullptr ? 0.0f : static_cast<float>(p.bias[row]);
}

template <int R, int I>
void zero_all(Vec (&acc)[R][I]) {
  for (auto& row : acc)
    for (auto& v : row) v = zero();
}

// Each accumulator's lanes summed, the bias added and rounded once into its output.
template <int R, int I>
void store_rows(const Problem& p, Vec (&acc)[R][I], int64_t n, bf16* out) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < I; ++i) out[i * p.n + n + r] = bf16(sum(acc[r][i]) + bias_of(p, n + r));
}

// One step along K: how many columns, loading x's and W's vectors, and their product added.
#if defined(__AVX512BF16__)
struct Products {  // bf16 pair products (vec.h), 32 columns at a time
  using Operand = Pairs;
  static constexpr int64_t kStep = kColumns;
  static Operand load_pairs(const bf16* p) { return iris::load_pairs(p); }
  static Vec add_product(Vec acc, Operand x, Operand w) { return add_pair_products(acc, x, w); }
};
#else
struct Products {  // widened to float32, a vector at a time
  using Operand = Vec;
  static constexpr int64_t kStep = kLanes;
  static Operand load_pairs(const bf16* p) { return load(p); }
  static Vec add_product(Vec acc, Operand x, Operand w) { return fma(x, w, acc); }
};
#endif

// Output rows [n, n + R) for input rows [0, I) of `x` (row stride p.k) into `out` (row
// stride p.n).
template <int R, int I>
void dot_rows(const Problem& p, const bf16* x, int64_t n, bf16* out) {
  Vec acc[R][I];
  zero_all(acc);
  for (int64_t j = 0; j < p.k; j += Products::kStep) {
    typename Products::Operand xs[I];
    for (int i = 0; i < I; ++i) xs[i] = Products::load_pairs(x + i * p.k + j);
    for (int r = 0; r < R; ++r) {
      const auto w = Products::load_pairs(p.w + (n + r) * p.k + j);
      for (int i = 0; i < I; ++i) acc[r][i] = Products::add_product(acc[r][i], xs[i], w);
    }
  }
  store_rows(p, acc, n, out);
}

// Output row `n` for input rows [0, I) of p.x, the weight row read front to back into
// kChains accumulators per input row (independent chains of products): one sequential
// stream per thread, which this path reads at about twice the rate of several rows side by
// side, where a pass over the weights is all there is (a decode step's few rows).
template <int I>
void stream_row(const Problem& p, int64_t n) {
  Vec acc[I][kChains];
  for (auto& row : acc)
    for (auto& v : row) v = zero();
  const bf16* w = p.w + n * p.k;
  constexpr int64_t kStride = kChains * Products::kStep;
  int64_t j = 0;
  for (; j + kStride <= p.k; j += kStride)
    for (int c = 0; c < kChains; ++c) {
      const auto wv = Products::load_pairs(w + j + c * Products::kStep);
      for (int i = 0; i < I; ++i)
        acc[i][c] = Products::add_product(acc[i][c], Products::load_pairs(p.x + i * p.k + j + c * Products::kStep), wv);
    }
  for (; j < p.k; j += Products::kStep) {
    const auto wv = Products::load_pairs(w + j);
    for (int i = 0; i < I; ++i) acc[i][0] = Products::add_product(acc[i][0], Products::load_pairs(p.x + i * p.k + j), wv);
  }
  for (int i = 0; i < I; ++i) {
    Vec total = acc[i][0];
    for (int c = 1; c < kChains; ++c) total = add(total, acc[i][c]);
    p.out[i * p.n + n] = bf16(sum(total) + bias_of(p, n));
  }
}

template <int I>
void stream_span(const Problem& p, int64_t first, int64_t last) {
  for (int64_t n = first; n < last; ++n) stream_row<I>(p, n);
}

template <int I>
void output_span(const Problem& p, int64_t m, int64_t first, int64_t last) {
  const bf16* x = p.x + m * p.k;
  bf16* out = p.out + m * p.n;
  int64_t n = first;
  for (; n + kRows <= last; n += kRows) dot_rows<kRows, I>(p, x, n, out);
  for (; n < last; ++n) dot_rows<1, I>(p, x, n, out);
}

void run(const Problem& p, int64_t rows) {
  const int64_t units = (p.n + kUnit - 1) / kUnit;
  if (rows <= kInputs) {  // one pass over the weights: stream it
    at::parallel_for(0, units, 4, [&](int64_t first_unit, int64_t last_unit) {
      const int64_t first = first_unit * kUnit, last = std::min(p.n, last_unit * kUnit);
      switch (rows) {
        case 1: stream_span<1>(p, first, last); break;
        case 2: stream_span<2>(p, first, last); break;
        case 3: stream_span<3>(p, first, last); break;
        default: stream_span<4>(p, first, last);
      }
    });
    return;
  }
  at::parallel_for(0, units, 4, [&](int64_t first_unit, int64_t last_unit) {
    for (int64_t unit = first_unit; unit < last_unit; ++unit) {
      const int64_t first = unit * kUnit, last = std::min(p.n, first + kUnit);
      for (int64_t m = 0; m < rows; m += kInputs) {
        switch (std::min<int64_t>(kInputs, rows - m)) {
          case 1: output_span<1>(p, m, first, last); break;
          case 2: output_span<2>(p, m, first, last); break;
          case 3: output_span<3>(p, m, first, last); break;
          default: output_span<4>(p, m, first, last);
        }
      }
    }
  });
}

// x [M, K], weight [N, K], bias [N] or none: bfloat16, contiguous, K a multiple of 32.
// Returns [M, N] in bfloat16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.is_contiguous() && weight.is_contiguous(),
              "bf16_linear takes contiguous 2-D x and weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_linear computes bfloat16");
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on K");
  TORCH_CHECK(x.size(1) % kColumns == 0, "K a multiple of 32");
  const bf16* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == weight.size(0),
                "a contiguous bfloat16 bias of N values");
    bias_data = bias->data_ptr<bf16>();
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  const Problem p{x.data_ptr<bf16>(), weight.data_ptr<bf16>(), bias_data, out.data_ptr<bf16>(), x.size(1),
                  weight.size(0)};
  if (x.size(0) > 0 && p.n > 0) run(p, x.size(0));
  return out;
}

}  // namespace

TORCH_LIBRARY(iris_bf16, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &bf16_linear);
}
