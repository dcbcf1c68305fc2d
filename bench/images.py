"""Deterministic benchmark images: JPEG bytes of structured noise, generated on demand.

Each `(width, height, seed)` gives the same bytes on every run (numpy's seeded generator,
Pillow's JPEG encoder at a fixed quality), and different seeds give different bytes, so
every image has its own cache key. The picture is a smooth two-colour gradient with a
few flat rectangles ("windows") and mild noise on top: it compresses like a screenshot
or a photo would (hundreds of kB at 1920×1080), not like pure noise (megabytes).
Nothing is written to disk.
"""

from __future__ import annotations

import base64
import functools
import io

import numpy as np
from PIL import Image

# The multi-turn cycle: 720p, 1080p, 1440p.
HD, FULL_HD, QHD = (1280, 720), (1920, 1080), (2560, 1440)
JPEG_QUALITY = 85


@functools.lru_cache(maxsize=64)
def jpeg_bytes(width: int, height: int, seed: int) -> bytes:
    """A `width`×`height` RGB JPEG, the same bytes for the same arguments."""
    rng = np.random.default_rng([width, height, seed])
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    start, end = rng.uniform(0, 255, size=(2, 3)).astype(np.float32)
    picture = start + (end - start) * (0.6 * x + 0.4 * y)  # (height, width, 3)
    for _ in range(6):  # flat rectangles, like windows on a screen
        x0, x1 = sorted(rng.integers(0, width, size=2))
        y0, y1 = sorted(rng.integers(0, height, size=2))
        picture[y0:y1, x0:x1] = rng.uniform(0, 255, size=3)
    picture += rng.normal(0.0, 6.0, size=(height, width, 1)).astype(np.float32)
    pixels = np.clip(picture, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def data_url(width: int, height: int, seed: int) -> str:
    """The image as an OpenAI `image_url` data: URL."""
    encoded = base64.b64encode(jpeg_bytes(width, height, seed)).decode("ascii")
    return f"data:image/jpeg;base64,{encoded}"


def image_part(width: int, height: int, seed: int) -> dict:
    """An OpenAI chat content part holding the image."""
    return {"type": "image_url", "image_url": {"url": data_url(width, height, seed)}}
