// A bfloat16 decode step through every Qwen2 decoder layer in one call, where the module
// path crosses from Python into PyTorch about twenty times per layer (norms, projections,
// splits, rotary, the cache write, attention, residuals, the MLP's activation).
//
// Per layer, with the ops the module path calls, in its order, so the result is the same
// to the bit: h = rms_norm(x); qkv = pair_linear(h) + bias; q, k rotated (rotary);
// k, v written to the layer's cache slots; a = paged_decode_attention(q, the cache);
// x = x + o(a); h = rms_norm(x); gate, up = gate_up(h); x = x + down(silu(gate) * up).
// The kernels are called through PyTorch's dispatcher (each is its own library here);
// the cache write is a copy per token and head, as index_copy_ copies it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <optional>

namespace {

using OptionalTensor = std::optional<at::Tensor>;

constexpr int64_t kWeightsPerLayer = 10;  // see decode_layers' comment

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)> rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)>("iris_norm::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t)> linear =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t)>("iris_pairs::pair_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> rotary =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("iris_rotary::rotary");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double)>
      attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double)>("iris_attention::paged_decode_attention");
};

const Kernels& kernels() {
  static const Kernels found;  // the first call finds them: their libraries load before ours is called
  return found;
}

// rows [N, heads, dim] (each token's heads contiguous) into cache [heads, slots, dim] at `slots`.
void write_slots(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slots) {
  const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2);
  const int64_t bytes = dim * static_cast<int64_t>(rows.element_size());
  const auto* source = static_cast<const char*>(rows.data_ptr());
  auto* target = static_cast<char*>(cache.data_ptr());
  const int64_t element = rows.element_size();
  for (int64_t n = 0; n < tokens; ++n)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(target + (h * cache.stride(0) + slots[n] * cache.stride(1)) * element,
                  source + (n * rows.stride(0) + h * rows.stride(1)) * element, bytes);
}

// x [N, hidden] bfloat16, contiguous: the step's decode rows, one per sequence.
// weights: per layer, in order, input norm, qkv (packed), qkv bias, o (packed), o bias,
// post-attention norm, gate_up (packed), gate_up bias, down (packed), down bias; a bias
// may be None. shape: heads, kv_heads, head_dim, intermediate (per rank: the whole width).
// cache [layers, 2, kv_heads, slots, head_dim]; slot_mapping [N] int64, each row's new
// slot; spans and sequence_spans as paged_decode_attention takes them.
at::Tensor decode_layers(const at::Tensor& x, const c10::List<OptionalTensor>& weights, at::IntArrayRef shape,
                         double eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache,
                         const at::Tensor& slot_mapping, const at::Tensor& spans, const at::Tensor& sequence_spans,
                         double scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x [N, hidden] bfloat16");
  TORCH_CHECK(shape.size() == 4, "shape: heads, kv_heads, head_dim, intermediate");
  const int64_t heads = shape[0], kv_heads = shape[1], dim = shape[2], intermediate = shape[3];
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weights.size() % kWeightsPerLayer == 0, "ten weights per layer");
  const int64_t layers = static_cast<int64_t>(weights.size()) / kWeightsPerLayer;
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == layers && cache.size(1) == 2 && cache.size(2) == kv_heads &&
                  cache.size(4) == dim && cache.stride(4) == 1 && cache.scalar_type() == x.scalar_type(),
              "cache [layers, 2, kv_heads, slots, head_dim] in x's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "one int64 slot per row");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t n = 0; n < tokens; ++n)
    TORCH_CHECK(slots[n] >= 0 && slots[n] < cache.size(3), "a slot outside the cache");
  const Kernels& k = kernels();
  auto weight = [&](int64_t layer, int64_t index) -> OptionalTensor {
    return weights.get(layer * kWeightsPerLayer + index);
  };
  auto dense = [&](int64_t layer, int64_t index) -> at::Tensor {
    OptionalTensor value = weight(layer, index);
    TORCH_CHECK(value.has_value(), "a norm or packed weight is None");
    return *value;
  };
  const int64_t q_width = heads * dim, kv_width = kv_heads * dim;
  at::Tensor residual = x;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor normed = k.rms_norm.call(residual, dense(layer, 0), eps, false);
    const at::Tensor qkv = k.linear.call(normed, dense(layer, 1), weight(layer, 2), q_width + 2 * kv_width);
    const at::Tensor q = k.rotary.call(qkv.narrow(1, 0, q_width).view({tokens, heads, dim}), cos, sin);
    const at::Tensor key = k.rotary.call(qkv.narrow(1, q_width, kv_width).view({tokens, kv_heads, dim}), cos, sin);
    const at::Tensor value = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, kv_heads, dim});
    const at::Tensor keys = cache.select(0, layer).select(0, 0), values = cache.select(0, layer).select(0, 1);
    write_slots(key, keys, slots);
    write_slots(value, values, slots);
    const at::Tensor attended = k.attention.call(q, keys, values, spans, sequence_spans, scale);
    const at::Tensor projected = k.linear.call(attended.view({tokens, q_width}), dense(layer, 3), weight(layer, 4), hidden);
    residual = at::add(residual, projected);
    const at::Tensor mixed = k.rms_norm.call(residual, dense(layer, 5), eps, false);
    const at::Tensor gate_up = k.linear.call(mixed, dense(layer, 6), weight(layer, 7), 2 * intermediate);
    const at::Tensor activated = at::mul(at::silu(gate_up.narrow(1, 0, intermediate)),
                                         gate_up.narrow(1, intermediate, intermediate));
    residual = at::add(residual, k.linear.call(activated, dense(layer, 8), weight(layer, 9), hidden));
  }
  return residual;
}

}  // namespace

TORCH_LIBRARY(iris_decode, m) {
  m.def("decode_layers(Tensor x, Tensor?[] weights, int[] shape, float eps, Tensor cos, Tensor sin, "
        "Tensor(a!) cache, Tensor slot_mapping, Tensor spans, Tensor sequence_spans, float scale) -> Tensor",
        &decode_layers);
}
