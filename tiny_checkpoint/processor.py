"""Image-processor files of the generated checkpoints, and the transformers reference processor.

An architecture's processor is the one its row of common/architectures.py names.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import transformers
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    ProcessorMixin,
    Qwen2VLImageProcessorPil,
)

from ..common.architectures import by_model_type
from . import row_of

# The processor whose image and video processors have Qwen3-VL's settings
QWEN3_VL_PROCESSOR = "Qwen3VLProcessor"

# Qwen3-VL's published settings (16-px patches, mean and std 0.5), with the pixel bounds
# scaled down (64x64 to 1024x1024 px: 4 to 1024 tokens) so test images stay cheap.
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
    """Write preprocessor_config.json the way transformers writes it (transformers' defaults,
    which cap an image at 1003520 px; real Qwen2-VL checkpoints ship max_pixels=12845056).

    The PIL backend needs no torchvision and serialises exactly like the torchvision one, so
    a machine with torchvision loads the fast processor from the same file. The hub layout,
    not transformers 5's processor_config.json: that one nests the video processor's
    settings, which cannot be produced without torchvision, and a null entry there would
    break `AutoProcessor` on machines that have torchvision.

    `published`: Qwen3-VL's real pixel bounds rather than the tiny checkpoints' ones.
    Qwen3.5's ViT has Qwen3-VL's patch, merge and temporal sizes, and gets its settings.
    """
    settings: dict[str, object] = {}
    if row_of(arch).processor == QWEN3_VL_PROCESSOR:  # Qwen3-VL's and Qwen3.5's
        settings = dict(QWEN3_VL_IMAGE_PROCESSOR)
        if published:
            settings["size"] = QWEN3_VL_PUBLISHED_SIZE
    Qwen2VLImageProcessorPil(**settings).save_pretrained(out_dir)
    # The hub files also name the bounds `min_pixels` / `max_pixels`, which is what other
    # readers of the file take (Dynamo's frontend counts image tokens from them).
    path = Path(out_dir) / "preprocessor_config.json"
    written = json.loads(path.read_text())
    size = written["size"]
    written["min_pixels"], written["max_pixels"] = size["shortest_edge"], size["longest_edge"]
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


# Video processors' settings with the pixel bounds scaled down as the images' are: Qwen2-VL's
# bound each frame (56x56 to 224x224 px: 4 to 64 tokens per temporal patch), Qwen3-VL's the
# sampled frames together (4,096 to 131,072 px over all of them).
QWEN2_VL_VIDEO_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
QWEN3_VL_VIDEO_SIZE = {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 2 * 64}
# What Qwen3-VL's hub files ship for video (4,096 px to 24,576 tokens' worth over a video)
QWEN3_VL_PUBLISHED_VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 25165824}


def save_video_processor(out_dir: Path, arch: str = "qwen2_vl", published: bool = False) -> None:
    """Write video_preprocessor_config.json, what transformers reads a video processor from.

    Qwen3-VL's (and Qwen3.5's) is written by transformers' own `Qwen3VLVideoProcessor`,
    which needs no torchvision to be built. Qwen2-VL's class cannot be imported without
    torchvision, so its file is written here with the keys `save_pretrained` writes, at the
    class's values except two: frames are sampled (`do_sample_frames`, off in the class for
    backward compatibility) at 2 fps, as vLLM and Iris sample them, so that transformers on a
    machine with torchvision processes a video as Iris does. `published`: Qwen2-VL's hub
    files have no video processor (transformers then reads the image processor's file), and
    Qwen3-VL's ship `QWEN3_VL_PUBLISHED_VIDEO_SIZE`.
    """
    if row_of(arch).processor == QWEN3_VL_PROCESSOR:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        size = QWEN3_VL_PUBLISHED_VIDEO_SIZE if published else QWEN3_VL_VIDEO_SIZE
        Qwen3VLVideoProcessor(size=dict(size)).save_pretrained(out_dir)
        return
    if published:
        return
    settings = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_sample_frames": True,
        "fps": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "max_frames": 768,
        "max_video_tokens": 128000,
        "merge_size": 2,
        "min_frames": 4,
        "patch_size": 14,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "return_metadata": False,
        "size": dict(QWEN2_VL_VIDEO_SIZE),
        "temporal_patch_size": 2,
        "video_processor_type": "Qwen2VLVideoProcessor",
    }
    path = Path(out_dir) / "video_preprocessor_config.json"
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")


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
    """transformers' own Qwen2-VL / 2.5-VL / 3-VL processor for `model_dir`, without video:
    the reference the tokenizer worker's output is compared against.

    `AutoProcessor` cannot build it without torchvision (the video processor needs it), so
    the class is built from `AutoTokenizer` + `AutoImageProcessor` with
    `video_processor=None`, as a subclass whose type check lets exactly that be `None`.
    Everything else is transformers' unchanged code; passing `videos=` fails.
    """
    model_dir = Path(model_dir)
    model_type = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["model_type"]
    row = by_model_type(model_type)
    if row is None:
        raise ValueError(f"{model_dir}: unsupported model_type {model_type!r}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    # A class is hashable; mypy checks ProcessorMixin's instance-level __hash__ instead.
    cls = _image_only(getattr(transformers, row.processor))
    return cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )
