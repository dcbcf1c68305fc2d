// Non-causal bfloat16 attention over contiguous segments of a flat token axis on a CPU: the
// vision towers' attention (a whole image, or its windows; `models/layers.py`'s
// SegmentPlan); and, with the same tiles, a prefill chunk's attention to a run of its
// history in the paged cache (`history_attention`, query heads grouped on KV heads). PyTorch's CPU flash kernel computes bfloat16 at float32's pace; here
// both products are bf16 pair products (`vec.h`: vdpbf16ps where the CPU has AVX512-BF16)
// accumulated in float32, the softmax runs online in float32 per block of keys, the
// probabilities are rounded to bf16 for their product with V (as flash kernels do) and
// each output is rounded once.
//
// Keys and values are first packed per (segment, head) so that one vector load is what a
// pair product takes: K as [L'/B][D/2][B][2] (a vector: kLanes keys' pair of dims, a block
// of B keys in one piece), V as [L'/2][D'][2] (kLanes dims' pair of keys), with L' the
// segment's length rounded up to a key block, D' the head rounded up to whole vectors, and
// zeros in the padding. A task of PyTorch's thread pool is a tile of query rows of one
// (segment, head), or a whole short segment (a window) packed into the task's own buffers:
// the tile shares each key block while it is in L1, and a group of kRows rows keeps its
// scores in registers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <limits>
#include <memory>
#include <vector>

#include "vec.h"

namespace {

using namespace iris;
using bf16 = c10::BFloat16;

constexpr int kKeyVectors = kLanes == 16 ? 4 : 2;  // score vectors per row per block (registers)
constexpr int64_t kKeyBlock = kKeyVectors * kLanes;
constexpr int kRows = 4;             // query rows whose scores stay in registers
constexpr int64_t kTile = 32;        // query rows per task (a multiple of kRows)
constexpr int kMaxChunk = 6;         // value vectors accumulated at once per row
constexpr int64_t kMaxHead = 256;    // cpu_kernels.MAX_HEAD_DIM
constexpr int64_t kShort = 8 * kKeyBlock;  // segments up to this long are one task each
constexpr int64_t kWhole = -1;       // a task that is a whole (short) segment
constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();

struct Problem {
  const bf16 *q, *k, *v;
  int64_t q_token, q_head, k_token, k_head, v_token, v_head;  // strides, in elements
  bf16* out;                                                  // [total, heads, d]
  int64_t heads, d, d_padded;  // d even; d_padded: whole vectors
  float scale;
  const int64_t* starts;  // segments + 1 token offsets

  int64_t length(int64_t s) const { return starts[s + 1] - starts[s]; }
};

struct Packed {  // one (segment, head)'s keys [L'/B][D/2][B][2] and values [L'/2][D'][2]
  bf16 *keys, *values;
};

int64_t round_up(int64_t n, int64_t step) { return (n + step - 1) / step * step; }

// Two value rows of d into d_padded pairs (even's in each pair's low half, zeros past d).
void interleave(const bf16* even, const bf16* odd, int64_t d, int64_t d_padded, bf16* out) {
  auto* pairs = reinterpret_cast<uint32_t*>(out);
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= d; c += 16) {
    const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + c)));
    const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + c)));
    _mm512_storeu_si512(pairs + c, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
  }
#endif
  for (; c < d; ++c) pairs[c] = uint32_t(even[c].x) | (uint32_t(odd[c].x) << 16);
  for (; c < d_padded; ++c) pairs[c] = 0;
}

// Keys and values [first, first + length) of (KV) head h into their packed layouts (pairs
// moved as 32 bits).
void pack(const Problem& p, int64_t first, int64_t length, int64_t h, Packed into) {
  const int64_t padded = round_up(length, kKeyBlock), pairs = p.d / 2;
  auto* keys = reinterpret_cast<uint32_t*>(into.keys);
  bf16* values = into.values;
  for (int64_t t = 0; t < padded; ++t) {
    uint32_t* column = keys + (t / kKeyBlock) * pairs * kKeyBlock + t % kKeyBlock;
    if (t < length) {
      const bf16* k = p.k + (first + t) * p.k_token + h * p.k_head;
      for (int64_t j = 0; j < pairs; ++j) std::memcpy(column + j * kKeyBlock, k + 2 * j, sizeof(uint32_t));
    } else {
      for (int64_t j = 0; j < pairs; ++j) column[j * kKeyBlock] = 0;
    }
  }
  std::vector<bf16> zeros(p.d, bf16(0.0f));  // the padding keys' values
  for (int64_t t = 0; t < padded; t += 2) {
    auto row = [&](int64_t u) { return u < length ? p.v + (first + u) * p.v_token + h * p.v_head : zeros.data(); };
    interleave(row(t), row(t + 1), p.d, p.d_padded, values + t * p.d_padded);
  }
}

