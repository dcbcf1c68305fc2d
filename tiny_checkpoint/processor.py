"""Image-processor files of the generated checkpoints, and the transformers reference processor."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    ProcessorMixin,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)

PROCESSOR_CLASSES: dict[str, type[ProcessorMixin]] = {
    "qwen2_vl": Qwen2VLProcessor,
    "qwen2_5_vl": Qwen2_5_VLProcessor,
    "qwen3_vl": Qwen3VLProcessor,
    "qwen3_vl_moe": Qwen3VLProcessor,
}

# Qwen3-VL's published preprocessor_config.json: 16-px patches (resize factor 32), mean and
# std 0.5, 256x256 to 4096x4096 px. The tiny checkpoints keep the settings and scale the
# pixel bounds down (64x64 to 1024x1024 px: 4 to 1024 tokens) so test images stay cheap.
QWEN3_VL_IMAGE_PROCESSOR = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 64 * 64, "longest_edge": 1024 * 1024},
}


# The pixel bounds Qwen3-VL's hub files ship (256x256 to 4096x4096 px), for `--like`.
QWEN3_VL_PUBLISHED_SIZE = {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}


def save_image_processor(out_dir: Path, arch: str = "qwen2_vl", published: bool = False) -> None:
    """Write preprocessor_config.json the way transformers writes it (transformers' defaults).

    The PIL backend needs no torchvision and serialises exactly like the torchvision one
    (`image_processor_type: Qwen2VLImageProcessor`), so a machine with torchvision loads the
    fast processor from the same file. transformers' defaults cap an image at 1003520 px
    (1280 tokens); real Qwen2-VL checkpoints ship max_pixels=12845056.

    We write the hub layout (preprocessor_config.json) rather than the processor_config.json
    that transformers 5's `Qwen2VLProcessor.save_pretrained` would: that file nests the video
    processor's settings too, which cannot be produced without torchvision, and a null entry
    there would break `AutoProcessor` on machines that do have torchvision.

    `published`: Qwen3-VL's real pixel bounds rather than the tiny checkpoints' scaled-down
    ones (the Qwen2 families use transformers' defaults either way).
    """
    settings: dict[str, object] = {}
    if arch.startswith("qwen3_vl"):
        settings = dict(QWEN3_VL_IMAGE_PROCESSOR)
        if published:
            settings["size"] = QWEN3_VL_PUBLISHED_SIZE
    Qwen2VLImageProcessorPil(**settings).save_pretrained(out_dir)


@cache
def _image_only(cls: type[ProcessorMixin]) -> type[ProcessorMixin]:
    class ImageOnly(cls):  # type: ignore[valid-type, misc]
        def check_argument_for_proper_class(self, argument_name: str, argument: object) -> object:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"ImageOnly{cls.__name__}"
    return ImageOnly


def reference_processor(model_dir: str | Path) -> ProcessorMixin:
    """transformers' own Qwen2-VL / 2.5-VL / 3-VL processor for `model_dir`, without video.

    The reference that the tokenizer worker's output is compared against. `AutoProcessor`
    cannot build these processors without torchvision (the video processor requires it), so
    this builds the processor class directly from `AutoTokenizer` + `AutoImageProcessor` with
    `video_processor=None`. `ProcessorMixin.__init__` type-checks every sub-processor and
    rejects `None`; the returned object is an instance of a one-method subclass that lets
    exactly that argument be `None`. Everything else (text expansion of `<|image_pad|>`,
    pixel values, grids, chat template) is transformers' unchanged code; passing `videos=`
    fails.
    """
    model_dir = Path(model_dir)
    model_type = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["model_type"]
    if model_type not in PROCESSOR_CLASSES:
        raise ValueError(f"{model_dir}: unsupported model_type {model_type!r}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    # A class is hashable; mypy checks ProcessorMixin's instance-level __hash__ instead.
    cls = _image_only(PROCESSOR_CLASSES[model_type])  # type: ignore[arg-type]
    return cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )
