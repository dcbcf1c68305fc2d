"""Each Qwen model's rules for a video, as transformers' video processors apply them: which
frames are sampled, what size they are resized to, and what a temporal patch's M-RoPE time
and timestamp are (`/work/shared/notes/video.md` §3 has the sources).

transformers' Qwen2-VL video processor needs torchvision, which Iris does not install, so
the rules are restated here from its code (`models/qwen2_vl/video_processing_qwen2_vl.py`
`sample_frames` and `resize`); Qwen3-VL's `smart_resize` imports without torchvision and
is used as it is. Which rules a checkpoint follows is its architecture's row's `video`
(`common/architectures.py`): Qwen3.5 and Qwen3.5-MoE use Qwen3-VL's video processor
(transformers' auto mapping), Qwen2.5-VL Qwen2-VL's. tests/test_video_rules.py pins each
rule against transformers' own code where it runs, and against these sources where it
does not.

A request may override `fps` or `num_frames` (never both: transformers refuses them
together), and for Qwen2-VL and Qwen2.5-VL `min_frames`, `max_frames`, `min_pixels` and
`max_pixels`, the knobs their video processor honours per call. Qwen3-VL's processor
samples within its configured frame bounds and has no per-call pixel bounds: a request
that sets `min_frames` or `max_frames` for it is refused, and its `min_pixels` and
`max_pixels` size its images only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as smart_resize_frame,
)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as smart_resize_video,
)

from ...common.architectures import VideoRules, by_model_type

DEFAULT_FPS = 2.0  # vLLM's and Qwen3-VL's; Qwen2-VL's processor samples nothing by default
UNKNOWN_VIDEO_FPS = 24.0  # what transformers assumes of a video whose rate is unknown
BICUBIC = 3  # PIL's number, as the processors' configs store `resample`

# The class attributes of transformers' video processors that shape the frames (Qwen2-VL's
# cannot be imported without torchvision); a checkpoint's config overrides them.
_CLASS_DEFAULTS: dict[VideoRules, dict[str, Any]] = {
    "qwen2": {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_frames": 4,
        "max_frames": 768,
        "fps": None,
        "cap_pixels_per_frame": None,
        "max_video_tokens": 128000,
        "resample": BICUBIC,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OPENAI_CLIP_MEAN
        "image_std": [0.26862954, 0.26130258, 0.27577711],  # OPENAI_CLIP_STD
    },
    "qwen3": {
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_frames": 4,
        "max_frames": 768,
        "fps": 2,
        "cap_pixels_per_frame": None,
        "max_video_tokens": 768,
        "resample": BICUBIC,
        "image_mean": [0.5, 0.5, 0.5],  # IMAGENET_STANDARD_MEAN
        "image_std": [0.5, 0.5, 0.5],
    },
}
_CLASS_DEFAULTS["qwen2.5"] = _CLASS_DEFAULTS["qwen2"]
# The settings that turn a temporal patch's resized pixels into the model's input (on the
# scheduler's side): what a patch's key covers besides its pixels.
PIXEL_SETTINGS = (
    "do_convert_rgb",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
)
# Where transformers looks for a checkpoint's video processor settings, first found wins:
# a nested entry of processor_config.json, video_preprocessor_config.json, then the image
# processor's preprocessor_config.json (`BaseVideoProcessor.get_video_processor_dict`).
_NESTED_FILE, _VIDEO_FILE, _IMAGE_FILE = (
    "processor_config.json",
    "video_preprocessor_config.json",
    "preprocessor_config.json",
)


class VideoRuleError(ValueError):
    """A request's video options or a video the rules cannot take (the client's error);
    `param` names the option, or None for the video itself."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class VideoOptions:
    """A request's overrides of the video processor (`mm_processor_kwargs`); None: the
    checkpoint's."""

    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass(frozen=True)
