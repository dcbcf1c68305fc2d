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
// bfloat16 inputs are widened first and outputs rounded once, as a bf16 GEMM does, or on a
// CPU with AVX512-BF16 multiplied in bf16 pairs against the weights rounded to bf16
// (`dot_rows_bf16`: half the multiply instructions, and the inputs read as they are).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

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
  const c10::BFloat16* x16;  // the same rows in bfloat16 (bfloat16 inputs only)
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

#if defined(__AVX512BF16__)
// The same for bfloat16 inputs on a CPU with AVX512-BF16, 32 columns at a time: the
// weights times their block's scale (itself rounded to bfloat16 first) rounded to
// bfloat16, exactly the weight the dequantizing path makes in bfloat16, then bf16 pair
// products summed in float32 (vdpbf16ps), as a bf16 GEMM sums them. Whole blocks only
// (offset 0, K a multiple of 32): a partial vector has no pair instruction.
template <int R, int I, typename Out>
void dot_rows_bf16(const Problem& p, const c10::BFloat16* x, int64_t n, Out* out) {
  Vec acc[R][I];
  for (auto& row : acc)
    for (auto& v : row) v = zero();
  for (int64_t k = 0, block = 0; k < p.k; k += kBlock, ++block) {
    const int64_t end = std::min(p.k, k + kBlock);
    Vec scale_vec[R];
    for (int r = 0; r < R; ++r) {
      const float rounded = static_cast<float>(c10::BFloat16(p.scales[(n + r) * p.blocks + block]));
      scale_vec[r] = broadcast(rounded * kTwoTo120);
    }
    for (int64_t j = k; j < end; j += 2 * kLanes) {
      __m512bh xs[I];
      for (int i = 0; i < I; ++i) xs[i] = (__m512bh)_mm512_loadu_si512(x + i * p.k + j);
      for (int r = 0; r < R; ++r) {
        const uint8_t* codes = p.w + (n + r) * p.k + j;
        const Vec low = mul(e4m3(codes), scale_vec[r]), high = mul(e4m3(codes + kLanes), scale_vec[r]);
        const __m512bh w = _mm512_cvtne2ps_pbh(high, low);
        for (int i = 0; i < I; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xs[i], w);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < I; ++i) out[i * p.n + n + r] = static_cast<Out>(sum(acc[r][i]));
}
constexpr bool kHasBf16Dots = true;
#else
template <int R, int I, typename Out>
void dot_rows_bf16(const Problem&, const c10::BFloat16*, int64_t, Out*) {}
constexpr bool kHasBf16Dots = false;
#endif

// Weight rows streamed at once (loads in flight), as many as the accumulators allow.
template <int I>
constexpr int kRows = I <= 4 ? 4 : 2;

template <int I, bool kBf16Dots, typename Out>
void output_span(const Problem& p, int64_t m, int64_t first, int64_t last, Out* out) {
  const auto rows = [&](auto r, int64_t n) {
    if constexpr (kBf16Dots)
      dot_rows_bf16<decltype(r)::value, I>(p, p.x16 + m * p.k, n, out);
    else
      dot_rows<decltype(r)::value, I>(p, p.x + m * p.k, n, out);
  };
  int64_t n = first;
  for (; n + kRows<I> <= last; n += kRows<I>) rows(std::integral_constant<int, kRows<I>>{}, n);
  for (; n < last; ++n) rows(std::integral_constant<int, 1>{}, n);
}

template <bool kBf16Dots, typename Out>
void run(const Problem& p, int64_t rows, Out* out) {
  constexpr int64_t kUnit = 4;  // output rows per unit of work (a multiple of every kRows)
  at::parallel_for(0, (p.n + kUnit - 1) / kUnit, 8, [&](int64_t first_unit, int64_t last_unit) {
    const int64_t first = first_unit * kUnit, last = std::min(p.n, last_unit * kUnit);
    for (int64_t m = 0; m < rows; m += kInputs) {
      Out* o = out + m * p.n;
      switch (std::min<int64_t>(kInputs, rows - m)) {
        case 1: output_span<1, kBf16Dots>(p, m, first, last, o); break;
        case 2: output_span<2, kBf16Dots>(p, m, first, last, o); break;
        case 3: output_span<3, kBf16Dots>(p, m, first, last, o); break;
        case 4: output_span<4, kBf16Dots>(p, m, first, last, o); break;
        case 5: output_span<5, kBf16Dots>(p, m, first, last, o); break;
        case 6: output_span<6, kBf16Dots>(p, m, first, last, o); break;
        case 7: output_span<7, kBf16Dots>(p, m, first, last, o); break;
        default: output_span<8, kBf16Dots>(p, m, first, last, o);
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
  const bool pair_dots = kHasBf16Dots && bf16 && offset == 0 && x.size(1) % (2 * kLanes) == 0;
  const at::Tensor x32 = bf16 && !pair_dots ? x.to(at::kFloat) : x;
  at::Tensor out = at::empty({rows, weight.size(0)}, x.options());
  const Problem p{pair_dots ? nullptr : x32.data_ptr<float>(),
                  bf16 ? x.data_ptr<c10::BFloat16>() : nullptr,
                  weight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                  x.size(1), weight.size(0), scales.size(1), offset};
  if (pair_dots)
    run<true>(p, rows, out.data_ptr<c10::BFloat16>());
  else if (bf16)
    run<false>(p, rows, out.data_ptr<c10::BFloat16>());
  else
    run<false>(p, rows, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY(iris_fp8, m) {
  m.def("block_fp8_linear(Tensor x, Tensor weight, Tensor scales, int offset) -> Tensor",
        &block_fp8_linear);
}
