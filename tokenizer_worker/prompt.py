"""From chat messages or text plus images to a prompt descriptor (token ids + image spans).

Iris does not need transformers' `AutoProcessor` (which needs torchvision for Qwen-VL):
it takes the tokenizer and the image processor, and expands every `<|image_pad|>`
into as many ids as the image has tokens after the patch merger. An image's pixels are
uint8, converted and resized as the processor does it (`image_resize`).

`PromptBuilder.build` is the in-process path (tests, `iris generate`, benchmarks): the
descriptor is the wire `Prompt`, and the pixels travel beside it (`ipc.local.PromptInput`).
The tokenizer worker uses the same pieces (`encode`, `image_size`, `image_settings`,
`resize_image`, `expand`) with its own image fetching, cache and arena, and for videos
`video_settings` (the checkpoint's video processor, `video_rules`), `video_tokens` and
`splice`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from ..ipc.local import PromptInput
from ..ipc.messages import ImageRef, Prompt
from .images.key import image_key
from .images.resize import PIXEL_FORMAT, Grid, ImageResizer, ImageSize
from .video.rules import VideoProcessorSettings, timestamp_text

# A placeholder's replacement: its token ids, and where each of its items (an image, a
# video's temporal patch) lies in them, as (offset, length).
Replacement = tuple[list[int], list[tuple[int, int]]]


class PlaceholderMismatch(ValueError):
    """The text has another number of image placeholders than there are images."""


class PromptBuilder:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        """`chat_template`: a Jinja template replacing the checkpoint's own."""
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        # Any: the processor's class is the checkpoint's (transformers types it as its base)
        self.image_processor: Any = AutoImageProcessor.from_pretrained(
            self.model_dir, backend="pil"
        )
        self.resizer = ImageResizer(self.image_processor)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.image_token_id: int = config["image_token_id"]
        self.video_token_id: int | None = config.get("video_token_id")
        self.vision_start_token_id: int | None = config.get("vision_start_token_id")
        self.vision_end_token_id: int | None = config.get("vision_end_token_id")
        # None: the checkpoint takes no video
        self.video_settings = VideoProcessorSettings.from_checkpoint(self.model_dir)
        text = config.get("text_config", config)
        self.vocab_size: int = text.get("vocab_size", config.get("vocab_size"))
        vision = config.get("vision_config", {})
        self.merge_size: int = vision.get("spatial_merge_size", 2)
        processor = self.image_processor
        self.default_size: ImageSize = (
            processor.size["shortest_edge"],
            processor.size["longest_edge"],
        )
        # Every processor setting (whatever changes the pixels is among them), the
        # processor class, the pixels' format and the model; the size comes per request
        # (`image_settings`).
        settings = processor.to_dict()
        settings.pop("size", None)
        self._settings = (
            *((f"processor.{name}", value) for name, value in settings.items()),
            ("processor", type(processor).__name__),
            ("pixels", PIXEL_FORMAT),
            ("model", str(self.model_dir.resolve())),
        )

    # --- images ------------------------------------------------------------------

    def image_size(self, min_pixels: int | None = None, max_pixels: int | None = None) -> ImageSize:
        """The processor's size bounds with a request's overrides applied."""
        default_min, default_max = self.default_size
        size = (min_pixels or default_min, max_pixels or default_max)
        if size[0] > size[1]:
            raise ValueError(f"min_pixels {size[0]} is larger than max_pixels {size[1]}")
        return size

    def image_settings(self, size: ImageSize | None = None) -> tuple[tuple[str, Any], ...]:
        """What an image key covers besides the encoded bytes (docs/design.md, "Hash
        once, early, on the cheapest bytes")."""
        return (*self._settings, ("size", size or self.default_size))

    def pixel_bytes(self, width: int, height: int, size: ImageSize | None = None) -> int:
        """Bytes of the resized image of a `width` x `height` one, without resizing it; ValueError
        for an aspect ratio the processor refuses (over 200)."""
        resized_height, resized_width = self.resizer.target_size(
            width, height, size or self.default_size
        )
        return resized_height * resized_width * 3

    def pixel_shape(self, grid: Grid, frames: int = 1) -> tuple[int, ...]:
        """Shape of the resized uint8 image of a grid, [height, width, 3], or of a video's
        temporal patch of `frames` frames, [frames, height, width, 3]."""
        patch = self.resizer.patch_size
        shape = (grid[1] * patch, grid[2] * patch, 3)
        return shape if frames == 1 else (frames, *shape)

    def resize_image(
        self, image: Image.Image, size: ImageSize | None = None
    ) -> tuple[np.ndarray, Grid]:
        """The image converted and resized as the processor does it: uint8 [H, W, 3]."""
        return self.resizer.resize(image, size or self.default_size)

    def num_image_tokens(self, grid: Grid) -> int:
        return grid[0] * grid[1] * grid[2] // self.merge_size**2

    # --- text --------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text, generation prompt added; `tools` are OpenAI tool
        definitions, `template_kwargs` extra template variables (`chat_template_kwargs`
        of the request)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def expand(self, ids: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
        """Replace the i-th image placeholder by `lengths[i]` of them; returns the expanded ids and
        each image's offset in them."""
        images = [([self.image_token_id] * length, [(0, length)]) for length in lengths]
        token_ids, offsets = self.splice(ids, images)
        return token_ids, [spans[0][0] for spans in offsets[0]]

    def splice(
        self, ids: Sequence[int], images: Sequence[Replacement], videos: Sequence[Replacement] = ()
    ) -> tuple[list[int], tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]]]]:
        """Replace the i-th image placeholder by `images[i]` and the i-th video placeholder
        by `videos[i]`; returns the ids and, per image and per video, its items' spans
        (offset, length) in them."""
        kinds = {self.image_token_id: 0}
        if self.video_token_id is not None:
            kinds[self.video_token_id] = 1
        replacements = (list(images), list(videos))
        for kind, (name, given) in enumerate(zip(("image", "video"), replacements, strict=True)):
            token = self.image_token_id if kind == 0 else self.video_token_id
            count = sum(1 for t in ids if t == token) if token is not None else 0
            if count != len(given):
                raise PlaceholderMismatch(
                    f"the prompt has {count} {name} placeholders for {len(given)} {name}s"
                )
        spans: tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]]] = ([], [])
        token_ids: list[int] = []
        taken = [0, 0]
        for token in ids:
            kind = kinds.get(token)
            if kind is None:
                token_ids.append(token)
                continue
            replacement, items = replacements[kind][taken[kind]]
            taken[kind] += 1
            start = len(token_ids)
            spans[kind].append([(start + offset, length) for offset, length in items])
            token_ids.extend(replacement)
        return token_ids, spans

    def video_tokens(
        self, tokens_per_patch: Sequence[int], timestamps: Sequence[float] | None
    ) -> Replacement:
        """What a video placeholder becomes, given each temporal patch's token count (fewer
        than its grid's where pruned): Qwen2-VL's and Qwen2.5-VL's one run of video pads
        (the template's vision start and end around it), or Qwen3-VL's block per temporal
        patch, its timestamp before it (`Qwen3VLProcessor.replace_video_token`; the
        template's outer vision start and end stay, as transformers keeps them)."""
        video = self.video_token_id
        assert video is not None, "the checkpoint takes no video"
        token_ids: list[int] = []
        items = []
        if timestamps is None:
            for count in tokens_per_patch:
                items.append((len(token_ids), count))
                token_ids += [video] * count
            return token_ids, items
        assert self.vision_start_token_id is not None and self.vision_end_token_id is not None
        for seconds, count in zip(timestamps, tokens_per_patch, strict=True):
            # special tokens split the text before it is tokenized, so the timestamp
            # between two of them encodes as on its own
            token_ids += self.encode(timestamp_text(seconds))
            token_ids.append(self.vision_start_token_id)
            items.append((len(token_ids), count))
            token_ids += [video] * count
            token_ids.append(self.vision_end_token_id)
        return token_ids, items

    # --- in process --------------------------------------------------------------

    def build(self, text: str, images: Sequence[Image.Image] = ()) -> PromptInput:
        """Tokenizes `text` (already templated) and expands one placeholder per image."""
        ids = self.encode(text)
        count = ids.count(self.image_token_id)
        if count != len(images):
            raise PlaceholderMismatch(
                f"the prompt has {count} image placeholders for {len(images)} images"
            )
        processed = [self.resize_image(image) for image in images]
        lengths = [self.num_image_tokens(grid) for _, grid in processed]
        token_ids, offsets = self.expand(ids, lengths)
        settings = self.image_settings()
        refs = [
            ImageRef(image_key(_image_bytes(image), settings), offset, length, grid)
            for image, (_, grid), offset, length in zip(
                images, processed, offsets, lengths, strict=True
            )
        ]
        pixels = tuple(torch.tensor(pixels) for pixels, _ in processed)
        return PromptInput(Prompt(token_ids, refs), pixels)


def _image_bytes(image: Image.Image) -> bytes:
    """The bytes an in-memory image is keyed by (the server path keys the encoded file)."""
    header = f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode()
    return header + image.tobytes()


def load_image(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image
