// Block-FP8 linear for a few rows on a CPU: y = x · Wᵀ with W in e4m3 and one float32 scale
// per 128-column block of each row (the row-expanded grid `block_fp8` holds), reading each
// weight byte once and widening it in registers. A decode step's rows are few, so the layer
// costs what its bytes cost to read: a quarter of float32's, half of bfloat16's.
//
// e4m3 to float32 by moving bits (as `block_fp8._e4m3_bits` does on tensors): the byte,
// sign-extended to 32 bits and shifted left by 20, has e4m3's sign at bit 31 and its 4
// exponent and 3 mantissa bits at the bottom of float32's exponent and the top of its
// mantissa; masking the sign's copies away leaves the code's value times 2^-120 (normal and
// subnormal alike), which the block's scale takes back. Products accumulate in float32;
// bfloat16 inputs are widened first and outputs rounded once, as a bf16 GEMM does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"

namespace {

using namespace iris;

constexpr int64_t kBlock = 128;        // the format's block of columns
constexpr int kInputs = 8;             // input rows per pass: each weight widened once per pass
constexpr float kTwoTo120 = 0x1p120f;  // what the bit move leaves out
constexpr uint32_t kKeptBits = 0x87F00000u;

inline Vec e4m3(const uint8_t* p) { return bits(and_(shift_left(sign_extended_bytes(p), 20), kKeptBits)); }

inline float e4m3_scalar(uint8_t code) {
  uint32_t bits = (static_cast<uint32_t>(static_cast<int8_t>(code)) << 20) & kKeptBits;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

struct Problem {
  const float* x;        // [M, K] float32
  const uint8_t* w;      // [N, K] e4m3 codes
  const float* scales;   // [N, blocks]
  int64_t k, n, blocks;  // K, N and the scale grid's columns
  int64_t offset;        // where column 0 falls in its block (a row-parallel slice)
};

// Rows [n, n + R) of the output for input rows [0, I) of `x`, into `out` (row stride `n`).
template <int R, int I, typename Out>
void dot_rows(const Problem& p, const float* x, int64_t n, Out* out) {
  Vec acc[R][I];
  float tail[R][I] = {};
  for (auto& row : acc)
    for (auto& v : row) v = zero();
  for (int64_t k = 0, block = 0; k < p.k; ++block) {
    const int64_t end = std::min(p.k, (k + p.offset) / kBlock * kBlock + kBlock - p.offset);
    float scale[R];
    Vec scale_vec[R];
    for (int r = 0; r < R; ++r) {
      scale[r] = p.scales[(n + r) * p.blocks + block] * kTwoTo120;
      scale_vec[r] = broadcast(scale[r]);
    }
    int64_t j = k;
    for (; j + kLanes <= end; j += kLanes) {
      Vec xs[I];
      for (int i = 0; i < I; ++i) xs[i] = load(x + i * p.k + j);
      for (int r = 0; r < R; ++r) {
        const Vec w = mul(e4m3(p.w + (n + r) * p.k + j), scale_vec[r]);
        for (int i = 0; i < I; ++i) acc[r][i] = fma(xs[i], w, acc[r][i]);
      }
    }
    for (; j < end; ++j)
      for (int r = 0; r < R; ++r) {
        const float w = e4m3_scalar(p.w[(n + r) * p.k + j]) * scale[r];
        for (int i = 0; i < I; ++i) tail[r][i] += x[i * p.k + j] * w;
      }
    k = end;
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < I; ++i) out[i * p.n + n + r] = static_cast<Out>(sum(acc[r][i]) + tail[r][i]);
}

// Weight rows streamed at once (loads in flight), as many as the accumulators allow.
template <int I>
constexpr int kRows = I <= 4 ? 4 : 2;

template <int I, typename Out>
void output_span(const Problem& p, const float* x, int64_t first, int64_t last, Out* out) {
  int64_t n = first;
  for (; n + kRows<I> <= last; n += kRows<I>) dot_rows<kRows<I>, I>(p, x, n, out);
  for (; n < last; ++n) dot_rows<1, I>(p, x, n, out);
}

template <typename Out>
void run(const Problem& p, int64_t rows, Out* out) {
  constexpr int64_t kUnit = 4;  // output rows per unit of work (a multiple of every kRows)
  at::parallel_for(0, (p.n + kUnit - 1) / kUnit, 8, [&](int64_t first_unit, int64_t last_unit) {
    const int64_t first = first_unit * kUnit, last = std::min(p.n, last_unit * kUnit);
    for (int64_t m = 0; m < rows; m += kInputs) {
      const float* x = p.x + m * p.k;
      Out* o = out + m * p.n;
      switch (std::min<int64_t>(kInputs, rows - m)) {
        case 1: output_span<1>(p, x, first, last, o); break;
        case 2: output_span<2>(p, x, first, last, o); break;
        case 3: output_span<3>(p, x, first, last, o); break;
        case 4: output_span<4>(p, x, first, last, o); break;
        case 5: output_span<5>(p, x, first, last, o); break;
        case 6: output_span<6>(p, x, first, last, o); break;
        case 7: output_span<7>(p, x, first, last, o); break;
        default: output_span<8>(p, x, first, last, o);
      }
    }
  });
}

// x [M, K] (float32 or bfloat16, contiguous), weight [N, K] uint8 (e4m3 codes), scales
// [N, ceil((offset + K) / 128)] float32; returns [M, N] in x's dtype.
at::Tensor block_fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                            int64_t offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous(),
              "block_fp8_linear takes contiguous 2-D tensors");
  TORCH_CHECK(weight.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat,
              "block_fp8_linear takes uint8 codes and float32 scales");
  TORCH_CHECK(x.size(1) == weight.size(1) && scales.size(0) == weight.size(0), "shapes disagree");
  TORCH_CHECK(offset >= 0 && offset < kBlock, "offset is a column within a block");
  TORCH_CHECK(scales.size(1) * kBlock >= offset + x.size(1), "too few scale blocks");
  const int64_t rows = x.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "block_fp8_linear computes float32 or bfloat16");
  const at::Tensor x32 = bf16 ? x.to(at::kFloat) : x;
  at::Tensor out = at::empty({rows, weight.size(0)}, x.options());
  const Problem p{x32.data_ptr<float>(), weight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                  x.size(1), weight.size(0), scales.size(1), offset};
  if (bf16)
    run(p, rows, out.data_ptr<c10::BFloat16>());
  else
    run(p, rows, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY(iris_fp8, m) {
  m.def("block_fp8_linear(Tensor x, Tensor weight, Tensor scales, int offset) -> Tensor",
        &block_fp8_linear);
}
