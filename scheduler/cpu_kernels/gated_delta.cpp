// One decode step of Gated DeltaNet (Qwen3.5's linear attention) on a CPU, in place on the
// state slots: for each sequence b and value head h, with S the head's [Dk, Dv] float32
// state (`gated_deltanet.recurrent_delta_step` is the same arithmetic as batched products):
//
//   S ← e^g · S;  u = β (v − Sᵀk);  S ← S + k uᵀ;  out = Sᵀq
//
// in two passes over S (one read for Sᵀk, one read-modify-write that also accumulates
// Sᵀq) instead of a gather, three batched products and a scatter. Tasks of PyTorch's
// thread pool are (sequence, head) pairs.
//
// `gated_delta_decode_step` is the whole decode token from the input projections: the
// causal conv's step and SiLU, q and k scaled to unit length, g and β, then the step
// above; some thirty small PyTorch ops per layer, each a dispatch and a pass over the
// thread pool, become two passes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace iris;

constexpr int64_t kMaxValueDim = 256;

void step_head(float* state, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
               float g, float beta, float* out) {
  const int64_t vectors = dv / kLanes;
  const Vec decay = broadcast(std::exp(g));
  Vec acc[kMaxValueDim / kLanes];
  for (int64_t j = 0; j < vectors; ++j) acc[j] = zero();
  for (int64_t i = 0; i < dk; ++i) {  // Sᵀk, before the decay (applied once, below)
    const Vec ki = broadcast(k[i]);
    for (int64_t j = 0; j < vectors; ++j) acc[j] = fma(ki, load(state + i * dv + j * kLanes), acc[j]);
  }
  Vec update[kMaxValueDim / kLanes];
  const Vec b = broadcast(beta);
  for (int64_t j = 0; j < vectors; ++j) {
    const Vec predicted = mul(acc[j], decay);
    update[j] = mul(add(load(v + j * kLanes), mul(predicted, broadcast(-1.0f))), b);
    acc[j] = zero();
  }
  for (int64_t i = 0; i < dk; ++i) {  // S ← e^g S + k uᵀ, and Sᵀq of the new S
    const Vec ki = broadcast(k[i]), qi = broadcast(q[i]);
    float* row = state + i * dv;
    for (int64_t j = 0; j < vectors; ++j) {
      const Vec s = fma(ki, update[j], mul(load(row + j * kLanes), decay));
      store(row + j * kLanes, s);
      acc[j] = fma(qi, s, acc[j]);
    }
  }
  for (int64_t j = 0; j < vectors; ++j) store(out + j * kLanes, acc[j]);
}

// q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H]: float32, contiguous; states [slots, H, Dk,
// Dv] float32 (one layer's, each head's matrix contiguous); slots [B] int64. Advances the
// states of `slots` in place; returns the outputs [B, H, Dv].
at::Tensor gated_delta_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, at::Tensor states,
                              const at::Tensor& slots) {
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "contiguous float32 inputs");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.dim() == 4, "float32 states [slots, H, Dk, Dv]");
  const int64_t batch = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(states.size(1) == heads && states.size(2) == dk && states.size(3) == dv, "state shape");
  TORCH_CHECK(states.stride(3) == 1 && states.stride(2) == dv, "each head's state contiguous");
  TORCH_CHECK(dv % kLanes == 0 && dv <= kMaxValueDim, "value head size in whole vectors, at most 256");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == batch, "one int64 slot per sequence");
  at::Tensor out = at::empty({batch, heads, dv}, q.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < states.size(0), "a slot outside the states");
  float* state = states.data_ptr<float>();
  const float *qs = q.data_ptr<float>(), *ks = k.data_ptr<float>(), *vs = v.data_ptr<float>();
  const float *gs = g.data_ptr<float>(), *betas = beta.data_ptr<float>();
  float* outs = out.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / heads, h = task % heads;
      float* matrix = state + slot[b] * states.stride(0) + h * states.stride(1);
      step_head(matrix, dk, dv, qs + task * dk, ks + task * dk, vs + task * dv, gs[task], betas[task],
                outs + task * dv);
    }
  });
  return out;
}

// ------------------------------------------------------- the whole decode step, fused

// A value in the model's dtype T, as the PyTorch path rounds it there.
template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

