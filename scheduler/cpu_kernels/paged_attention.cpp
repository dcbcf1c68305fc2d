// Decode attention over the paged KV cache on a CPU: every decoding sequence of a step in
// one call, reading each sequence's keys and values once, where it is. A task of PyTorch's
// thread pool is (sequence, KV head, part of the context of at most kPart tokens); each
// keeps, for every query head sharing that KV head, a running maximum, its sum of
// exponentials and an unnormalised output (online softmax over blocks of one vector of
// tokens), and the parts are merged by their log-sum-exps. Float32 arithmetic throughout;
// bfloat16 caches are widened as they are read and the output rounded once.
//
// The cache is head-major, `[kv_heads, slots, head_dim]` per layer, and a context is a list
// of runs of consecutive slots (`sdpa.py`'s spans), so nothing is gathered.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using namespace iris;

constexpr int64_t kPart = 256;      // context tokens per task
constexpr int64_t kMaxGroup = 16;   // query heads per KV head
constexpr int64_t kMaxDim = 256;    // head_dim
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Span {
  int64_t first_slot, length;
};

template <typename T>
struct Layer {
  const T* keys;
  const T* values;
  int64_t head_stride;  // elements between KV heads (slots * head_dim)
};

// One task's result, unnormalised: its share of the output and its softmax statistics.
struct Partial {
  float* out;      // [group, dim]
  float* maximum;  // [group]
  float* total;    // [group]
};

// Independent chains of products a loop keeps in registers (enough to hide an FMA's latency):
// a small group's key rows are scored several at once, its output vectors added several at
// once; a group of kChains or more is enough chains by itself.
constexpr int kChains = 8;
constexpr int kValueChains = 16;  // an output vector's chain also waits on its load and broadcast

