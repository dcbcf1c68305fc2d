"""EVS-style video token pruning (`--video-pruning-rate q`), decided on the sampled pixels.

A video's temporal patches after the first often barely change from the one before them
(a static scene, a screen recording). Pruning drops the placeholder tokens of the merged
cells (a `merge_size * patch_size` square of the resized frames, one LLM token each) that
changed least since the previous patch, and keeps the rest at their own M-RoPE positions.

**Where and on what.** vLLM's EVS compares the merged embeddings after the vision tower
(1 - cosine, `multimodal/video_prune/evs.py`). Iris decides here, in the tokenizer worker,
on the resized uint8 pixels, before anything runs: the token count, the token ids, the
positions and the cache keys are then all known at admission, as for an unpruned video,
and every patch stays a cache entry of its own. The scheduler still encodes the whole
patch (the vision tower needs the whole grid) and keeps the rows of the kept tokens.

**The measure** is the mean absolute difference of the normalised pixel values
(`(x * rescale - mean) / std`, per channel, as the model sees them) over the cell's pixels
in both frames of the patch, against the same cell of the previous patch. Not 1 - cosine:
on pixels the direction of a cell's vector says little (a flat cell that darkens or
changes hue keeps its direction, and a cell near the mean colour is a near-zero vector
whose cosine is noise), whereas the absolute difference is zero exactly when nothing
changed, grows with the change, and is computed in integers and then a fixed float sum,
so the same pixels always give the same choice on every machine.

**The budget is per patch**, not vLLM's top-k over the whole video: patch 0 keeps all its
tokens and every later patch exactly `max(1, round(n * (1 - q)))` of its n, the most
dissimilar ones (ties to the lower index), in raster order. A patch's kept tokens then
depend on its own pixels and its predecessor's alone, so a second question, or an
overlapping clip that shares a run of patches, makes the same choice and reuses them.
The patch's key changes with the choice: it covers the patch's own key, the previous
patch's key, q and the kept indices (`pruned_key`). A patch that keeps every token keeps
its unpruned key (its embedding and positions are those of the unpruned patch).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

import numpy as np

from ..images.key import image_key
from .rules import VideoProcessorSettings

PRUNING_FORMAT = "evs pixels, mean abs diff of normalised values, per-patch budget, v1"

Kept = tuple[int, ...] | None  # a patch's kept token indices in raster order; None: all


def check_pruning_rate(rate: float) -> float:
    """`rate` if it is a pruning rate in [0, 1), else ValueError."""
    if not 0.0 <= rate < 1.0:  # also refuses nan
        raise ValueError(f"the video pruning rate must lie in [0, 1), got {rate}")
    return rate


def keep_count(num_tokens: int, rate: float) -> int:
    """Tokens a patch after the first keeps of its `num_tokens` (Python's `round`)."""
    return max(1, round(num_tokens * (1.0 - rate)))


class VideoPruner:
    """Chooses each temporal patch's kept tokens under one checkpoint's video settings."""

    def __init__(self, settings: VideoProcessorSettings, rate: float) -> None:
        self.rate = check_pruning_rate(rate)
        self.cell = settings.merge_size * settings.patch_size
        self.scale = channel_scale(settings)

    @property
    def enabled(self) -> bool:
        return self.rate > 0.0

    def kept(self, previous: np.ndarray | None, current: np.ndarray) -> Kept:
        """The kept token indices of patch `current` (uint8 `[frames, H, W, 3]`) after
        `previous` (None: the video's first patch, which keeps all), None when it keeps all."""
        if previous is None or not self.enabled:
            return None
        scores = dissimilarity(previous, current, self.cell, self.scale)
        count = keep_count(scores.size, self.rate)
        if count >= scores.size:
            return None
        # stable sort of the negated scores: the most dissimilar first, ties by index
        chosen = np.argsort(-scores, kind="stable")[:count]
        return tuple(int(index) for index in np.sort(chosen))

    def key(self, key: bytes, previous_key: bytes | None, kept: Kept) -> bytes:
        """The key the patch goes by: its own when it keeps all, else `pruned_key`."""
        if kept is None:
            return key
        assert previous_key is not None, "the first patch keeps all its tokens"
        return pruned_key(key, previous_key, self.rate, kept)


def dissimilarity(
    previous: np.ndarray, current: np.ndarray, cell: int, scale: np.ndarray
) -> np.ndarray:
    """Per merged token cell, raster order, of two uint8 patches `[frames, H, W, 3]`: the
    mean absolute difference of their normalised values (`scale`: per channel, the
    normalisation's factor `rescale / std`), float64 `[H / cell * W / cell]`."""
    if previous.shape != current.shape:
        raise ValueError(f"patches of shapes {previous.shape} and {current.shape}")
    frames, height, width, channels = current.shape
    if height % cell or width % cell:
        raise ValueError(f"a {height}x{width} frame is not made of {cell}-pixel cells")
    diff = np.abs(current.astype(np.int16) - previous.astype(np.int16))
    cells = diff.reshape(frames, height // cell, cell, width // cell, cell, channels)
    sums = cells.sum(axis=(0, 2, 4), dtype=np.int64)  # [h', w', C], exact
    values = frames * cell * cell * channels
    return (sums.astype(np.float64) @ scale).reshape(-1) / values


def channel_scale(settings: VideoProcessorSettings) -> np.ndarray:
    """Per channel, what one uint8 level is worth in the model's normalised input."""
    given = dict(settings.pixel_settings)

    def setting(name: str, default: object) -> object:
        value = ast.literal_eval(given.get(name, "None"))
        return default if value is None else value

    rescale = float(setting("rescale_factor", 1 / 255)) if setting("do_rescale", True) else 1.0  # pyright: ignore[reportArgumentType]: a number
    std = setting("image_std", [1.0, 1.0, 1.0]) if setting("do_normalize", True) else [1.0] * 3
    return rescale / np.asarray(std, dtype=np.float64).reshape(3)


def pruned_key(key: bytes, previous_key: bytes, rate: float, kept: Sequence[int]) -> bytes:
    """The key of a pruned patch: its own key, its predecessor's (the choice depends on
    both patches' pixels), the rate and the kept indices."""
    indices = np.asarray(kept, dtype="<u4").tobytes()
    return image_key(
        key + previous_key + indices,
        (("video_pruning", PRUNING_FORMAT), ("rate", rate), ("kept", len(kept))),
    )
