"""C++ kernels of our own for the CPU paths PyTorch has no fast kernel for, built at start-up.

Each kernel is one C++ file here registering its operators with PyTorch (`TORCH_LIBRARY`);
`load(name)` compiles it once per machine into a cache (`build.py`) and loads it, so
`torch.ops.<library>.<op>` can be called like any PyTorch operator, inside PyTorch's
thread pool. Where it cannot be built (no compiler, a CPU without AVX2, another
architecture), `load` logs one line saying why and returns False, and the caller keeps
its PyTorch path: every kernel here is a faster way to compute what a PyTorch path
already computes, and is tested against it. A module whose code calls one names it in its
class's `CPU_KERNELS`; a CPU model loads them all as it loads (`load_for`), so no request
waits for a build.

- `fp8_linear.cpp` (`torch.ops.iris_fp8.block_fp8_linear`): block-FP8 weights times a
  few rows (a decode step), reading each byte once (`models/block_fp8.py`,
  `models/fp8_experts.py`).
- `paged_attention.cpp` (`torch.ops.iris_attention.paged_decode_attention`): every decode
  of a step over its page runs in the cache, in one call (`attention/cpu_decode.py`); a
  bf16 cache on AVX512-BF16 scores keys by pair products, keys then values in two passes.
- `gated_delta.cpp` (`torch.ops.iris_gdn.gated_delta_decode`): Gated DeltaNet's decode
  step, in place on the state slots; `gated_delta_decode_step`, the same from the input
  projections on, the conv and the norms included (bf16, `models/gated_deltanet.py`).
- `rms_norm.cpp` (`torch.ops.iris_norm.rms_norm`): an RMS norm in one pass per row, in
  transformers' order of roundings (`models/layers.py`).
- `rotary.cpp` (`torch.ops.iris_rotary.rotary`): the rotary embedding of a query or key
  tensor in one pass, rounding as PyTorch's ops do (`models/layers.py`).
- `bf16_linear.cpp` (`torch.ops.iris_bf16.bf16_linear`): a bfloat16 dense weight times a
  few rows at the machine's bandwidth: the LM head in a decode step, dequantized copies
  (`models/cpu_linear.py`'s `dense_product`).
- `pair_linear.cpp` (`torch.ops.iris_pairs.pair_linear`, `pack_pairs`): a bfloat16 linear
  layer's weight packed in blocks of pairs, times any number of rows (`models/pair_linear.py`).
- `segment_attention.cpp` (`torch.ops.iris_vision.segment_attention`): the vision towers'
  attention over each image (or window) in bfloat16 pair products (`models/layers.py`'s
  `SegmentPlan`); `history_attention`, a prefill chunk's attention to its history in the
  paged cache the same way (`attention/sdpa.py`).
- `decode_layers.cpp` (`torch.ops.iris_decode.decode_layers`): a bfloat16 decode step
  through every Qwen2 decoder layer in one call, through the kernels above
  (`models/fused_decode.py`).
"""

from __future__ import annotations

import torch

from .build import disabled, load

DTYPES = (torch.float32, torch.bfloat16)  # what every kernel here computes in
# where each kernel is used: the RMS norm in bfloat16 only (in float32 its sum of squares,
# added in another order than PyTorch's, moves the fp32 parity suite's logits past its bar);
# the bf16 products (the LM head's, the towers' attention) where bf16 is computed natively
RUNS_IN: dict[str, tuple[torch.dtype, ...]] = {
    "fp8_linear": DTYPES, "paged_attention": DTYPES, "gated_delta": DTYPES,
    "rms_norm": (torch.bfloat16,), "rotary": DTYPES, "bf16_linear": (torch.bfloat16,),
    "segment_attention": (torch.bfloat16,), "pair_linear": (torch.bfloat16,),
    "decode_layers": (torch.bfloat16,),
}  # fmt: skip
VECTOR_FLOATS = 16  # a head's size must be whole vectors of the widest SIMD compiled for
MAX_HEAD_DIM = 256  # the largest head the attention and Gated DeltaNet kernels keep in registers

__all__ = ["DTYPES", "MAX_HEAD_DIM", "RUNS_IN", "VECTOR_FLOATS", "disabled", "load", "load_for"]


def load_for(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Loads, at start-up, every kernel a module of `model` may call in `dtype` (its
    class's `CPU_KERNELS`, as `RUNS_IN` allows), so that no request waits for a build
    (seconds each, once per machine); the names that loaded. A module still checks `load`
    before each call."""
    named = {name for m in model.modules() for name in getattr(m, "CPU_KERNELS", ())}
    return [name for name in sorted(named) if dtype in RUNS_IN[name] and load(name)]