class VideoProcessorSettings:
    """A checkpoint's video processor, as the rules below read it. `min_pixels` and
    `max_pixels` are its `size` (per frame for Qwen2-VL, over all sampled frames for
    Qwen3-VL); `tokens_per_second` is Qwen2.5-VL's vision config's (None elsewhere)."""

    family: VideoRules  # the architecture's row's `video`
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    fps: float
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int
    tokens_per_second: float | None = None
    pixel_settings: tuple[tuple[str, str], ...] = ()  # `PIXEL_SETTINGS`' values, as repr

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> VideoProcessorSettings | None:
        """The settings of the checkpoint in `model_dir`; None for a model without video."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        row = by_model_type(config.get("model_type", ""))
        if row is None or config.get("video_token_id") is None:
            return None
        family = row.video
        stored = _stored_settings(model_dir)
        settings = {**_CLASS_DEFAULTS[family], **stored}
        size = dict(settings["size"])
        # Qwen2-VL's processor takes min/max_pixels beside (over) `size`; Qwen3-VL's has none
        if family != "qwen3":
            size["shortest_edge"] = stored.get("min_pixels", size["shortest_edge"])
            size["longest_edge"] = stored.get("max_pixels", size["longest_edge"])
        if settings["resample"] != BICUBIC or not settings.get("do_resize", True):
            raise ValueError(
                f"{model_dir}: unsupported video processor settings (resample="
                f"{settings['resample']!r}, do_resize={settings.get('do_resize')!r}): Iris "
                "resizes video frames bicubically, as the Qwen processors ship"
            )
        vision = config.get("vision_config", {})
        return cls(
            family=family,
            patch_size=settings["patch_size"],
            temporal_patch_size=settings["temporal_patch_size"],
            merge_size=settings["merge_size"],
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
            fps=float(settings["fps"] or DEFAULT_FPS),
            min_frames=settings["min_frames"],
            max_frames=settings["max_frames"],
            cap_pixels_per_frame=bool(settings["cap_pixels_per_frame"]),
            max_video_tokens=settings["max_video_tokens"],
            tokens_per_second=vision.get("tokens_per_second") if family == "qwen2.5" else None,
            pixel_settings=tuple((name, repr(settings.get(name))) for name in PIXEL_SETTINGS),
        )

    @property
    def one_block(self) -> bool:
        """Whether a video is one M-RoPE block (Qwen2-VL, Qwen2.5-VL) rather than a block
        per temporal patch (Qwen3-VL)."""
        return self.family != "qwen3"

    def key_settings(self) -> tuple[tuple[str, Any], ...]:
        """Every field, for the keys of what these settings produce."""
        return tuple(sorted(asdict(self).items()))

    def with_options(self, options: VideoOptions) -> VideoProcessorSettings:
        """These settings under a request's overrides; `VideoRuleError` for one this
        model's processor does not take, or a value it refuses."""
        if options.fps is not None and options.num_frames is not None:
            raise VideoRuleError(
                "fps and num_frames are mutually exclusive: give one of them", "num_frames"
            )
        changes: dict[str, Any] = {} if options.fps is None else {"fps": float(options.fps)}
        frame_bounds = {"min_frames": options.min_frames, "max_frames": options.max_frames}
        if self.family == "qwen3":
            given = next((name for name, value in frame_bounds.items() if value is not None), None)
            if given is not None:
                raise VideoRuleError(
                    f"{given} is not a per-request setting of Qwen3-VL's video processor, "
                    "which samples within its configured bounds: use fps or num_frames",
                    given,
                )
            return replace(self, **changes)
        pixel_bounds = {"min_pixels": options.min_pixels, "max_pixels": options.max_pixels}
        for name, value in (*frame_bounds.items(), *pixel_bounds.items()):
            if value is not None:
                changes[name] = value
        merged = replace(self, **changes)
        if merged.min_pixels > merged.max_pixels:
            raise VideoRuleError(
                f"min_pixels {merged.min_pixels} is larger than max_pixels {merged.max_pixels}",
                "min_pixels",
            )
        return merged


def _stored_settings(model_dir: Path) -> dict[str, Any]:
    nested = model_dir / _NESTED_FILE
    if nested.is_file():
        video = json.loads(nested.read_text(encoding="utf-8")).get("video_processor")
        if video is not None:
            return dict(video)
    for name in (_VIDEO_FILE, _IMAGE_FILE):
        path = model_dir / name
        if path.is_file():
            return dict(json.loads(path.read_text(encoding="utf-8")))
    return {}


