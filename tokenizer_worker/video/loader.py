"""A video part's temporal patches in the worker's arena, each pinned once for the request.

A video becomes a run of temporal patches (`ipc.messages.ImageRef`): `temporal_patch_size`
consecutive sampled frames, resized as the model's video processor does (`video_rules`),
an odd last frame padded with a copy of itself, stored as uint8 `[frames, H, W, 3]` in the
processor cache under the patch's own key.

**Keys.** A patch's key is xxh3_128 over its resized pixels and what makes them the
model's input (`patch_key`): the settings that normalise and patchify them, its M-RoPE
time and its frame count. It is a content key, so the embedding and prefix caches reuse a
patch wherever it recurs: in a second question about the same video, and in another clip
of the same recording where the same frames are sampled and resized to the same size.
That holds exactly for Qwen2-VL and Qwen2.5-VL clips that start at the same frame and are
sampled at the same rate (their frames are every `video_fps / fps`-th, resized one by
one; the M-RoPE time counts patches from the clip's start, and for Qwen2.5-VL scales
with the rate actually sampled). It rarely holds across Qwen3-VL clips of different
lengths: they sample `linspace(0, total - 1, n)`, so the frames picked move with the
clip's length, and their pixel budget spans all sampled frames, so the size moves too.
Nothing is shared between a Qwen3-VL patch and one of another video unless pixels,
size and settings all agree, which the key checks by construction.

**Pruning** (`--video-pruning-rate`, off by default; `video_pruning`): each patch after
the first keeps only its tokens that changed most since the patch before it, chosen on
these pixels as they are stored. The pixels and their key stay those of the whole patch
(the vision tower encodes it whole), the `ImageRef` carries the kept indices and goes by
a key of its own that covers them (`VideoLayout.ref_keys`).

**Decoding once.** The patch keys are known only after decoding, so the worker also
remembers, per video (xxh3_128 of its encoded bytes and every video setting, the way an
image is keyed), what it became (`VideoLayout`). A video sent again is served from the
processor cache without decoding while all its patches are still there; otherwise it is
decoded again. A `uuid` sent with a video is bound to its layout (`image_uuids`).

Whatever fails, the pins a load took are dropped before the error leaves it, so an error
leaks no arena byte (stored entries stay cached, unpinned).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from ...ipc.messages import ShmPointer
from ...ipc.shm_arena import ArenaFull, ShmArena
from ..images.key import image_key
from ..images.processor_cache import ProcessorCache
from ..images.resize import PIXEL_FORMAT, Grid
from ..media.fetch import MediaError
from .decode import VideoHeader, open_video
from .pruning import PRUNING_FORMAT, Kept, VideoPruner
from .rules import (
    VideoOptions,
    VideoPlan,
    VideoProcessorSettings,
    plan_video,
    resize_frame,
)

PATCH_FORMAT = f"video patch, {PIXEL_FORMAT}"  # part of every patch key: a change re-keys them
DEFAULT_MEMO_CAPACITY = 4096  # videos remembered (tens of bytes per temporal patch)


@dataclass(frozen=True)
class VideoLayout:
    """What a video became: its temporal patches' keys (of their pixels) and M-RoPE times,
    their shared grid `(1, h, w)`, token count and frame count, and (Qwen3-VL) their
    timestamps. Pruned, each patch's kept token indices (None: all) and the key its
    `ImageRef` goes by (`video_pruning`); unpruned, `kept` and `ref_keys` are empty."""

    keys: tuple[bytes, ...]
    rope_times: tuple[int, ...]
    grid: Grid
    num_tokens: int  # per patch, before pruning
    frames: int  # per patch
    timestamps: tuple[float, ...] | None
    kept: tuple[Kept, ...] = ()
    ref_keys: tuple[bytes, ...] = ()

    @property
    def num_patches(self) -> int:
        return len(self.keys)

    def patch_kept(self, index: int) -> Kept:
        """Patch `index`'s kept token indices (None: all)."""
        return self.kept[index] if self.kept else None

    def patch_ref_key(self, index: int) -> bytes:
        """The key patch `index`'s `ImageRef` goes by in the scheduler's caches."""
        return self.ref_keys[index] if self.ref_keys else self.keys[index]

    @property
    def token_counts(self) -> tuple[int, ...]:
        """Each patch's placeholder tokens, after pruning."""
        kept = (self.patch_kept(j) for j in range(self.num_patches))
        return tuple(self.num_tokens if k is None else len(k) for k in kept)