struct Tile {  // one task's running state: its rows' outputs, maxima and sums
  float out[kTile * kMaxHead];
  float maximum[kTile], total[kTile];
  bf16 probabilities[kRows][kKeyBlock];
};

// The scores of rows `query[0..kRows)` against keys [first, first + kKeyBlock): scaled,
// padding keys at -inf (`bias`), into the online softmax; the rows' probabilities into
// `tile.probabilities`, their outputs so far rescaled.
void score_group(const Problem& p, const bf16* const* query, const bf16* keys, int64_t first,
                 const float* bias, Tile& tile, int64_t row) {
  Vec acc[kRows][kKeyVectors];
  for (auto& r : acc)
    for (auto& a : r) a = zero();
  for (int64_t j = 0; j < p.d / 2; ++j) {
    const bf16* key_pairs = keys + (first * (p.d / 2) + j * kKeyBlock) * 2;
    Pairs q[kRows];
    for (int r = 0; r < kRows; ++r) q[r] = broadcast_pair(query[r] + 2 * j);
    for (int c = 0; c < kKeyVectors; ++c) {
      const Pairs k = load_pairs(key_pairs + c * 2 * kLanes);
      for (int r = 0; r < kRows; ++r) acc[r][c] = add_pair_products(acc[r][c], q[r], k);
    }
  }
  const Vec scale = broadcast(p.scale);
  const int64_t vectors = p.d_padded / kLanes;
  for (int r = 0; r < kRows; ++r) {
    Vec block_max = broadcast(kMinusInfinity);
    for (int c = 0; c < kKeyVectors; ++c) {
      acc[r][c] = fma(acc[r][c], scale, load(bias + c * kLanes));
      block_max = max(block_max, acc[r][c]);
    }
    const float before = tile.maximum[row + r];
    const float now = std::max(before, max_of(block_max));
    const Vec shift = broadcast(-now);
    Vec sums = zero();
    for (int c = 0; c < kKeyVectors; ++c) {
      const Vec e = exp_nonpositive(add(acc[r][c], shift));
      sums = add(sums, e);
      store_rounded(tile.probabilities[r] + c * kLanes, e);
    }
    const float rescale = exp_nonpositive(before - now);  // 0 for the first block (-inf)
    tile.maximum[row + r] = now;
    tile.total[row + r] = tile.total[row + r] * rescale + sum(sums);
    if (rescale == 1.0f) continue;  // the maximum held
    float* out = tile.out + (row + r) * p.d_padded;
    const Vec factor = broadcast(rescale);
    for (int64_t c = 0; c < vectors; ++c) store(out + c * kLanes, mul(load(out + c * kLanes), factor));
  }
}

