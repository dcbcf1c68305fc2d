"""Qwen2-VL: vision tower + Qwen2 decoder + LM head, the API the scheduler drives: it embeds
tokens, encodes the images a prefill chunk needs, splices the image embeddings into the
`<|image_pad|>` rows itself, and runs `forward` on a flat batch of tokens from several
sequences with an `AttentionContext` for the step.

Weights load by name from either layout a checkpoint may use:
- hub: `model.embed_tokens.*`, `model.layers.N.*`, `model.norm.*`, `visual.*`, `lm_head.*`
  (also what transformers 5 `save_pretrained` writes);
- transformers' in-memory `state_dict`: `model.language_model.*`, `model.visual.*`, `lm_head.*`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ..hybrid.linear_state import LinearStepContext
from .attention_api import AttentionContext
from .config import VLModelConfig
from .cpu_linear import dense_product
from .layers import PACKED_SHARDS
from .loader import Weight, load_named_weights, unpack_name
from .qwen2_lm import Qwen2Model
from .qwen3_lm import Qwen3Model
from .tensor_parallel import vocab_parallel_head
from .vision_qwen2 import Qwen2VisionTransformer

if TYPE_CHECKING:  # Qwen3.5's decoder, imported only by its model module
    from .qwen3_5_lm import Qwen3_5Model

# checkpoint prefix -> our prefix, first match wins
_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
)
# buffers some exporters save; we always recompute them
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")


class Qwen2VLForCausalLM(nn.Module):
    CPU_KERNELS: ClassVar[tuple[str, ...]] = ("bf16_linear",)  # the LM head: cpu_kernels.load_for
    vision_tower: ClassVar[type[nn.Module]] = Qwen2VisionTransformer  # built from config.vision
    language_model: ClassVar[type[Qwen2Model] | type[Qwen3Model] | type[Qwen3_5Model]] = Qwen2Model
    quantization: str | None = None  # the checkpoint's quantized format (registry.load_model)

    def __init__(self, config: VLModelConfig) -> None:
        super().__init__()
        if config.vision.out_hidden_size != config.hidden_size:
            raise ValueError(
                f"vision out_hidden_size {config.vision.out_hidden_size} != hidden_size "
                f"{config.hidden_size}"
            )
        self.config = config
        self.model = self.language_model(config)
        self.visual = self.vision_tower(config.vision)
        # tied checkpoints have no lm_head; `compute_logits` uses the embeddings instead
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else vocab_parallel_head(config.hidden_size, config.vocab_size, config.tp)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[N]` -> `[N, H]`."""
        return self.model.embed_tokens(input_ids)

    @property
    def deepstack_levels(self) -> int:
        """L: an image embedding is `[tokens, H * (1 + L)]`, main then each level."""
        return self.config.deepstack_levels

    def split_embeddings(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of `encode_images`' output, `[T, H * (1 + L)]` -> main `[T, H]` and DeepStack
        levels `[L, T, H]` (views, no copy; L may be 0)."""
        hidden = self.config.hidden_size
        levels = embeddings[:, hidden:].unflatten(-1, (self.deepstack_levels, hidden))
        return embeddings[:, :hidden], levels.transpose(0, 1)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Image embeddings `[sum_i t*h*w / merge**2, H * (1 + L)]`, images in the order given
        (L = `deepstack_levels`: 0 but for Qwen3-VL), from `pixel_values` `[sum_patches,
        C*T*P*P]` exactly as the HF image processor emits them and `grid_thw` `[num_images, 3]`."""
        expected = int(grid_thw.prod(-1).sum())
        if pixel_values.shape != (expected, self.config.vision.patch_dim):
            raise ValueError(
                f"pixel_values {tuple(pixel_values.shape)} do not match grid_thw "
                f"(expected {(expected, self.config.vision.patch_dim)})"
            )
        pixel_values = pixel_values.to(device=self.device, dtype=self.dtype)
        return self.visual(pixel_values, grid_thw)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        deepstack: torch.Tensor | None = None,
        *,
        states: LinearStepContext | None = None,
    ) -> torch.Tensor:
        """inputs_embeds `[N, H]` (flat over sequences), positions `[3, N]` int64 ->
        hidden states `[N, H]` after the final norm. `deepstack` `[L, N, H]`: only for a
        model with DeepStack levels (see `Qwen3VLForCausalLM`); `states`: only for a hybrid
        model (`config.is_hybrid`, see `Qwen3_5ForCausalLM`)."""
        if deepstack is not None:
            raise ValueError(f"{self.config.architecture} has no DeepStack levels")
        if states is not None:
            raise ValueError(f"{self.config.architecture} has no linear-attention layers")
        return self.model(inputs_embeds, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, H]` -> fp32 `[B, vocab]` (the matmul runs in the model's dtype, as in HF).
        Under tensor parallelism each rank computes its vocabulary range's logits and every
        rank gets all of them (a collective: every rank calls this)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.config.tp.all_gather_last(dense_product(hidden, weight)).float()

    def reset_buffers(self) -> None:
        """Recomputes non-persistent buffers (rotary frequencies), e.g. after `to_empty`."""
        for module in self.modules():
            reset = getattr(module, "reset_buffers", None)
            if module is not self and callable(reset):
                reset()

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        load_named_weights(self, weights, rename=self._rename, packed=PACKED_SHARDS)

    def checkpoint_target(self, name: str) -> str | None:
        """Our parameter that checkpoint tensor `name` fills (None: it is not loaded)."""
        renamed = self._rename(name)
        return None if renamed is None else unpack_name(renamed, PACKED_SHARDS)[0]

    def _rename(self, name: str) -> str | None:
        if name.endswith(_SKIPPED_SUFFIXES):
            return None
        if name.startswith("lm_head.") and self.lm_head is None:
            return None  # tied: transformers ignores a stored lm_head as well
        for old, new in _PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name
