// Decode attention over the paged KV cache on a CPU: every decoding sequence of a step in
// one call, reading each sequence's keys and values once, where it is. A task of PyTorch's
// thread pool is (sequence, KV head, part of the context of at most kPart tokens); each
// keeps, for every query head sharing that KV head, its maximum score, its sum of
// exponentials and an unnormalised output, and the parts are merged by their log-sum-exps.
// Float32 sums throughout; bfloat16 caches are widened as they are read (or multiplied as
// bf16 pairs, below) and the output rounded once. The generic path is an online softmax
// over blocks of one vector of tokens; bf16 on AVX512-BF16 has its own, below.
//
// The cache is head-major, `[kv_heads, slots, head_dim]` per layer, and a context is a list
// of runs of consecutive slots (`sdpa.py`'s spans), so nothing is gathered.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>
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

#if defined(__AVX512BF16__)
// Bfloat16 caches where the CPU has AVX512-BF16. A part takes two passes, each reading one
// of the cache's arrays front to back: the scores of all its tokens from the keys, one
// softmax over them, then the values. Scores: a block's kLanes key rows each against the
// raw bf16 query by pair products (vdpbf16ps: nothing widened, half the instructions), the
// scale applied to the sums, and each row's vector summed across by one transpose-and-add
// tree for the whole block. Values: float32 weights times the rows' even and odd elements,
// both exact float32 from one load (no shuffle); the outputs come out in even/odd order,
// put back at the end. The weights stay float32: rounded to bf16 for pair products (as
// PyTorch's flash attention does) they move a token of the bf16 transformers parity test.
constexpr int64_t kPairChunk = 2 * kLanes;  // bf16 values in one vector of pairs

