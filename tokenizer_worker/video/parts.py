"""A request's video parts: their options, their uuids, and each one's temporal patches
pinned in the arena (`video_loader`), with every client error named after its part.

A video part with data and a `uuid` binds the uuid to what the video became (its
patches' keys, `video_loader.VideoLayout`) under the request's video settings; a later
part with the uuid alone is served from the processor cache, and a patch evicted since
goes to the scheduler without pixels (its embedding cache must hold it, or it refuses
the request), as an image named by its uuid does (`image_uuids`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from ...ipc.messages import ImageRef, TokenizeRequest
from ...ipc.shm_arena import ArenaFull, ShmArena
from ..chat import VideoPart
from ..config import WorkerConfig
from ..images.processor_cache import ProcessorCache
from ..images.uuids import ImageUuids
from ..media.fetch import MediaError
from ..prompt import PromptBuilder
from .loader import LoadedVideo, VideoLayout, VideoLimits, VideoLoader
from .rules import VideoOptions, VideoRuleError

T = TypeVar("T")


class VideoParts:
    """The videos of the requests one worker handles, under one loader."""

    def __init__(self, loader: VideoLoader, arena: ShmArena, max_uuids: int) -> None:
        self.loader = loader
        self.arena = arena
        self.uuids: ImageUuids[VideoLayout] = ImageUuids(max_uuids)

    def check_uuids(self, parts: Sequence[VideoPart], options: VideoOptions) -> None:
        """Refuses, before any work, a part named by a uuid this worker does not know under
        these settings (one bound earlier in the same request counts as known)."""
        bound = {part.uuid for part in parts if part.has_data}
        for part in parts:
            if not part.has_data and part.uuid not in bound:
                size = _named(part, self.loader.binding_size, options)
                if self.uuids.recall(part.uuid or "", size) is None:
                    raise MediaError(
                        f"{part.where}: no video with uuid {part.uuid!r} is known (never sent, "
                        "forgotten, or sent with other video settings): send it again with "
                        "its data and the same uuid",
                        part.where,
                    )

    def load(
        self, parts: Sequence[VideoPart], encoded: Sequence[bytes], options: VideoOptions
    ) -> list[LoadedVideo]:
        """Every part's video, its patches pinned, in order; the parts with data first, so
        that a uuid bound anywhere in the request names its video everywhere in it. Raises
        holding nothing: `ArenaFull` with `nbytes` all these videos need."""
        if not parts:
            return []
        loader = self.loader
        data = iter(encoded)
        videos: list[LoadedVideo | None] = [None] * len(parts)
        try:
            for index, part in enumerate(parts):
                if part.url is not None:
                    video = _named(part, loader.load, next(data), options)
                    videos[index] = video
                    if part.uuid is not None:
                        self.uuids.bind(part.uuid, loader.binding_size(options), video.layout)
            for index, part in enumerate(parts):
                if part.url is None:
                    assert part.uuid is not None  # `parse_messages` gives it a URL or a uuid
                    layout = self.uuids.peek(part.uuid, loader.binding_size(options))
                    assert layout is not None, "checked by check_uuids"
                    videos[index] = LoadedVideo(layout, loader.pin_cached(layout), cached=True)
        except ArenaFull as e:
            held = [p.nbytes for v in videos if v is not None for p in v.pointers if p]
            self.release(v for v in videos if v is not None)
            needed = sum(map(self.arena.block_bytes, held)) + e.nbytes
            raise ArenaFull(str(e), needed) from e
        except BaseException:
            self.release(v for v in videos if v is not None)
            raise
        return [video for video in videos if video is not None]

    def refs(self, video: LoadedVideo, spans: Sequence[tuple[int, int]]) -> list[ImageRef]:
        """An `ImageRef` per temporal patch, at its span (offset, length) in the prompt:
        Qwen2-VL's and Qwen2.5-VL's patches after the first continue their video's M-RoPE
        block, Qwen3-VL's are blocks of their own; a pruned patch carries its kept token
        indices and goes by its pruned key (`video_pruning`)."""
        layout = video.layout
        one_block = self.loader.settings.one_block
        return [
            ImageRef(
                layout.patch_ref_key(j),
                offset,
                length,
                layout.grid,
                video.pointers[j],
                frames=layout.frames,
                rope_time=layout.rope_times[j],
                continue_block=one_block and j > 0,
                kept=layout.patch_kept(j),
            )
            for j, (offset, length) in enumerate(spans)
        ]

    def release(self, videos: Iterable[LoadedVideo]) -> None:
        """Drop the pins of `videos`."""
        for video in videos:
            for pointer in video.pointers:
                if pointer is not None:
                    self.arena.release(pointer)


def open_video_parts(
    config: WorkerConfig, builder: PromptBuilder, cache: ProcessorCache, arena: ShmArena
) -> VideoParts | None:
    """The video parts of a worker whose model takes video, under its settings; None for a
    model that takes none."""
    if builder.video_settings is None:
        return None
    limits = VideoLimits(
        config.max_video_frames, config.max_image_pixels, config.video_decode_threads
    )
    model = str(builder.model_dir.resolve())
    loader = VideoLoader(
        builder.video_settings,
        cache,
        arena,
        limits,
        model,
        pruning_rate=config.video_pruning_rate,
    )
    return VideoParts(loader, arena, config.max_image_uuids)


def video_options(request: TokenizeRequest) -> VideoOptions:
    """The request's overrides of the video processor."""
    return VideoOptions(
        fps=request.fps,
        num_frames=request.num_frames,
        min_frames=request.min_frames,
        max_frames=request.max_frames,
        min_pixels=request.min_pixels,
        max_pixels=request.max_pixels,
    )


def _named(part: VideoPart, call: Callable[..., T], *args: object) -> T:
    """`call(*args)`, its client errors named after `part` (or the option at fault)."""
    try:
        return call(*args)
    except MediaError as e:
        raise MediaError(f"{part.where}: {e.message}", part.where) from None
    except VideoRuleError as e:
        param = part.where if e.param is None else f"mm_processor_kwargs.{e.param}"
        raise MediaError(f"{part.where}: {e.message}", param) from None