struct Heads {
  int64_t key_heads, value_heads, dk, dv, kernel;  // kernel: the conv's width
  int64_t channels() const { return 2 * key_heads * dk + value_heads * dv; }
};

// Phase 1, sequence b's channels [first, last): the causal conv's step over the window
// (state, new column), its float32 sum rounded to T as the conv's output is, SiLU rounded
// to T as `causal_conv_step` rounds it; the window shifted into the state.
template <typename T>
void conv_channels(const T* column, T* state, const T* weight, const Heads& h, int64_t first, int64_t last,
                   float* mixed) {
  const int64_t window = h.kernel - 1;
  for (int64_t c = first; c < last; ++c) {
    T* kept = state + c * window;
    const T* w = weight + c * h.kernel;
    float total = 0;
    for (int64_t i = 0; i < window; ++i) total += static_cast<float>(w[i]) * static_cast<float>(kept[i]);
    total += static_cast<float>(w[window]) * static_cast<float>(column[c]);
    mixed[c] = rounded<T>(silu(rounded<T>(total)));
    for (int64_t i = 0; i + 1 < window; ++i) kept[i] = kept[i + 1];
    if (window > 0) kept[window - 1] = column[c];
  }
}

// `x` scaled to unit length (its sum of squares plus `kL2Eps` under the root, as
// `l2_normalized`), times `scale`, into `out`.
constexpr float kL2Eps = 1e-6f;
inline void l2_normalize(const float* x, int64_t n, float scale, float* out) {
  float squares = 0;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float factor = 1.0f / std::sqrt(squares + kL2Eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * factor * scale;
}

// columns [B, C], a, b [B, Hv] (any row stride: views of one projection's output),
// conv_states [slots, C, kernel - 1] and conv_weight [C, 1, kernel] in the model's dtype;
// A_log, dt_bias [Hv]; recurrent [slots, Hv, Dk, Dv] float32; slots [B] int64. One decode
// token per sequence from the input projections to the delta rule's output [B, Hv, Dv]
// float32, the conv and recurrent states of `slots` advanced in place: what `_step` does
// after `forward`'s g and β, in two parallel passes instead of some thirty small ops.
template <typename T>
at::Tensor decode_step(const at::Tensor& columns, const at::Tensor& a, const at::Tensor& b, at::Tensor conv_states,
                       const at::Tensor& conv_weight, const at::Tensor& A_log, const at::Tensor& dt_bias,
                       at::Tensor recurrent, const at::Tensor& slots, const Heads& h) {
  const int64_t batch = columns.size(0), channels = h.channels();
  at::Tensor out = at::empty({batch, h.value_heads, h.dv}, columns.options().dtype(at::kFloat));
  std::vector<float> mixed(batch * channels);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const T* column_data = columns.data_ptr<T>();
  T* conv_data = conv_states.data_ptr<T>();
  const T* weight = conv_weight.data_ptr<T>();
  constexpr int64_t kChannelsPerTask = 256;
  const int64_t parts = (channels + kChannelsPerTask - 1) / kChannelsPerTask;
  at::parallel_for(0, batch * parts, 1, [&](int64_t first_task, int64_t last_task) {
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t s = task / parts, first = (task % parts) * kChannelsPerTask;
      conv_channels<T>(column_data + s * columns.stride(0), conv_data + slot[s] * conv_states.stride(0), weight, h,
                       first, std::min(channels, first + kChannelsPerTask), mixed.data() + s * channels);
    }
  });
  const T *a_data = a.data_ptr<T>(), *b_data = b.data_ptr<T>();
  const T *a_log = A_log.data_ptr<T>(), *bias = dt_bias.data_ptr<T>();
  float* state = recurrent.data_ptr<float>();
  float* outs = out.data_ptr<float>();
  const int64_t group = h.value_heads / h.key_heads;
  const float key_scale = 1.0f / std::sqrt(static_cast<float>(h.dk));
  at::parallel_for(0, batch * h.value_heads, 1, [&](int64_t first_task, int64_t last_task) {
    std::vector<float> q(h.dk), k(h.dk);
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t s = task / h.value_heads, head = task % h.value_heads, key_head = head / group;
      const float* row = mixed.data() + s * channels;
      l2_normalize(row + key_head * h.dk, h.dk, key_scale, q.data());
      l2_normalize(row + (h.key_heads + key_head) * h.dk, h.dk, 1.0f, k.data());
      const float* v = row + 2 * h.key_heads * h.dk + head * h.dv;
      const float decay_input = static_cast<float>(a_data[s * a.stride(0) + head]) + static_cast<float>(bias[head]);
      const float g = -std::exp(static_cast<float>(a_log[head])) * softplus(decay_input);
      const float gate = static_cast<float>(b_data[s * b.stride(0) + head]);
      const float beta = rounded<T>(1.0f / (1.0f + std::exp(-gate)));  // sigmoid in T, as b.sigmoid()
      float* matrix = state + slot[s] * recurrent.stride(0) + head * recurrent.stride(1);
      step_head(matrix, h.dk, h.dv, q.data(), k.data(), v, g, beta, outs + task * h.dv);
    }
  });
  return out;
}

