// A bfloat16 linear layer whose weight we pack once, after loading, into blocks of pairs:
// one kernel for every row count, from a decode step's one row to a prefill chunk's
// thousands, on CPUs with AVX512-BF16 (`models/pair_linear.py` picks it there).
//
// Layout: the weight [N, K] as blocks of kBlock output rows (64 on AVX-512), each
// [K/2][kBlock][2]: for every pair of input columns, the block's rows' two weights side by
// side. One vector of it is 16 outputs' pair, so a pair product (vdpbf16ps) with a
// broadcast pair of the input adds two columns' terms to 16 outputs at once, with nothing
// to sum across lanes after.
//
// Why it beats oneDNN's packed weights at few rows: a block is one contiguous stretch of
// memory read front to back, and a thread's blocks are neighbours, so each thread reads
// one sequential stream; oneDNN's layout for a decode step reads several at once and
// gets about half the bandwidth here. At many rows a block (K·kBlock·2 bytes) stays in L2
// while tiles of kTile input rows pass, kTile·kVectors accumulators in registers, which
// keeps the pair products' units busy about as oneDNN's kernels do.
//
// Products accumulate in float32, the bias is added there and each output rounded once,
// as a bf16 GEMM does. Without AVX512-BF16 the same code widens both operands (vec.h), so
// it computes the same values everywhere; only its speed needs the instructions.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "vec.h"

namespace {

using namespace iris;
using bf16 = c10::BFloat16;

constexpr int kVectors = 4;                          // vectors of outputs per block
constexpr int64_t kBlock = kVectors * kLanes;        // output rows per block (64 on AVX-512)
constexpr int kRegisters = kLanes == 16 ? 32 : 16;   // vector registers: AVX-512's, AVX2's
constexpr int kTile = kLanes == 16 ? 6 : 2;          // input rows a block's pass computes
constexpr int64_t kRowsPerTask = 96;                 // input rows per task
constexpr int64_t kPairStride = 2 * kBlock;          // elements per pair of input columns
static_assert(kTile * kVectors + kVectors < kRegisters, "accumulators, weights and a pair");

struct Problem {
  const bf16* x;       // [M, K]
  const bf16* packed;  // [blocks, K/2, kBlock, 2]
  const bf16* bias;    // [N] or null
  bf16* out;           // [M, N]
  int64_t k, n;
};

// The block's `columns` outputs (kBlock but in the last block) of one input row, from
// float32 accumulators: the bias added, each rounded once.
inline void store_outputs(const Problem& p, const Vec* acc, int64_t first_output, int64_t columns, bf16* out) {
  alignas(64) float lanes[kBlock];
  for (int c = 0; c < kVectors; ++c) {
    Vec v = acc[c];
    if (p.bias != nullptr && columns == kBlock) v = add(v, load(p.bias + first_output + c * kLanes));
    store(lanes + c * kLanes, v);
  }
  if (columns == kBlock) {
    for (int c = 0; c < kVectors; ++c) store_rounded(out + c * kLanes, load(lanes + c * kLanes));
    return;
  }
  for (int64_t j = 0; j < columns; ++j)
    out[j] = bf16(lanes[j] + (p.bias == nullptr ? 0.0f : static_cast<float>(p.bias[first_output + j])));
}

// Rows [0, I) of `x` times one block: I·kVectors accumulators, each pair of columns' weights
// loaded once for all I rows.
template <int I>
void block_tile(const Problem& p, const bf16* x, const bf16* block, int64_t first_output, int64_t columns,
                bf16* out) {
  Vec acc[I][kVectors];
  for (auto& row : acc)
    for (auto& v : row) v = zero();
  for (int64_t pair = 0; pair < p.k / 2; ++pair) {
    const bf16* w = block + pair * kPairStride;
    Pairs weights[kVectors];
    for (int c = 0; c < kVectors; ++c) weights[c] = load_pairs(w + c * 2 * kLanes);
    for (int i = 0; i < I; ++i) {
      const Pairs input = broadcast_pair(x + i * p.k + 2 * pair);
      for (int c = 0; c < kVectors; ++c) acc[i][c] = add_pair_products(acc[i][c], input, weights[c]);
    }
  }
  for (int i = 0; i < I; ++i) store_outputs(p, acc[i], first_output, columns, out + i * p.n);
}

// One input row (a decode step's): kVectors accumulators would make a chain of products
// wait on the one before, so even and odd pairs of columns take a set each.
void block_row(const Problem& p, const bf16* x, const bf16* block, int64_t first_output, int64_t columns,
               bf16* out) {
  Vec even[kVectors], odd[kVectors];
  for (int c = 0; c < kVectors; ++c) even[c] = odd[c] = zero();
  const int64_t pairs = p.k / 2;
  int64_t pair = 0;
  for (; pair + 2 <= pairs; pair += 2) {
    const bf16* w = block + pair * kPairStride;
    const Pairs first = broadcast_pair(x + 2 * pair), second = broadcast_pair(x + 2 * pair + 2);
    for (int c = 0; c < kVectors; ++c) even[c] = add_pair_products(even[c], first, load_pairs(w + c * 2 * kLanes));
    for (int c = 0; c < kVectors; ++c)
      odd[c] = add_pair_products(odd[c], second, load_pairs(w + kPairStride + c * 2 * kLanes));
  }
  if (pair < pairs) {
    const bf16* w = block + pair * kPairStride;
    const Pairs last = broadcast_pair(x + 2 * pair);
    for (int c = 0; c < kVectors; ++c) even[c] = add_pair_products(even[c], last, load_pairs(w + c * 2 * kLanes));
  }
  for (int c = 0; c < kVectors; ++c) even[c] = add(even[c], odd[c]);
  store_outputs(p, even, first_output, columns, out);
}

// Input rows [first, last) times block `b`, kTile rows at a time.
void block_rows(const Problem& p, int64_t b, int64_t first, int64_t last) {
  const bf16* block = p.packed + b * p.k * kBlock;
  const int64_t first_output = b * kBlock, columns = std::min(kBlock, p.n - first_output);
  for (int64_t m = first; m < last;) {
    const int64_t rows = std::min<int64_t>(kTile, last - m);
    const bf16* x = p.x + m * p.k;
    bf16* out = p.out + m * p.n + first_output;
    switch (rows) {
      case 1: block_row(p, x, block, first_output, columns, out); break;
      case 2: block_tile<2>(p, x, block, first_output, columns, out); break;
      case 3: block_tile<std::min(3, kTile)>(p, x, block, first_output, columns, out); break;
      case 4: block_tile<std::min(4, kTile)>(p, x, block, first_output, columns, out); break;
      case 5: block_tile<std::min(5, kTile)>(p, x, block, first_output, columns, out); break;
      default: block_tile<kTile>(p, x, block, first_output, columns, out);
    }
    m += rows;
  }
}

int64_t blocks_of(int64_t n) { return (n + kBlock - 1) / kBlock; }

// weight [N, K] bfloat16, K even -> [blocks, K/2, kBlock, 2], the last block's missing rows
// zero.
at::Tensor pack_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "pack_pairs takes a contiguous 2-D bfloat16 weight");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = blocks_of(n);
  TORCH_CHECK(k % 2 == 0, "pack_pairs needs an even number of input columns");
  at::Tensor packed = at::zeros({blocks, k / 2, kBlock, 2}, weight.options());
  const bf16* src = weight.data_ptr<bf16>();
  bf16* dst = packed.data_ptr<bf16>();
  at::parallel_for(0, blocks, 1, [&](int64_t first_block, int64_t last_block) {
    for (int64_t b = first_block; b < last_block; ++b)
      for (int64_t r = 0; r < kBlock && b * kBlock + r < n; ++r) {
        const bf16* row = src + (b * kBlock + r) * k;
        bf16* into = dst + b * k * kBlock + 2 * r;
        for (int64_t pair = 0; pair < k / 2; ++pair) {
          into[pair * kPairStride] = row[2 * pair];
          into[pair * kPairStride + 1] = row[2 * pair + 1];
        }
      }
  });
  return packed;
}