// scores[g][j + r] for the R key rows from j: q_g · k, each row's products in the order one
// row alone would take them (R rows at once only interleave independent chains).
template <typename T, int G, int R>
inline void score_rows(const float* q, int64_t runtime_group, const T* keys, int64_t dim, int64_t j,
                       float (*scores)[kLanes]) {
  const int64_t group = G > 0 ? G : runtime_group;
  Vec acc[R][G > 0 ? G : kMaxGroup];
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < group; ++g) acc[r][g] = zero();
  for (int64_t i = 0; i < dim; i += kLanes) {
    Vec k[R];
    for (int r = 0; r < R; ++r) k[r] = load(keys + (j + r) * dim + i);
    for (int64_t g = 0; g < group; ++g) {
      const Vec query = load(q + g * dim + i);
      for (int r = 0; r < R; ++r) acc[r][g] = fma(query, k[r], acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < group; ++g) scores[g][j + r] = sum(acc[r][g]);
}

// out[g] vectors [first, first + C) += Σ_j weights[g][j] · v_j over the block's n rows,
// row after row for each vector as the single-vector loop would add them.
template <typename T, int G, int C>
inline void add_values(float* out, int64_t runtime_group, int64_t dim, const T* values, int64_t n,
                       const float (*weights)[kLanes], int64_t first) {
  const int64_t group = G > 0 ? G : runtime_group;
  Vec acc[G > 0 ? G : kMaxGroup][C];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = load(out + g * dim + (first + c) * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    for (int c = 0; c < C; ++c) {
      const Vec v = load(values + j * dim + (first + c) * kLanes);
      for (int64_t g = 0; g < group; ++g) acc[g][c] = fma(broadcast(weights[g][j]), v, acc[g][c]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) store(out + g * dim + (first + c) * kLanes, acc[g][c]);
}

// The outputs' vectors C at a time, C the most that divides them with G·C registers.
template <typename T, int G>
void add_all_values(float* out, int64_t group, int64_t dim, const T* values, int64_t n,
                    const float (*weights)[kLanes]) {
  const int64_t vectors = dim / kLanes;
  auto fits = [&](int64_t c) { return G > 0 && G * c <= kValueChains && vectors % c == 0; };
  const int64_t c = fits(8) ? 8 : fits(4) ? 4 : fits(2) ? 2 : 1;
  for (int64_t i = 0; i < vectors; i += c) {
    switch (c) {
      case 8: add_values<T, G, 8>(out, group, dim, values, n, weights, i); break;
      case 4: add_values<T, G, 4>(out, group, dim, values, n, weights, i); break;
      case 2: add_values<T, G, 2>(out, group, dim, values, n, weights, i); break;
      default: add_values<T, G, 1>(out, group, dim, values, n, weights, i);
    }
  }
}

// The first slot of the block `ahead` blocks after the one at context position `t` of span
// `s` (whose first position is `span_start`), in the order the loop below visits blocks
// (a span's blocks start at its first position); -1 where that is at or past `last`.
inline int64_t slot_ahead(const Span* spans, int64_t num_spans, int64_t s, int64_t span_start, int64_t t,
                          int64_t last, int ahead) {
  for (int a = 0; a < ahead; ++a) {
    t += kLanes;
    while (true) {
      if (t >= last) return -1;
      if (t < span_start + spans[s].length) break;
      span_start += spans[s].length;
      if (++s >= num_spans) return -1;
      t = span_start;
    }
  }
  return spans[s].first_slot + (t - span_start);
}

// Attention of `group` query rows (`q`, float32, already scaled) over `tokens` [first, last)
// of a context given as `spans`, for KV head `head`. `G` is the group when it is one of the
// common sizes, compiled as a constant so the accumulators stay in registers; 0: any group.
template <typename T, int G>
void attend_part(const float* q, int64_t runtime_group, int64_t dim, const Layer<T>& layer, int64_t head,
                 const Span* spans, int64_t num_spans, int64_t first, int64_t last, Partial part) {
  const int64_t group = G > 0 ? G : runtime_group;
  const int64_t vectors = dim / kLanes;
  for (int64_t g = 0; g < group; ++g) {
    part.maximum[g] = kNegInf;
    part.total[g] = 0;
    std::fill(part.out + g * dim, part.out + (g + 1) * dim, 0.0f);
  }
  alignas(64) float scores[kMaxGroup][kLanes];
  alignas(64) float weights[kMaxGroup][kLanes];
  int64_t span_start = 0;  // the context position of the current span's first token
  for (int64_t s = 0; s < num_spans && span_start < last; span_start += spans[s].length, ++s) {
    const int64_t from = std::max(first, span_start), to = std::min(last, span_start + spans[s].length);
    for (int64_t t = from; t < to; t += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, to - t);
      const int64_t slot = spans[s].first_slot + (t - span_start);
      const T* keys = layer.keys + head * layer.head_stride + slot * dim;
      const T* values = layer.values + head * layer.head_stride + slot * dim;
      // the block after next, in this run or a later one (a page's run is one block)
      const int64_t ahead = slot_ahead(spans, num_spans, s, span_start, t, last, 2);
      if (ahead >= 0) {
        const int64_t offset = head * layer.head_stride + ahead * dim;
        const char* next_keys = reinterpret_cast<const char*>(layer.keys + offset);
        const char* next_values = reinterpret_cast<const char*>(layer.values + offset);
        for (int64_t byte = 0; byte < kLanes * dim * int64_t(sizeof(T)); byte += 64) {
          __builtin_prefetch(next_keys + byte);
          __builtin_prefetch(next_values + byte);
        }
      }
      int64_t j = 0;  // scores: each key row read once for the group, R rows at a time
      constexpr int R = G > 0 && G < kChains ? kChains / G : 1;
      for (; j + R <= n; j += R) score_rows<T, G, R>(q, group, keys, dim, j, scores);
      for (; j < n; ++j) score_rows<T, G, 1>(q, group, keys, dim, j, scores);
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t j = n; j < kLanes; ++j) scores[g][j] = kNegInf;
        const Vec block = load(scores[g]);
        const float maximum = std::max(part.maximum[g], max_of(block));
        const float correction = exp_nonpositive(part.maximum[g] - maximum);
        const Vec w = exp_nonpositive(add(block, broadcast(-maximum)));
        store(weights[g], w);
        part.total[g] = part.total[g] * correction + sum(w);
        part.maximum[g] = maximum;
        if (correction != 1.0f) {
          float* out = part.out + g * dim;
          for (int64_t i = 0; i < vectors; ++i)
            store(out + i * kLanes, mul(load(out + i * kLanes), broadcast(correction)));
        }
      }
      // values: several of the outputs' vectors kept in registers while the block's rows
      // pass, so each register's chain of products waits on one product per row
      add_all_values<T, G>(part.out, group, dim, values, n, weights);
    }
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
         const int64_t* span_data, const int64_t* sequence_spans, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(0);
  const int64_t group = heads / kv_heads;
  const Layer<T> layer{keys.data_ptr<T>(), values.data_ptr<T>(), keys.stride(0)};
  const Span* spans = reinterpret_cast<const Span*>(span_data);
  std::vector<int64_t> first_part(batch + 1, 0), lengths(batch, 0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = sequence_spans[b]; s < sequence_spans[b + 1]; ++s) {
      TORCH_CHECK(spans[s].first_slot >= 0 && spans[s].length >= 0 &&
                      spans[s].first_slot + spans[s].length <= keys.size(1),
                  "a span outside the cache's slots");
      lengths[b] += spans[s].length;
    }
    first_part[b + 1] = first_part[b] + std::max<int64_t>(1, (lengths[b] + kPart - 1) / kPart);
  }
  std::vector<int64_t> sequence_of(first_part[batch]);
  for (int64_t b = 0; b < batch; ++b)
    std::fill(sequence_of.begin() + first_part[b], sequence_of.begin() + first_part[b + 1], b);
  const int64_t parts = first_part[batch];
  // float32 queries, scaled once
  std::vector<float> queries(batch * heads * dim);
  const T* q_data = q.data_ptr<T>();
  for (int64_t i = 0; i < batch * heads * dim; ++i) queries[i] = static_cast<float>(q_data[i]) * scale;
  std::vector<float> outs(parts * heads * dim), maxima(parts * heads), totals(parts * heads);
  at::parallel_for(0, parts * kv_heads, 1, [&](int64_t first_task, int64_t last_task) {
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t part = task / kv_heads, head = task % kv_heads, b = sequence_of[part];
      const int64_t first = (part - first_part[b]) * kPart, last = std::min(lengths[b], first + kPart);
      const int64_t row = part * heads + head * group;
      Partial result{outs.data() + row * dim, maxima.data() + row, totals.data() + row};
      const float* query = queries.data() + (b * heads + head * group) * dim;
      const Span* own = spans + sequence_spans[b];
      const int64_t count = sequence_spans[b + 1] - sequence_spans[b];
      switch (group) {
        case 1: attend_part<T, 1>(query, group, dim, layer, head, own, count, first, last, result); break;
        case 2: attend_part<T, 2>(query, group, dim, layer, head, own, count, first, last, result); break;
        case 4: attend_part<T, 4>(query, group, dim, layer, head, own, count, first, last, result); break;
        case 8: attend_part<T, 8>(query, group, dim, layer, head, own, count, first, last, result); break;
        default: attend_part<T, 0>(query, group, dim, layer, head, own, count, first, last, result);
      }
    }
  });
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t first_row, int64_t last_row) {
    std::vector<float> merged(dim);
    for (int64_t r = first_row; r < last_row; ++r) {
      const int64_t b = r / heads, h = r % heads;
      float maximum = kNegInf;
      for (int64_t p = first_part[b]; p < first_part[b + 1]; ++p) maximum = std::max(maximum, maxima[p * heads + h]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0;
      for (int64_t p = first_part[b]; p < first_part[b + 1]; ++p) {
        const float weight = exp_nonpositive(maxima[p * heads + h] - maximum);
        total += totals[p * heads + h] * weight;
        const float* part_out = outs.data() + (p * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) merged[d] += part_out[d] * weight;
      }
      const float inverse = total > 0 ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < dim; ++d) out_data[r * dim + d] = static_cast<T>(merged[d] * inverse);
    }
  });
}