at::Tensor gated_delta_decode_step(const at::Tensor& columns, const at::Tensor& a, const at::Tensor& b,
                                   at::Tensor conv_states, const at::Tensor& conv_weight, const at::Tensor& A_log,
                                   const at::Tensor& dt_bias, at::Tensor recurrent, const at::Tensor& slots,
                                   int64_t key_heads, int64_t key_dim) {
  const auto dtype = columns.scalar_type();
  for (const at::Tensor* t : {&a, &b, static_cast<const at::Tensor*>(&conv_states), &conv_weight, &A_log, &dt_bias})
    TORCH_CHECK(t->scalar_type() == dtype, "the projections, conv and decay parameters in one dtype");
  TORCH_CHECK(columns.dim() == 2 && a.dim() == 2 && b.dim() == 2, "columns [B, C], a and b [B, Hv]");
  for (const at::Tensor* t : {&columns, &a, &b}) TORCH_CHECK(t->stride(1) == 1, "rows of consecutive values");
  TORCH_CHECK(recurrent.scalar_type() == at::kFloat && recurrent.dim() == 4 && recurrent.stride(3) == 1 &&
                  recurrent.stride(2) == recurrent.size(3),
              "float32 recurrent states [slots, Hv, Dk, Dv], each head's contiguous");
  const Heads h{key_heads, recurrent.size(1), key_dim, recurrent.size(3), conv_weight.size(2)};
  TORCH_CHECK(recurrent.size(2) == key_dim && key_heads > 0 && h.value_heads % key_heads == 0, "head counts");
  TORCH_CHECK(h.dv % kLanes == 0 && h.dv <= kMaxValueDim, "value head size in whole vectors, at most 256");
  TORCH_CHECK(columns.size(1) == h.channels() && conv_weight.size(0) == h.channels() && conv_weight.size(1) == 1 &&
                  conv_weight.is_contiguous(),
              "the conv's channels: q and k of the key heads, v of the value heads");
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.size(1) == h.channels() &&
                  conv_states.size(2) == h.kernel - 1 && conv_states.stride(2) == 1 &&
                  conv_states.stride(1) == h.kernel - 1,
              "conv states [slots, C, kernel - 1], each slot's contiguous");
  TORCH_CHECK(a.size(1) == h.value_heads && b.size(1) == h.value_heads && A_log.numel() == h.value_heads &&
                  dt_bias.numel() == h.value_heads && A_log.is_contiguous() && dt_bias.is_contiguous(),
              "a, b, A_log and dt_bias: one value per value head");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == columns.size(0) &&
                  a.size(0) == columns.size(0) && b.size(0) == columns.size(0),
              "one int64 slot per sequence");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots.numel(); ++s)
    TORCH_CHECK(slot[s] >= 0 && slot[s] < recurrent.size(0) && slot[s] < conv_states.size(0),
                "a slot outside the states");
  at::Tensor out;
  with_element_type(dtype, "gated_delta_decode_step", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    out = decode_step<T>(columns, a, b, conv_states, conv_weight, A_log, dt_bias, recurrent, slots, h);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(iris_gdn, m) {
  m.def("gated_delta_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, "
        "Tensor slots) -> Tensor",
        &gated_delta_decode);
  m.def("gated_delta_decode_step(Tensor columns, Tensor a, Tensor b, Tensor(a!) conv_states, "
        "Tensor conv_weight, Tensor A_log, Tensor dt_bias, Tensor(b!) recurrent, Tensor slots, "
        "int key_heads, int key_dim) -> Tensor",
        &gated_delta_decode_step);
}
