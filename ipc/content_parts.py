"""How an image part of an OpenAI chat message names its image.

The OpenAI message list crosses the server → tokenizer worker boundary as it came
(`TokenizeRequest.messages`), so reading an image part is shared vocabulary of that
wire: the worker loads the URLs it reads here (`tokenizer_worker.chat`), and the
server's image router routes by the same URLs (`server.image_router`). One reader, so
the two cannot disagree about which URL a part names.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IMAGE_PART_TYPES", "image_part_url"]

IMAGE_PART_TYPES = ("image_url", "image")


def image_part_url(part: dict[str, Any]) -> object:
    """What an image part (`type` in `IMAGE_PART_TYPES`) names as its URL, unchecked:
    `image_url.url`, a bare `image_url` string, or `image` (the Qwen-style part)."""
    if part.get("type") == "image_url":
        spec = part.get("image_url")
        return spec.get("url") if isinstance(spec, dict) else spec
    return part.get("image")
