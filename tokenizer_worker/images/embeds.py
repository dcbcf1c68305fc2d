"""Precomputed image embeddings: `image_embeds` content parts (`--enable-mm-embeds`).

A client that ran the vision tower itself sends its output instead of the image, as
vLLM takes it: `{"type": "image_embeds", "image_embeds": {"image_embeds": B64,
"image_grid_thw": B64}}` (vLLM's form: both tensors base64 of `torch.save`), or the flat
`{"type": "image_embeds", "image_embeds": B64, "image_grid_thw": [t, h, w]}`. B64 is
one tensor `[tokens, width]` saved by `torch.save` (read with `weights_only=True`: no
pickled code runs), by safetensors (the file's one tensor) or by numpy (`.npy`, no
pickles); float16, bfloat16 or float32.

Checked here: the size (`--max-image-bytes`' bound), the format, the grid (one frame,
sides that the patch merger divides) and that the tensor has the grid's
`t·h·w / merge²` rows. The width is the scheduler's to check (the LLM's hidden size,
times 1 + the DeepStack levels for Qwen3-VL). The tensor travels through the arena like
pixels, keyed by xxh3 of its bytes, dtype, shape and grid, apart from every pixel key.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any

import numpy as np
import torch

from ..media.fetch import MediaError
from ..prompt import Grid
from .key import image_key

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format


def read_embeds(
    data: object, grid: object, merge_size: int, max_bytes: int, where: str
) -> tuple[torch.Tensor, Grid]:
    """The embeddings `[tokens, width]` (contiguous, on the CPU) and the grid of one
    part, checked as above; a `MediaError` (400 naming `where`) otherwise."""
    try:
        tensor = _load_tensor(_decode(data, max_bytes, "image_embeds"))
        thw = _grid(grid, merge_size, max_bytes)
    except MediaError as e:
        raise MediaError(f"{where}: {e.message}", where) from None
    if tensor.dim() == 3 and tensor.shape[0] == 1:  # vLLM also takes [1, tokens, width]
        tensor = tensor[0]
    tokens = math.prod(thw) // merge_size**2
    if tensor.dim() != 2 or tensor.shape[0] != tokens:
        raise MediaError(
            f"{where}: image_embeds of shape {list(tensor.shape)} do not fit image_grid_thw "
            f"{list(thw)}: [{tokens}, width] expected (t*h*w / {merge_size}^2 rows)",
            where,
        )
    if tensor.dtype not in DTYPES:
        raise MediaError(
            f"{where}: image_embeds must be float16, bfloat16 or float32, not "
            f"{str(tensor.dtype).removeprefix('torch.')}",
            where,
        )
    return tensor.contiguous(), thw


def embeds_key(tensor: torch.Tensor, grid: Grid, model: str) -> bytes:
    """The embedding cache's key of client embeddings (never equal to a pixel key)."""
    raw = tensor.view(torch.uint8).reshape(-1).numpy()
    settings = (
        ("kind", "image_embeds"),
        ("dtype", str(tensor.dtype)),
        ("shape", tuple(tensor.shape)),
        ("grid", grid),
        ("model", model),
    )
    return image_key(raw, settings)  # type: ignore[arg-type]  # any buffer hashes


def _decode(data: object, max_bytes: int, name: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise MediaError(f"{name} must be a base64 string")
    if len(data) > (max_bytes + 2) // 3 * 4:
        raise MediaError(f"{name} is larger than the {max_bytes}-byte limit")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{name} is not valid base64") from None


def _load_tensor(raw: bytes) -> torch.Tensor:
    try:
        if raw.startswith(_NPY_MAGIC):
            return torch.from_numpy(np.load(io.BytesIO(raw), allow_pickle=False))
        if raw.startswith(_ZIP_MAGIC):
            loaded: Any = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        else:
            from safetensors.torch import load

            tensors = load(raw)
            if len(tensors) != 1:
                raise MediaError(f"a safetensors image_embeds holds {len(tensors)} tensors, not 1")
            [loaded] = tensors.values()
    except MediaError:
        raise
    except Exception as e:  # each format's reader raises its own errors on bad bytes
        raise MediaError(
            "image_embeds is not a tensor saved by torch.save, safetensors or numpy "
            f"({type(e).__name__}: {str(e)[:200]})"
        ) from None
    if not isinstance(loaded, torch.Tensor):
        raise MediaError(f"image_embeds holds a {type(loaded).__name__}, not a tensor")
    return loaded


def _grid(grid: object, merge_size: int, max_bytes: int) -> Grid:
    if isinstance(grid, str):  # vLLM's form: a torch-saved tensor of 3 ints
        grid = _load_tensor(_decode(grid, max_bytes, "image_grid_thw")).reshape(-1).tolist()
    if (
        not isinstance(grid, list | tuple)
        or len(grid) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in grid)
    ):
        raise MediaError("image_grid_thw must be 3 positive integers [t, h, w]")
    t, h, w = grid
    if t != 1:
        raise MediaError(f"image_grid_thw {list(grid)}: an image has t = 1 (no videos)")
    if h % merge_size or w % merge_size:
        raise MediaError(
            f"image_grid_thw {list(grid)}: h and w must be multiples of the merge size {merge_size}"
        )
    return (t, h, w)
