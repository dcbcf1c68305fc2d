// One decode step of Gated DeltaNet (Qwen3.5's linear attention) on a CPU, in place on the
// state slots: for each sequence b and value head h, with S the head's [Dk, Dv] float32
// state (`gated_deltanet.recurrent_delta_step` is the same arithmetic as batched products):
//
//   S ← e^g · S;  u = β (v − Sᵀk);  S ← S + k uᵀ;  out = Sᵀq
//
// in two passes over S (one read for Sᵀk, one read-modify-write that also accumulates
// Sᵀq) instead of a gather, three batched products and a scatter. Tasks of PyTorch's
// thread pool are (sequence, head) pairs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

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

}  // namespace

TORCH_LIBRARY(iris_gdn, m) {
  m.def("gated_delta_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, "
        "Tensor slots) -> Tensor",
        &gated_delta_decode);
}