// q [batch, heads, dim]; keys, values [kv_heads, slots, dim] (a layer of the cache);
// spans [S, 2] int64 (first slot, length); sequence_spans [batch + 1] int64 (sequence b's
// spans are rows sequence_spans[b]..sequence_spans[b+1] of spans). Returns [batch, heads, dim].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& spans, const at::Tensor& sequence_spans, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "q [B, H, D], keys/values [Hkv, slots, D]");
  TORCH_CHECK(q.is_contiguous() && spans.is_contiguous() && sequence_spans.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(keys.strides() == values.strides() && keys.stride(2) == 1 && keys.stride(1) == q.size(2),
              "keys and values are [kv_heads, slots, head_dim] with consecutive slots");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(), "one dtype");
  TORCH_CHECK(spans.scalar_type() == at::kLong && sequence_spans.scalar_type() == at::kLong, "int64 spans");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 2 && sequence_spans.numel() == q.size(0) + 1, "span shapes");
  const int64_t* bounds = sequence_spans.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(bounds[b] >= 0 && bounds[b] <= bounds[b + 1] && bounds[b + 1] <= spans.size(0),
                "sequence_spans must rise within the spans");
  const int64_t dim = q.size(2), kv_heads = keys.size(0);
  TORCH_CHECK(dim % kLanes == 0 && dim <= kMaxDim, "head_dim a multiple of the vector, at most 256");
  TORCH_CHECK(q.size(1) % kv_heads == 0 && q.size(1) / kv_heads <= kMaxGroup, "query heads per KV head");
  at::Tensor out = at::empty_like(q);
  const int64_t* span_data = spans.data_ptr<int64_t>();
  const int64_t* sequence_data = sequence_spans.data_ptr<int64_t>();
  if (q.scalar_type() == at::kFloat)
    run<float>(q, keys, values, span_data, sequence_data, scale, out);
  else if (q.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(q, keys, values, span_data, sequence_data, scale, out);
  else
    TORCH_CHECK(false, "paged_decode_attention computes float32 or bfloat16");
  return out;
}

}  // namespace

TORCH_LIBRARY(iris_attention, m) {
  m.def("paged_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor spans, "
        "Tensor sequence_spans, float scale) -> Tensor",
        &paged_decode_attention);
}