// outputs[rows][first_vector ..+ V] += probabilities · values, over `pairs` key pairs.
template <int V>
void accumulate_values(const Problem& p, const bf16* values, int64_t pairs, int64_t first_vector, Tile& tile,
                       int64_t row) {
  Vec acc[kRows][V];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = load(tile.out + (row + r) * p.d_padded + (first_vector + c) * kLanes);
  for (int64_t u = 0; u < pairs; ++u) {
    const bf16* value_pairs = values + (u * p.d_padded + first_vector * kLanes) * 2;
    Pairs probability[kRows];
    for (int r = 0; r < kRows; ++r) probability[r] = broadcast_pair(tile.probabilities[r] + 2 * u);
    for (int c = 0; c < V; ++c) {
      const Pairs v = load_pairs(value_pairs + c * 2 * kLanes);
      for (int r = 0; r < kRows; ++r) acc[r][c] = add_pair_products(acc[r][c], probability[r], v);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < V; ++c) store(tile.out + (row + r) * p.d_padded + (first_vector + c) * kLanes, acc[r][c]);
}

void accumulate_chunk(const Problem& p, const bf16* values, int64_t pairs, int64_t first, int vectors, Tile& tile,
                      int64_t row) {
  switch (vectors) {
    case 1: accumulate_values<1>(p, values, pairs, first, tile, row); break;
    case 2: accumulate_values<2>(p, values, pairs, first, tile, row); break;
    case 3: accumulate_values<3>(p, values, pairs, first, tile, row); break;
    case 4: accumulate_values<4>(p, values, pairs, first, tile, row); break;
    case 5: accumulate_values<5>(p, values, pairs, first, tile, row); break;
    default: accumulate_values<6>(p, values, pairs, first, tile, row);
  }
}

// Query rows [first_token, first_token + rows) of head h (rows at most kTile; rows past
// them repeat the last, and are not stored) against `length` keys packed in `packed`: the
// outputs into p.out, and where `lse` is given each row's log-sum-exp of its scores there
// (`lse_stride` apart by head, by row after `first_token`).
void attend_rows(const Problem& p, int64_t first_token, int64_t rows, int64_t h, int64_t length, Packed packed,
                 Tile& tile, float* lse = nullptr, int64_t lse_stride = 0) {
  const int64_t groups = (rows + kRows - 1) / kRows;
  const int64_t vectors = p.d_padded / kLanes;
  const int64_t chunk = vectors <= kMaxChunk ? vectors : 4;
  const bf16* keys = packed.keys;
  const bf16* values = packed.values;
  std::fill_n(tile.out, groups * kRows * p.d_padded, 0.0f);
  std::fill_n(tile.maximum, kTile, kMinusInfinity);
  std::fill_n(tile.total, kTile, 0.0f);
  alignas(64) float bias[kKeyBlock];
  for (int64_t first = 0; first < length; first += kKeyBlock) {
    const int64_t real = std::min(kKeyBlock, length - first);
    for (int64_t t = 0; t < kKeyBlock; ++t) bias[t] = t < real ? 0.0f : kMinusInfinity;
    const bf16* block_values = values + (first / 2) * p.d_padded * 2;
    for (int64_t g = 0; g < groups; ++g) {
      const bf16* query[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t token = first_token + std::min<int64_t>(g * kRows + r, rows - 1);
        query[r] = p.q + token * p.q_token + h * p.q_head;
      }
      score_group(p, query, keys, first, bias, tile, g * kRows);
      for (int64_t c = 0; c < vectors; c += chunk)
        accumulate_chunk(p, block_values, (real + 1) / 2, c, std::min(chunk, vectors - c), tile, g * kRows);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Vec inverse = broadcast(1.0f / tile.total[r]);
    bf16* out = p.out + ((first_token + r) * p.heads + h) * p.d;
    const float* acc = tile.out + r * p.d_padded;
    int64_t c = 0;
    for (; c + kLanes <= p.d; c += kLanes) store_rounded(out + c, mul(load(acc + c), inverse));
    for (; c < p.d; ++c) out[c] = bf16(acc[c] / tile.total[r]);
    if (lse != nullptr) lse[h * lse_stride + first_token + r] = tile.maximum[r] + std::log(tile.total[r]);
  }
}

// Query rows [first_row, first_row + kTile) of segment s, head h, against the segment.
void attend_tile(const Problem& p, int64_t s, int64_t h, int64_t first_row, Packed packed, Tile& tile) {
  const int64_t length = p.length(s);
  attend_rows(p, p.starts[s] + first_row, std::min(kTile, length - first_row), h, length, packed, tile);
}

// q, k, v [total, heads, D] bfloat16, each head's D contiguous (any token and head
// strides: views of a fused QKV projection), D even and at most 256; starts: int64
// [segments + 1], the segments' token offsets from 0 to total. Returns [total, heads, D].
at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& starts, double scale) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kBFloat16 && t->stride(2) == 1,
                "segment_attention takes bfloat16 [total, heads, D] with D contiguous");
    TORCH_CHECK(t->sizes() == q.sizes(), "q, k and v of one shape");
  }
  const int64_t total = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && d > 0 && d <= kMaxHead, "a head of an even size up to 256");
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.numel() >= 2,
              "starts: int64 [segments + 1]");
  const int64_t* offsets = starts.data_ptr<int64_t>();
  const int64_t segments = starts.numel() - 1;
  TORCH_CHECK(offsets[0] == 0 && offsets[segments] == total, "starts run from 0 to the token count");
  at::Tensor out = at::empty({total, heads, d}, q.options());
  const Problem p{q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), q.stride(0), q.stride(1),
                  k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.data_ptr<bf16>(), heads, d,
                  round_up(d, kLanes), static_cast<float>(scale), offsets};
  // A short segment (a window) is one task, packed into the task's own buffers while they
  // are in cache; a long one (an image) is packed once for all heads' tiles, tasks of kTile.
  std::vector<int64_t> tasks;  // (segment, first row or kWhole) per head
  std::vector<int64_t> long_segments, packed_at(segments, -1);
  int64_t packed_total = 0;
  for (int64_t s = 0; s < segments; ++s) {
    TORCH_CHECK(offsets[s + 1] >= offsets[s], "starts never decrease");
    const int64_t length = p.length(s);
    if (length <= kShort) {
      if (length > 0) tasks.insert(tasks.end(), {s, kWhole});
      continue;
    }
    long_segments.push_back(s);
    packed_at[s] = packed_total;
    packed_total += round_up(length, kKeyBlock);
    for (int64_t row = 0; row < length; row += kTile) tasks.insert(tasks.end(), {s, row});
  }
  at::Tensor packed_keys = at::empty({heads * packed_total * d}, q.options());
  at::Tensor packed_values = at::empty({heads * packed_total * p.d_padded}, q.options());
  auto packed = [&](int64_t s, int64_t h) {
    const int64_t at = h * packed_total + packed_at[s];
    return Packed{packed_keys.data_ptr<bf16>() + at * d, packed_values.data_ptr<bf16>() + at * p.d_padded};
  };
  const int64_t packs = static_cast<int64_t>(long_segments.size()) * heads;
  at::parallel_for(0, packs, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t s = long_segments[i / heads], h = i % heads;
      pack(p, p.starts[s], p.length(s), h, packed(s, h));
    }
  });
  const int64_t count = static_cast<int64_t>(tasks.size()) / 2;
  at::parallel_for(0, count * heads, 1, [&](int64_t first, int64_t last) {
    auto tile = std::make_unique<Tile>();
    std::vector<bf16> keys(kShort * d), values(kShort * p.d_padded);  // a short segment's
    const Packed own{keys.data(), values.data()};
    for (int64_t i = first; i < last; ++i) {
      const int64_t s = tasks[2 * (i / heads)], row = tasks[2 * (i / heads) + 1], h = i % heads;
      if (row != kWhole) {
        attend_tile(p, s, h, row, packed(s, h), *tile);
        continue;
      }
      pack(p, p.starts[s], p.length(s), h, own);
      for (int64_t r = 0; r < p.length(s); r += kTile) attend_tile(p, s, h, r, own, *tile);
    }
  });
  return out;
}