@dataclass(frozen=True)
class LoadedVideo:
    """A video's layout and a pointer per patch, each pinned once for the caller (None: a
    patch evicted since a uuid named it; the scheduler's embedding cache must hold it)."""

    layout: VideoLayout
    pointers: tuple[ShmPointer | None, ...]
    cached: bool  # no decoding: every patch came from the processor cache


@dataclass(frozen=True)
class VideoLimits:
    """What a video may cost before any frame is decoded: frames in the file (each up to
    the last sampled one is decoded), pixels per frame, FFmpeg's decoding threads."""

    max_frames: int
    max_frame_pixels: int
    decode_threads: int = 1


class VideoLoader:
    """Decodes, samples, resizes and stores videos under one checkpoint's video settings."""

    def __init__(
        self,
        settings: VideoProcessorSettings,
        cache: ProcessorCache,
        arena: ShmArena,
        limits: VideoLimits,
        model: str,
        memo_capacity: int = DEFAULT_MEMO_CAPACITY,
        pruning_rate: float = 0.0,
    ) -> None:
        """`pruning_rate`: `--video-pruning-rate` (0: off; ValueError outside [0, 1))."""
        self.pruner = VideoPruner(settings, pruning_rate)
        self.settings = settings
        self.cache = cache
        self.arena = arena
        self.limits = limits
        self.model = model
        self.memo_capacity = memo_capacity
        self.videos_decoded = 0
        self._memo: OrderedDict[bytes, VideoLayout] = OrderedDict()

    def settings_for(self, options: VideoOptions) -> VideoProcessorSettings:
        """The settings a request's options make (`VideoRuleError` for a refused option)."""
        return self.settings.with_options(options)

    def binding_size(self, options: VideoOptions) -> Hashable:
        """What a video uuid's binding depends on besides the uuid (`image_uuids`)."""
        return (self.settings_for(options), options.num_frames)

    def load(self, data: bytes, options: VideoOptions) -> LoadedVideo:
        """The video in `data`, its patches pinned: from the processor cache when this video
        was seen under these settings and all its patches are still there, else decoded.
        Raises `MediaError` or `video_rules.VideoRuleError` for a video the client must fix,
        and `ArenaFull` (its `nbytes`: all that this video needs) when pinned entries leave
        no room; either way holding nothing."""
        settings = self.settings_for(options)
        video_key = image_key(data, self._video_settings(settings, options))
        layout = self._memo.get(video_key)
        if layout is not None:
            self._memo.move_to_end(video_key)
            pointers = self.pin_cached(layout)
            if all(pointer is not None for pointer in pointers):
                return LoadedVideo(layout, pointers, cached=True)
            self._release(pointers)
        loaded = self._decode(data, settings, options.num_frames)
        self._memo[video_key] = loaded.layout
        while len(self._memo) > self.memo_capacity:
            self._memo.popitem(last=False)
        return loaded

    def pin_cached(self, layout: VideoLayout) -> tuple[ShmPointer | None, ...]:
        """A pointer per patch that the processor cache still holds, pinned once; None for
        each evicted one."""
        pointers = []
        try:
            for key in layout.keys:
                hit = self.cache.lookup(key, layout.frames)
                pointers.append(None if hit is None else hit.pointer)
        except BaseException:
            self._release(pointers)
            raise
        return tuple(pointers)

    # --- decoding ----------------------------------------------------------------

    def _decode(
        self, data: bytes, settings: VideoProcessorSettings, num_frames: int | None
    ) -> LoadedVideo:
        with open_video(data, self.limits.decode_threads) as video:
            self._check_header(video.header)
            header = video.header
            plan = plan_video(
                settings, header.num_frames, header.fps, header.height, header.width, num_frames
            )
            self._check_room(plan, settings.temporal_patch_size)
            pointers: list[ShmPointer | None] = []
            keys: list[bytes] = []
            kept: list[Kept] = []
            ref_keys: list[bytes] = []
            previous: np.ndarray | None = None
            try:
                patches = _patches(
                    (
                        resize_frame(frame, plan.height, plan.width)
                        for frame in video.frames(plan.indices)
                    ),
                    settings.temporal_patch_size,
                )
                for rope_time, pixels in zip(plan.rope_times, patches, strict=True):
                    key = patch_key(pixels, settings, rope_time, self.model)
                    pointers.append(self._store(key, pixels, plan.grid))
                    kept.append(self.pruner.kept(previous, pixels))
                    ref_keys.append(self.pruner.key(key, keys[-1] if keys else None, kept[-1]))
                    keys.append(key)
                    previous = pixels
            except ArenaFull as e:
                needed = sum(self.arena.block_bytes(p.nbytes) for p in pointers if p is not None)
                self._release(pointers)
                raise ArenaFull(str(e), needed + self.arena.block_bytes(e.nbytes)) from e
            except BaseException:
                self._release(pointers)
                raise
        self.videos_decoded += 1
        layout = VideoLayout(
            keys=tuple(keys),
            rope_times=plan.rope_times,
            grid=plan.grid,
            num_tokens=plan.num_tokens,
            frames=settings.temporal_patch_size,
            timestamps=plan.timestamps,
            kept=tuple(kept) if self.pruner.enabled else (),
            ref_keys=tuple(ref_keys) if self.pruner.enabled else (),
        )
        return LoadedVideo(layout, tuple(pointers), cached=False)

    def _check_header(self, header: VideoHeader) -> None:
        if header.num_frames < 1:
            raise MediaError("the video has no frames")
        if header.num_frames > self.limits.max_frames:
            raise MediaError(
                f"the video has {header.num_frames} frames, more than the limit of "
                f"{self.limits.max_frames}"
            )
        pixels = header.width * header.height
        if pixels > self.limits.max_frame_pixels:
            raise MediaError(
                f"the video is {header.width}x{header.height} = {pixels} pixels a frame, "
                f"more than the limit of {self.limits.max_frame_pixels}"
            )

    def _check_room(self, plan: VideoPlan, frames: int) -> None:
        """Refuses a video whose resized patches could never fit in the arena, before
        decoding it."""
        patch_bytes = frames * plan.height * plan.width * 3
        needed = plan.num_patches * self.arena.block_bytes(patch_bytes)
        if needed > self.arena.capacity_bytes:
            raise MediaError(
                f"its {plan.num_patches} temporal patches of {plan.width}x{plan.height} need "
                f"{needed} bytes, more than the {self.arena.capacity_bytes}-byte image arena: "
                "sample fewer frames (fps, num_frames) or lower max_pixels"
            )

    def _store(self, key: bytes, pixels: np.ndarray, grid: Grid) -> ShmPointer:
        """The patch's entry, pinned once: the cached one for its key (another clip or
        request made the same patch), else a new one."""
        hit = self.cache.lookup(key, pixels.shape[0])
        if hit is not None:
            return hit.pointer
        return self.cache.store(key, pixels, grid).pointer

    def _release(self, pointers: Iterable[ShmPointer | None]) -> None:
        for pointer in pointers:
            if pointer is not None:
                self.arena.release(pointer)

    def _video_settings(
        self, settings: VideoProcessorSettings, options: VideoOptions
    ) -> tuple[tuple[str, object], ...]:
        return (
            ("video", settings.key_settings()),
            ("num_frames", options.num_frames),
            ("pixels", PATCH_FORMAT),
            ("model", self.model),
            ("pruning", (self.pruner.rate, PRUNING_FORMAT) if self.pruner.enabled else None),
        )


def patch_key(
    pixels: np.ndarray, settings: VideoProcessorSettings, rope_time: int, model: str
) -> bytes:
    """The content key of a temporal patch's resized uint8 pixels `[frames, H, W, 3]`."""
    return image_key(
        pixels.tobytes(),
        (
            *settings.pixel_settings,
            ("shape", tuple(pixels.shape)),
            ("frames", pixels.shape[0]),
            ("rope_time", rope_time),
            ("pixels", PATCH_FORMAT),
            ("model", model),
        ),
    )


def _patches(frames: Iterable[np.ndarray], size: int) -> Iterable[np.ndarray]:
    """Consecutive frames stacked `size` at a time, `[size, H, W, 3]`; a short last group is
    padded with copies of its last frame (the processors' `patchify`)."""
    group: list[np.ndarray] = []
    for frame in frames:
        group.append(frame)
        if len(group) == size:
            yield np.stack(group)
            group = []
    if group:
        group += [group[-1]] * (size - len(group))
        yield np.stack(group)
