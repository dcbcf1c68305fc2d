"""What the largest step and the largest vision-tower call take on the device, measured
once at start-up, before the KV cache is sized (vLLM's profile run;
`sizing.cuda_kv_budget`).

One prefill chunk of `max_num_batched_tokens` dummy tokens (its logits for
`max_num_seqs` rows) and one vision-tower call over the largest image the engine may
encode in one call run here, and the peak of each above what was allocated before is
read from the allocator. The two are summed: on CUDA the encoder thread runs on a stream
of its own, beside the steps. The passes run on any device; only CUDA reports a peak.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..attention import AttentionBackend, SequenceChunk, create_backend
from ..config import EngineConfig
from ..hybrid.linear_state import (
    LinearStates,
    LinearStepContext,
    SequenceStates,
)
from .kv_cache import KVCache, KVLayout

if TYPE_CHECKING:
    from ..models.qwen2_vl import Qwen2VLForCausalLM


@dataclass(frozen=True)
class ActivationProfile:
    prefill_tokens: int  # the chunk profiled
    image_tokens: int  # the vision-tower call profiled (0: not run on this rank)
    prefill_bytes: int  # peak above the baseline (0 where the device reports none)
    encoder_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.prefill_bytes + self.encoder_bytes


def profile_activations(
    model: Qwen2VLForCausalLM,
    config: EngineConfig,
    layout: KVLayout,
    device: torch.device,
    encoder: bool = True,
) -> ActivationProfile:
    """Runs the two passes (`encoder=False`: the prefill only, as on a tensor-parallel
    follower, which never runs the vision tower) and frees what they allocated."""
    prefill_tokens = config.max_num_batched_tokens
    image_tokens = largest_encoder_call(config) if encoder else 0
    # a KV cache of the chunk's own, allocated before the peak is read: only the
    # activations count
    cache = KVCache(layout, math.ceil(prefill_tokens / layout.page_size), device)
    attention = create_backend(config.attention_backend, cache, device)
    prefill = _peak(device, partial(_prefill, model, config, attention, prefill_tokens))
    del attention, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()  # so the caller's reserved bytes are its own
    vision = _peak(device, lambda: _vision(model, image_tokens, device)) if image_tokens else 0
    return ActivationProfile(prefill_tokens, image_tokens, prefill, vision)


def largest_encoder_call(config: EngineConfig) -> int:
    """Image tokens of the largest vision-tower call: the encoder budget, or one image at the
    processor's largest size when that is more (an image over the budget goes alone)."""
    return max(config.max_num_encoder_tokens, _largest_image_tokens(Path(config.model)))


def _largest_image_tokens(model_dir: Path) -> int:
    """Tokens of an image at the processor's `max_pixels` (0 when it names none)."""
    try:
        processor = json.loads((model_dir / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return 0
    max_pixels = processor.get("max_pixels") or processor.get("size", {}).get("longest_edge")
    side = processor.get("patch_size", 14) * processor.get("merge_size", 2)
    return int(max_pixels or 0) // (side * side)


def _peak(device: torch.device, run: Callable[[], object]) -> int:
    """Bytes allocated at the peak of `run` above what was allocated before it."""
    if device.type != "cuda":
        run()
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(peak, 0)


@torch.inference_mode()
def _prefill(
    model: Qwen2VLForCausalLM,
    config: EngineConfig,
    attention: AttentionBackend,
    num_tokens: int,
) -> torch.Tensor:
    """One chunk of `num_tokens` tokens from the start of `attention`'s cache, DeepStack
    levels included."""
    device = attention.device
    pages = math.ceil(num_tokens / attention.kv_cache.layout.page_size)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device).expand(3, -1)
    embeddings = model.embed_tokens(input_ids)
    levels = model.deepstack_levels
    deepstack = embeddings.new_zeros(levels, *embeddings.shape) if levels else None
    context = attention.prepare([SequenceChunk.of(list(range(pages)), 0, num_tokens)])
    if model.config.is_hybrid:  # one slot of its own (the pool is sized apart)
        states = LinearStates(model.config.linear_state_layout(model.dtype), 1, device)
        linear = LinearStepContext.of(states, [SequenceStates(0, num_tokens)])
        hidden = model(embeddings, positions, context, deepstack, states=linear)
    else:
        hidden = model(embeddings, positions, context, deepstack)
    rows = min(num_tokens, config.max_num_seqs)
    logits = model.compute_logits(hidden[-rows:])
    return logits.sort(dim=-1).values  # top-k / top-p sort the logits' rows


@torch.inference_mode()
def _vision(model: Qwen2VLForCausalLM, image_tokens: int, device: torch.device) -> torch.Tensor:
    """The vision tower over one square-ish image of `image_tokens` tokens."""
    merge = model.config.spatial_merge_size
    side = math.isqrt(image_tokens)
    height, width = side, image_tokens // side  # tokens per side; up to `image_tokens`
    grid = torch.tensor([[1, height * merge, width * merge]], device=device)
    patches = int(grid.prod())
    pixel_values = torch.zeros(patches, model.config.vision.patch_dim, device=device)
    return model.encode_images(pixel_values, grid)