// q [n, heads, D] against keys and values [kv_heads, L, D] (a run of the paged cache, any
// strides with D contiguous), bfloat16, no mask, query head h reading KV head h / group:
// a prefill chunk's attention to its history (`attention/sdpa.py` merges it with the
// chunk's causal attention to itself by their log-sum-exps). Returns the outputs [n,
// heads, D] and the log-sum-exps [heads, n] in float32. Each KV head is packed once for
// its group's heads; a task is a tile of kTile rows of one head.
std::tuple<at::Tensor, at::Tensor> history_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale) {
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kBFloat16 && t->stride(2) == 1,
                "history_attention takes bfloat16 q [n, heads, D] and k, v [kv_heads, L, D], D contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2), "k and v of one shape, q's head size");
  const int64_t n = q.size(0), heads = q.size(1), kv_heads = k.size(0), length = k.size(1), d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && d > 0 && d <= kMaxHead, "a head of an even size up to 256");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads a multiple of the KV heads");
  TORCH_CHECK(length > 0, "at least one key");
  at::Tensor out = at::empty({n, heads, d}, q.options());
  at::Tensor lse = at::empty({heads, n}, q.options().dtype(at::kFloat));
  const Problem p{q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), q.stride(0), q.stride(1),
                  k.stride(1), k.stride(0), v.stride(1), v.stride(0), out.data_ptr<bf16>(), heads, d,
                  round_up(d, kLanes), static_cast<float>(scale), nullptr};
  const int64_t padded = round_up(length, kKeyBlock), group = heads / kv_heads;
  at::Tensor packed_keys = at::empty({kv_heads * padded * d}, q.options());
  at::Tensor packed_values = at::empty({kv_heads * padded * p.d_padded}, q.options());
  auto packed = [&](int64_t kv) {
    return Packed{packed_keys.data_ptr<bf16>() + kv * padded * d,
                  packed_values.data_ptr<bf16>() + kv * padded * p.d_padded};
  };
  at::parallel_for(0, kv_heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t kv = first; kv < last; ++kv) pack(p, 0, length, kv, packed(kv));
  });
  const int64_t tiles = (n + kTile - 1) / kTile;
  float* lse_data = lse.data_ptr<float>();
  at::parallel_for(0, heads * tiles, 1, [&](int64_t first, int64_t last) {
    auto tile = std::make_unique<Tile>();
    for (int64_t i = first; i < last; ++i) {
      const int64_t h = i / tiles, row = (i % tiles) * kTile;
      attend_rows(p, row, std::min(kTile, n - row), h, length, packed(h / group), *tile, lse_data, n);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(iris_vision, m) {
  m.def("segment_attention(Tensor q, Tensor k, Tensor v, Tensor starts, float scale) -> Tensor",
        &segment_attention);
  m.def("history_attention(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)", &history_attention);
}
