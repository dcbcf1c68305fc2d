"""From chat messages or text plus images to an engine prompt (token ids + image spans).

Iris does not need transformers' `AutoProcessor` (which needs torchvision for Qwen-VL):
it takes the tokenizer and the image processor, and expands every `<|image_pad|>`
into as many ids as the image has tokens after the patch merger.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from scheduler.request import EnginePrompt, ImageInput
from tokenizer_worker.image_key import image_key

# Image-processor attributes that change the pixels an image becomes (invariant 2).
_PIXEL_SETTINGS = (
    "min_pixels",
    "max_pixels",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "size",
)


class PromptBuilder:
    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.image_processor = AutoImageProcessor.from_pretrained(self.model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.image_token_id: int = config["image_token_id"]
        vision = config.get("vision_config", {})
        self.merge_size: int = vision.get("spatial_merge_size", 2)
        settings = [(name, getattr(self.image_processor, name, None)) for name in _PIXEL_SETTINGS]
        self._settings = (*settings, ("model", str(self.model_dir.resolve())))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def build(self, text: str, images: Sequence[Image.Image] = ()) -> EnginePrompt:
        """Tokenizes `text` (already templated) and expands one placeholder per image."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        placeholders = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(placeholders) != len(images):
            raise ValueError(
                f"the prompt has {len(placeholders)} image placeholders for {len(images)} images"
            )
        token_ids: list[int] = []
        inputs: list[ImageInput] = []
        previous = 0
        for position, image in zip(placeholders, images, strict=True):
            token_ids.extend(ids[previous:position])
            processed = self.image_processor(images=[image], return_tensors="pt")
            grid = tuple(int(x) for x in processed["image_grid_thw"][0])
            length = grid[0] * grid[1] * grid[2] // self.merge_size**2
            inputs.append(
                ImageInput(
                    key=image_key(_image_bytes(image), self._settings),
                    offset=len(token_ids),
                    length=length,
                    grid_thw=grid,  # type: ignore[arg-type]
                    pixel_values=processed["pixel_values"],
                )
            )
            token_ids.extend([self.image_token_id] * length)
            previous = position + 1
        token_ids.extend(ids[previous:])
        return EnginePrompt(token_ids=token_ids, images=inputs)


def _image_bytes(image: Image.Image) -> bytes:
    """The bytes an in-memory image is keyed by (the server path keys the encoded file)."""
    header = f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode()
    return header + image.tobytes()


def load_image(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image