// x [M, K] times a `pack_pairs` weight of `out_features` rows (+ bias [N]): [M, N], all
// bfloat16. A task is (block, run of kRowsPerTask input rows), blocks outermost, so a
// thread's consecutive tasks share a block while it is in cache.
at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "pair_linear takes contiguous 2-D bfloat16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kBlock && packed.size(3) == 2,
              "pair_linear takes a weight from pack_pairs");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), "x and the packed weight disagree on K");
  TORCH_CHECK(out_features > 0 && blocks_of(out_features) == packed.size(0), "out_features and the blocks disagree");
  const bf16* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "a contiguous bfloat16 bias of N values");
    bias_data = bias->data_ptr<bf16>();
  }
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  const Problem p{x.data_ptr<bf16>(), packed.data_ptr<bf16>(), bias_data, out.data_ptr<bf16>(), x.size(1),
                  out_features};
  const int64_t m = x.size(0), runs = (m + kRowsPerTask - 1) / kRowsPerTask, blocks = packed.size(0);
  if (m == 0) return out;
  at::parallel_for(0, blocks * runs, 1, [&](int64_t first_task, int64_t last_task) {
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t b = task / runs, first = (task % runs) * kRowsPerTask;
      block_rows(p, b, first, std::min(m, first + kRowsPerTask));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(iris_pairs, m) {
  m.def("pack_pairs(Tensor weight) -> Tensor", &pack_pairs);
  m.def("pair_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor", &pair_linear);
}
