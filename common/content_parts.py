"""How an image part of an OpenAI chat message names its image.

The OpenAI message list crosses the server → tokenizer worker boundary as it came
(`TokenizeRequest.messages`), so reading an image part is shared vocabulary of that
wire: the worker loads the URLs it reads here (`tokenizer_worker.chat`), and the
server's image router routes by the same URLs (`server.image_router`). One reader, so
the two cannot disagree about which URL a part names.

A part may also carry `uuid` (vLLM's field): the client's id for the image. Sent with
the image's data, it names that image from then on; sent alone (`"image_url": null`, or
no `url`), it asks for the image sent before under that id (`tokenizer_worker.image_uuids`).
An `image_embeds` part carries the vision tower's output instead of an image
(`tokenizer_worker.image_embeds`). A `video_url` part names a video the same way
(`{"type": "video_url", "video_url": {"url": ...}, "uuid": ...}`); the router keeps it with
the worker that has its frames, as it keeps an image.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "IMAGE_PART_TYPES",
    "VIDEO_PART_TYPES",
    "image_part_data",
    "image_part_embeds",
    "image_part_url",
    "image_part_uuid",
    "video_part_url",
]

IMAGE_PART_TYPES = ("image_url", "image", "image_embeds")
VIDEO_PART_TYPES = ("video_url",)


def image_part_url(part: dict[str, Any]) -> object:
    """What an image part (`type` in `IMAGE_PART_TYPES`) names as its URL, unchecked:
    `image_url.url`, a bare `image_url` string, or `image` (the Qwen-style part); None
    for an `image_embeds` part."""
    kind = part.get("type")
    if kind == "image_url":
        spec = part.get("image_url")
        return spec.get("url") if isinstance(spec, dict) else spec
    return part.get("image") if kind == "image" else None


def image_part_embeds(part: dict[str, Any]) -> tuple[object, object]:
    """An `image_embeds` part's (embeddings, grid), unchecked, from vLLM's form
    `{"image_embeds": {"image_embeds": B64, "image_grid_thw": B64}}` or the flat one
    `{"image_embeds": B64, "image_grid_thw": [t, h, w]}`."""
    data, grid = part.get("image_embeds"), part.get("image_grid_thw")
    if isinstance(data, dict):
        return data.get("image_embeds"), data.get("image_grid_thw", grid)
    return data, grid


def video_part_url(part: dict[str, Any]) -> object:
    """What a `video_url` part names as its URL, unchecked: `video_url.url`, or a bare
    `video_url` string."""
    spec = part.get("video_url")
    return spec.get("url") if isinstance(spec, dict) else spec


def image_part_data(part: dict[str, Any]) -> object:
    """What identifies an image or video part's data for routing: its URL, or its
    embeddings."""
    kind = part.get("type")
    if kind == "image_embeds":
        return image_part_embeds(part)[0]
    return video_part_url(part) if kind in VIDEO_PART_TYPES else image_part_url(part)


def image_part_uuid(part: dict[str, Any]) -> object:
    """The client's id of an image part (`uuid`), unchecked; None when it has none."""
    return part.get("uuid")