// Lane j of the result is the sum of rows[transposed(j)]'s lanes, transposed(j) =
// (j % 4) · 4 + j / 4: four levels of halving, each pairing vectors by a shuffle and an add.
inline Vec transposed_sums(Vec (&rows)[kLanes]) {
  Vec s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves
    s1[i] = add(_mm512_shuffle_f32x4(rows[2 * i], rows[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                _mm512_shuffle_f32x4(rows[2 * i], rows[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters
    s2[i] = add(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // pairs of lanes
    s3[i] = add(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return add(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

using BF16 = c10::BFloat16;

// The scaled scores of query row `q` against the block's key rows (rows past the block
// point at zeros), lane j for row j.
inline Vec pair_scores(const BF16* q, const BF16* const (&rows)[kLanes], int64_t dim, float scale) {
  Vec acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = zero();
  for (int64_t c = 0; c < dim; c += kPairChunk) {
    const Pairs query = load_pairs(q + c);
    for (int j = 0; j < kLanes; ++j)  // acc[j] is row transposed(j): the tree puts it at j
      acc[j] = add_pair_products(acc[j], load_pairs(rows[(j % 4) * 4 + j / 4] + c), query);
  }
  return mul(transposed_sums(acc), broadcast(scale));
}

// out[g] (in even/odd order) += Σ_j weights[g][j] · v_j over the block's n rows, for the
// vectors of pairs [first, first + C): a vector of 2·kLanes bf16 values read as kLanes int32
// lanes gives its even elements shifted up 16 bits and its odd ones masked, both exact
// float32, with no shuffle; the float32 weights multiply them as the generic path does.
template <int G, int C>
inline void add_value_halves(float* out, int64_t dim, const BF16* const (&rows)[kLanes], int64_t n,
                             const float (*weights)[kPart], int64_t first) {
  Vec even[G][C], odd[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      even[g][c] = load(out + g * dim + (first + c) * kPairChunk);
      odd[g][c] = load(out + g * dim + (first + c) * kPairChunk + kLanes);
    }
  for (int64_t j = 0; j < n; ++j) {
    Vec w[G];
    for (int g = 0; g < G; ++g) w[g] = broadcast(weights[g][j]);
    for (int c = 0; c < C; ++c) {
      const Ints v = _mm512_loadu_si512(rows[j] + (first + c) * kPairChunk);
      const Vec low = bits(shift_left(v, 16)), high = bits(and_(v, 0xFFFF0000u));
      for (int g = 0; g < G; ++g) {
        even[g][c] = fma(w[g], low, even[g][c]);
        odd[g][c] = fma(w[g], high, odd[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      store(out + g * dim + (first + c) * kPairChunk, even[g][c]);
      store(out + g * dim + (first + c) * kPairChunk + kLanes, odd[g][c]);
    }
}

// The even/odd order back to dimensions, a vector of pairs at a time.
inline void deinterleave(float* out, int64_t values) {
  const Ints first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const Ints second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t i = 0; i < values; i += kPairChunk) {
    const Vec even = load(out + i), odd = load(out + i + kLanes);
    store(out + i, _mm512_permutex2var_ps(even, first, odd));
    store(out + i + kLanes, _mm512_permutex2var_ps(even, second, odd));
  }
}

// Every vector of pairs, C at a time: the most of 8 / G (2·G·C accumulators) that divide them.
template <int G>
void add_all_value_halves(float* out, int64_t dim, const BF16* const (&rows)[kLanes], int64_t n,
                          const float (*weights)[kPart]) {
  const int64_t chunks = dim / kPairChunk;
  auto fits = [&](int64_t c) { return G * c <= 8 && chunks % c == 0; };
  const int64_t c = fits(8) ? 8 : fits(4) ? 4 : fits(2) ? 2 : 1;
  for (int64_t i = 0; i < chunks; i += c) {
    if constexpr (G <= 1) {
      if (c == 8) { add_value_halves<G, 8>(out, dim, rows, n, weights, i); continue; }
    }
    if constexpr (G <= 2) {
      if (c == 4) { add_value_halves<G, 4>(out, dim, rows, n, weights, i); continue; }
    }
    if constexpr (G <= 4) {
      if (c == 2) { add_value_halves<G, 2>(out, dim, rows, n, weights, i); continue; }
    }
    add_value_halves<G, 1>(out, dim, rows, n, weights, i);
  }
}

// The blocks of kLanes context tokens in [first, last) of `spans`, in order: `visit(slot, n,
// index)` for each (its first slot, its tokens, its index from 0), after prefetching into
// L2 the `kAhead`-th block after it of the run `head_offset` + slot · dim of `rows`.
template <typename Visit>
inline void for_each_block(const Span* spans, int64_t num_spans, int64_t first, int64_t last, const BF16* rows,
                           int64_t dim, Visit&& visit) {
  constexpr int kAhead = 1;
  int64_t index = 0, span_start = 0;
  for (int64_t s = 0; s < num_spans && span_start < last; span_start += spans[s].length, ++s) {
    const int64_t from = std::max(first, span_start), to = std::min(last, span_start + spans[s].length);
    for (int64_t t = from; t < to; t += kLanes, ++index) {
      const int64_t ahead = slot_ahead(spans, num_spans, s, span_start, t, last, kAhead);
      if (ahead >= 0) {
        const char* next = reinterpret_cast<const char*>(rows + ahead * dim);
        for (int64_t byte = 0; byte < kLanes * dim * int64_t(sizeof(BF16)); byte += 64)
          __builtin_prefetch(next + byte, 0, 2);
      }
      visit(spans[s].first_slot + (t - span_start), std::min<int64_t>(kLanes, to - t), index);
    }
  }
}

// A part's attention in two passes, each reading one of the cache's arrays front to back:
// the scores of all its tokens from the keys, one softmax, then the values.
template <int G>
void attend_part_pairs(const BF16* q, float scale, int64_t dim, const Layer<BF16>& layer, int64_t head,
                       const Span* spans, int64_t num_spans, int64_t first, int64_t last, Partial part) {
  alignas(64) static const BF16 zeros[kMaxDim] = {};
  alignas(64) float scores[G][kPart];
  const BF16* keys = layer.keys + head * layer.head_stride;
  const BF16* values = layer.values + head * layer.head_stride;
  auto rows_of = [&](const BF16* array, int64_t slot, int64_t n, const BF16* (&rows)[kLanes]) {
    for (int j = 0; j < kLanes; ++j) rows[j] = j < n ? array + (slot + j) * dim : zeros;
  };
  int64_t blocks = 0;
  for_each_block(spans, num_spans, first, last, keys, dim, [&](int64_t slot, int64_t n, int64_t index) {
    const BF16* rows[kLanes];
    rows_of(keys, slot, n, rows);
    const __mmask16 inside = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g)
      store(scores[g] + index * kLanes,
            _mm512_mask_mov_ps(broadcast(kNegInf), inside, pair_scores(q + g * dim, rows, dim, scale)));
    blocks = index + 1;
  });
  for (int g = 0; g < G; ++g) {
    Vec maximum = broadcast(kNegInf);
    for (int64_t i = 0; i < blocks; ++i) maximum = max(maximum, load(scores[g] + i * kLanes));
    const float most = max_of(maximum);
    Vec total = zero();
    for (int64_t i = 0; i < blocks; ++i) {
      const Vec w = exp_nonpositive(add(load(scores[g] + i * kLanes), broadcast(-most)));
      total = add(total, w);
      store(scores[g] + i * kLanes, w);  // the weights, in place of the scores
    }
    part.maximum[g] = most;
    part.total[g] = sum(total);
    std::fill(part.out + g * dim, part.out + (g + 1) * dim, 0.0f);
  }
  for_each_block(spans, num_spans, first, last, values, dim, [&](int64_t slot, int64_t n, int64_t index) {
    const BF16* rows[kLanes];
    rows_of(values, slot, n, rows);
    const float(*weights)[kPart] = reinterpret_cast<const float(*)[kPart]>(&scores[0][index * kLanes]);
    add_all_value_halves<G>(part.out, dim, rows, n, weights);
  });
  for (int g = 0; g < G; ++g) deinterleave(part.out + g * dim, dim);
}
#endif

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
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, BF16>) {
        if (dim % kPairChunk == 0) {
          const BF16* raw = q_data + (b * heads + head * group) * dim;
          switch (group) {
            case 1: attend_part_pairs<1>(raw, scale, dim, layer, head, own, count, first, last, result); continue;
            case 2: attend_part_pairs<2>(raw, scale, dim, layer, head, own, count, first, last, result); continue;
            case 4: attend_part_pairs<4>(raw, scale, dim, layer, head, own, count, first, last, result); continue;
            case 8: attend_part_pairs<8>(raw, scale, dim, layer, head, own, count, first, last, result); continue;
            default: break;
          }
        }
      }
#endif
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