@dataclass(frozen=True)
class VideoPlan:
    """What a video becomes under the rules: the sampled frame `indices` (into the decoded
    video, non-decreasing, repeats allowed), the size each frame is resized to, and per
    temporal patch its M-RoPE time and (Qwen3-VL) its timestamp in seconds."""

    indices: tuple[int, ...]
    height: int  # resized, pixels
    width: int
    grid: tuple[int, int, int]  # one temporal patch's (1, h, w), in patches before merging
    num_tokens: int  # one temporal patch's placeholder tokens
    rope_times: tuple[int, ...]
    timestamps: tuple[float, ...] | None  # Qwen3-VL's; None where the prompt has none

    @property
    def num_patches(self) -> int:
        return len(self.rope_times)


def plan_video(
    settings: VideoProcessorSettings,
    num_frames: int,
    video_fps: float | None,
    height: int,
    width: int,
    num_frames_wanted: int | None = None,
) -> VideoPlan:
    """The plan of a video of `num_frames` frames of `width` x `height` at `video_fps`
    (None: unknown) under `settings` (a request's options applied); `num_frames_wanted`
    is the request's `num_frames`. `VideoRuleError` for a video the processor refuses."""
    tps = settings.temporal_patch_size
    if num_frames < tps:
        raise VideoRuleError(
            f"the video has {num_frames} frame(s); the model needs at least {tps}", None
        )
    fps = video_fps if video_fps else UNKNOWN_VIDEO_FPS
    if num_frames_wanted is not None and not tps <= num_frames_wanted <= settings.max_frames:
        raise VideoRuleError(
            f"num_frames must be between {tps} and {settings.max_frames}, got {num_frames_wanted}",
            "num_frames",
        )
    if settings.family == "qwen3":
        indices = _qwen3_indices(settings, num_frames, fps, num_frames_wanted)
    else:
        indices = _qwen2_indices(settings, num_frames, fps, num_frames_wanted)
    resized_height, resized_width = resized_frame_size(settings, len(indices), height, width)
    patch = settings.patch_size
    grid = (1, resized_height // patch, resized_width // patch)
    num_patches = -(-len(indices) // tps)
    timestamps = None
    if settings.family == "qwen3":
        timestamps = tuple(patch_timestamps(indices, fps, tps))
    return VideoPlan(
        indices=tuple(indices),
        height=resized_height,
        width=resized_width,
        grid=grid,
        num_tokens=grid[1] * grid[2] // settings.merge_size**2,
        rope_times=tuple(rope_times(settings, num_patches, len(indices), num_frames, fps)),
        timestamps=timestamps,
    )


def _qwen2_indices(
    settings: VideoProcessorSettings, total: int, fps: float, wanted: int | None
) -> list[int]:
    """`Qwen2VLVideoProcessor.sample_frames`: an even count, from `wanted` or from the
    target fps within [min_frames, max_frames], then `arange(0, total, total / n).int()`."""
    tps = settings.temporal_patch_size
    if wanted is not None:
        count = round(wanted / tps) * tps
    else:
        max_frames = math.floor(min(settings.max_frames, total) / tps) * tps
        count = total / fps * settings.fps
        count = min(max(count, settings.min_frames), max_frames, total)
        count = math.floor(count / tps) * tps
    if count > total:
        raise VideoRuleError(f"cannot sample {count} frames from a video of {total}", "num_frames")
    if count < tps:
        raise VideoRuleError(f"the settings sample {count} frames; at least {tps} are needed")
    return torch.arange(0, total, total / count).int().tolist()


def _qwen3_indices(
    settings: VideoProcessorSettings, total: int, fps: float, wanted: int | None
) -> list[int]:
    """`Qwen3VLVideoProcessor.sample_frames`: `wanted`, or the target fps's count within
    [min_frames, min(max_frames, total)]; `linspace(0, total - 1, n).round()`."""
    count = wanted
    if count is None:
        count = int(total / fps * settings.fps)
        count = min(max(count, settings.min_frames), settings.max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def resized_frame_size(
    settings: VideoProcessorSettings, num_sampled: int, height: int, width: int
) -> tuple[int, int]:
    """(height, width) of every resized frame (the processors' `resize`): Qwen2-VL bounds
    each frame, Qwen3-VL the sampled frames together; `cap_pixels_per_frame` as theirs."""
    factor = settings.patch_size * settings.merge_size
    min_pixels, max_pixels = settings.min_pixels, settings.max_pixels
    try:
        if settings.family == "qwen3":
            if settings.cap_pixels_per_frame:
                frame_cap = settings.max_video_tokens * factor * factor
                per_frame = max(min(frame_cap, max_pixels // num_sampled), int(min_pixels * 1.05))
                max_pixels = per_frame * num_sampled
            return smart_resize_video(
                num_frames=num_sampled,
                height=height,
                width=width,
                temporal_factor=settings.temporal_patch_size,
                factor=factor,
                min_pixels=min_pixels,
                max_pixels=max_pixels,
            )
        if settings.cap_pixels_per_frame:
            total_pixels = int(settings.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total_pixels * settings.temporal_patch_size // num_sampled),
                int(min_pixels * 1.05),
            )
        return smart_resize_frame(
            height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels
        )
    except ValueError as e:  # an aspect ratio over 200
        raise VideoRuleError(f"the video cannot be resized: {e}") from None


def rope_times(
    settings: VideoProcessorSettings,
    num_patches: int,
    num_sampled: int,
    total: int,
    video_fps: float,
) -> list[int]:
    """Each temporal patch's M-RoPE time. Qwen2-VL: its index. Qwen2.5-VL: as
    `get_rope_index` computes it from the processor's `second_per_grid_ts` (temporal
    patch size over the sampled fps, `VideoMetadata.sampled_fps`), which reaches the model
    as a float32 tensor: the product is float32, truncated. Qwen3-VL: 0 (its timestamps
    carry the time; each patch is a block of its own)."""
    if settings.family == "qwen3":
        return [0] * num_patches
    if settings.family == "qwen2":
        return list(range(num_patches))
    sampled_fps = num_sampled / total * video_fps
    second_per_grid = torch.tensor(settings.temporal_patch_size / sampled_fps)
    interval = settings.tokens_per_second * second_per_grid  # pyright: ignore[reportOptionalOperand]: set for qwen2_5_vl
    return (torch.arange(num_patches) * interval).long().tolist()


def patch_timestamps(indices: list[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's `_calculate_timestamps`: the indices padded with the last one to whole
    patches, in seconds; each patch's is the mean of its first and last frame's."""
    padded = list(indices)
    padded += [padded[-1]] * (-len(padded) % temporal_patch_size)
    seconds = [index / video_fps for index in padded]
    step = temporal_patch_size
    return [(seconds[i] + seconds[i + step - 1]) / 2 for i in range(0, len(seconds), step)]


def timestamp_text(seconds: float) -> str:
    """The text before a Qwen3-VL patch's block (`Qwen3VLProcessor.replace_video_token`)."""
    return f"<{seconds:.1f} seconds>"


def resize_frame(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """One RGB frame (uint8 [H, W, 3]) resized as the video processors resize it, uint8
    [height, width, 3]. They resize with torchvision (`tvF.resize`, bicubic, antialiased),
    which on the CPU hands a uint8 [N, C, H, W] tensor straight to torch's `interpolate`
    (its native uint8 kernel) and keeps a frame of the target size as it is; this makes
    the same call on one frame (frames are resized independently)."""
    if rgb.shape[:2] == (height, width):
        return np.ascontiguousarray(rgb)
    frame = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).contiguous()
    resized = torch.nn.functional.interpolate(
        frame.unsqueeze(0),
        size=[height, width],
        mode="bicubic",
        align_corners=False,
        antialias=True,
    )
    return np.ascontiguousarray(resized[0].permute(1, 2, 0).numpy())
