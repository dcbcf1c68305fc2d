"""A prompt handed from the tokenizer side to the engine inside one process (`iris
generate`, the tests, the benchmarks' compute bound): the same `Prompt` a served request
carries, with the pixels beside it. Never sent, so a plain dataclass, not a wire struct.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .messages import ImageRef, Prompt


@dataclass(frozen=True)
class PromptInput:
    """A prompt descriptor and each image's resized uint8 pixels `[H, W, 3]`, in order.

    The scheduler process builds one too, from an `EngineRequest` and views of the
    worker's arena; the engine takes nothing else. An image's pixels are None when it
    came without them: the engine serves it from its embedding cache, or refuses it."""

    prompt: Prompt
    pixels: tuple[torch.Tensor | None, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pixels", tuple(self.pixels))
        if len(self.pixels) != len(self.prompt.images):
            raise ValueError(
                f"{len(self.pixels)} pixel tensors for {len(self.prompt.images)} images"
            )

    @classmethod
    def text(cls, token_ids: Sequence[int]) -> PromptInput:
        """A prompt without images."""
        return cls(Prompt(list(token_ids)))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt.token_ids

    @property
    def images(self) -> list[ImageRef]:
        return self.prompt.images
