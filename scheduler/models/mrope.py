"""M-RoPE positions for a prompt, from image spans instead of a scan of the token ids.

Text tokens advance all three axes together. An image's `t*h'*w'` tokens (h', w' after
merging) sit on a grid whose temporal, row and column positions start where the next
text token would have; the text after it resumes one past the largest position of the
block, `max(h', w')` past its start for an image. A prompt with images therefore ends
below its length, and every later token `i` sits at `i + rope_delta` on all three axes.
Equal, for images, to transformers' `get_rope_index` of Qwen2-VL, Qwen2.5-VL and Qwen3-VL
(which differs only in its frequency layout, `layers.mrope_cos_sin`).

A video arrives as one item per temporal patch (`ipc.ImageRef`). Under Qwen2-VL and
Qwen2.5-VL a video is one block: its later patches continue the block (they start where
the first one did) at temporal position `rope_time` (the patch's index, scaled to seconds
for Qwen2.5-VL), and the text after it resumes one past the block's largest position, the
models' own rule and vLLM's. transformers 5.24 resumes elsewhere after a video
(tests/test_video_positions.py pins ours). Qwen3-VL's patches are blocks of their own.

A pruned video patch (`--video-pruning-rate`) holds only its kept tokens: each sits where
it sits unpruned, at its own grid cell, and the block's extent, so the text after it, is
the unpruned one's (the positions of the dropped tokens are simply never used).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

# (rope_time, continue_block) of one item: see the module docstring
Block = tuple[int, bool]
IMAGE_BLOCK: Block = (0, False)


def mrope_positions(
    num_tokens: int,
    image_spans: Sequence[tuple[int, int]],
    image_grids: Sequence[tuple[int, int, int]],
    spatial_merge_size: int,
    blocks: Sequence[Block] | None = None,
    kept: Sequence[tuple[int, ...] | None] | None = None,
) -> tuple[torch.Tensor, int]:
    """Positions `[3, num_tokens]` (int64) and the rope delta of a whole prompt. `image_spans`
    are `(offset, length)` of each item's run of placeholder tokens in the token ids,
    `image_grids` the matching `(t, h, w)` in patches before merging, `blocks` each item's
    `(rope_time, continue_block)` (all images when None), `kept` each item's kept token
    indices into its grid's merged tokens, increasing (None: all; all items when None)."""
    blocks = blocks if blocks is not None else [IMAGE_BLOCK] * len(image_spans)
    kept = kept if kept is not None else [None] * len(image_spans)
    if not len(image_spans) == len(image_grids) == len(blocks) == len(kept):
        raise ValueError(f"{len(image_spans)} image spans but {len(image_grids)} grids")
    m = spatial_merge_size
    parts: list[torch.Tensor] = []
    token = 0  # next token index
    position = 0  # position of the next text token
    start = 0  # first position of the block being laid out
    for (offset, length), (t, h, w), (rope_time, continues), indices in sorted(
        zip(image_spans, image_grids, blocks, kept, strict=True), key=lambda item: item[0]
    ):
        gh, gw = h // m, w // m
        if indices is not None:
            _check_kept(indices, length, t * gh * gw)
        elif length != t * gh * gw:
            raise ValueError(f"image span of {length} tokens does not match grid {(t, h, w)}")
        if offset < token or offset + length > num_tokens:
            raise ValueError(f"image span {(offset, length)} overlaps another or the end")
        if continues and (offset != token or not parts):
            raise ValueError(f"the video patch at {offset} continues no block before it")
        if offset > token:
            parts.append(_text(position, offset - token))
            position += offset - token
        if not continues:
            start = position
        tt = torch.arange(rope_time, rope_time + t).view(t, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
        grid = torch.stack([tt, hh, ww]).reshape(3, -1) + start
        parts.append(grid if indices is None else grid[:, list(indices)])
        position = max(position if continues else 0, start + max(rope_time + t, gh, gw))
        token = offset + length
    if token < num_tokens:
        parts.append(_text(position, num_tokens - token))
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens


def _check_kept(indices: tuple[int, ...], length: int, grid_tokens: int) -> None:
    """ValueError unless `indices` are `length` increasing token indices of the grid."""
    if len(indices) != length:
        raise ValueError(f"image span of {length} tokens keeps {len(indices)} tokens")
    ordered = all(a < b for a, b in pairwise(indices))
    if not ordered or (indices and not 0 <= indices[0] <= indices[-1] < grid_tokens):
        raise ValueError(f"kept tokens must be increasing indices below {grid_tokens}")


def _text(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.long).repeat(3, 1)
