"""The tokenizer worker role: from a request's content to token ids and pixels in its
shared-memory arena.

Its public surface (`docs/design.md`, "Packages and seams"), resolved on first use:

- `WorkerConfig`: one worker's settings; `iris serve` derives its flags from the fields;
- `run_worker`: the worker process, started by the launcher;
- `PromptBuilder`: the in-process prompt path (chat template, image processor, image
  placeholders expanded), which `iris generate` composes with the scheduler's engine;
- `load_image`: image bytes to the RGB picture the prompt path takes, as the worker
  decodes them (`bench.compute_bound` times it);
- `open_video`, `plan_video`, `resize_frame`, `VideoProcessorSettings`: a video's decoder,
  the model's frame sampling and sizing, and one frame's resize, as the worker runs them
  (`bench.video_decoding` times them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .config import WorkerConfig
    from .entry import run_worker
    from .prompt import PromptBuilder, load_image
    from .video.decode import open_video
    from .video.rules import (
        VideoProcessorSettings,
        plan_video,
        resize_frame,
    )

__all__ = [
    "PromptBuilder",
    "VideoProcessorSettings",
    "WorkerConfig",
    "load_image",
    "open_video",
    "plan_video",
    "resize_frame",
    "run_worker",
]
_HOMES = {
    "PromptBuilder": "prompt",
    "VideoProcessorSettings": "video.rules",
    "WorkerConfig": "config",
    "load_image": "prompt",
    "open_video": "video.decode",
    "plan_video": "video.rules",
    "resize_frame": "video.rules",
    "run_worker": "entry",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
