"""OpenAI chat messages → the chat template's messages and the image and video URLs, in
order.

The server has checked the JSON's basic shape; this checks what the template and the
worker rely on. Roles: system, developer (rendered as system), user, assistant. Content:
a string, or a list of parts of the types in `common.content_parts.PART_TYPES`: a text
part stays text; every image part (`{"type": "image_url", "image_url": {"url": ...,
"detail": ...}}`, or the URL as a plain string) becomes the template's `{"type": "image"}`
placeholder, every video part (`{"type": "video_url", "video_url": {"url": ...}}`) its
`{"type": "video"}` one. `detail` is ignored (the processor's min/max pixels decide the
resolution). A media part may carry a `uuid` (image_uuids.py), and with one needs no URL;
an `image_embeds` part's data stay unread here. An assistant message's `tool_calls` keep
their OpenAI shape with `arguments` decoded from its JSON string, as Qwen's templates
expect (they `tojson` it: a string would come out encoded twice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..common.content_parts import PART_TYPES, part_embeds, part_type, part_url, part_uuid

MAX_UUID_CHARS = 256

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


class ChatError(ValueError):
    """The messages cannot be rendered; the request fails with `status`."""

    status = 400

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ImagePart:
    """One image part: its URL, the client's id, and where it is (`messages[i].content[j]`,
    the `param` of an error about it). An `image_embeds` part has `embeds` (unchecked)
    instead of a URL; a part with neither is named by its uuid alone."""

    url: str | None
    uuid: str | None
    where: str
    embeds: tuple[object, object] | None = None
    is_embeds: bool = False  # an image_embeds part (with data or not)

    @property
    def has_data(self) -> bool:
        return self.url is not None or self.embeds is not None


@dataclass(frozen=True)
class VideoPart:
    """One video part: its URL (None: named by its uuid alone), the client's id, and
    where it is (`messages[i].content[j]`)."""

    url: str | None
    uuid: str | None
    where: str

    @property
    def has_data(self) -> bool:
        return self.url is not None


@dataclass(frozen=True)
class Chat:
    messages: list[dict[str, Any]]  # in the chat template's form
    images: list[ImagePart]  # one per image placeholder, in prompt order
    videos: list[VideoPart] = field(default_factory=list)  # one per video placeholder

    @property
    def image_urls(self) -> list[str]:
        """The URLs to fetch, in prompt order (parts named by their uuid alone have none)."""
        return [image.url for image in self.images if image.url is not None]

    @property
    def image_url_parts(self) -> list[str]:
        """Where each of `image_urls` is (`messages[i].content[j]`), in the same order."""
        return [image.where for image in self.images if image.url is not None]

    @property
    def video_urls(self) -> list[str]:
        """The video URLs to fetch, in prompt order (parts named by their uuid alone have
        none)."""
        return [video.url for video in self.videos if video.url is not None]

    @property
    def video_url_parts(self) -> list[str]:
        """Where each of `video_urls` is, in the same order."""
        return [video.where for video in self.videos if video.url is not None]


def parse_messages(messages: object) -> Chat:
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    rendered: list[dict[str, Any]] = []
    images: list[ImagePart] = []
    videos: list[VideoPart] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatError(f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise ChatError(
                f"{where}: unsupported role {role!r} (system, developer, user, assistant or tool)"
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        entry: dict[str, Any]
        if isinstance(content, str):
            entry = {"role": ROLES[role], "content": content}
        elif isinstance(content, list):
            parts = [
                _part(part, f"{where}.content[{j}]", images, videos)
                for j, part in enumerate(content)
            ]
            entry = {"role": ROLES[role], "content": parts}
        else:
            raise ChatError(f"{where}.content must be a string or a list of content parts")
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and "tool_call_id" in message:
            entry["tool_call_id"] = message["tool_call_id"]
        rendered.append(entry)
    return Chat(rendered, images, videos)


def _tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatError(f"{where} must be a list")
    rendered = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatError(f"{where}[{j}] must have a function with a name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise ChatError(f"{where}[{j}].function.arguments is not valid JSON") from None
        rendered.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return rendered


def _part(
    part: object, where: str, images: list[ImagePart], videos: list[VideoPart]
) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise ChatError(f"{where} must be an object")
    row = part_type(part)
    if row is None:
        raise ChatError(
            f"{where}: unsupported content part type {part.get('type')!r} "
            f"({', '.join(r.name for r in PART_TYPES)})",
            f"{where}.type",
        )
    if row.form == "text":
        text = part.get(row.field)
        if not isinstance(text, str):
            raise ChatError(f"{where}.{row.field} must be a string")
        return {"type": "text", "text": text}
    uuid = part_uuid(part)
    if uuid is not None and (not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_UUID_CHARS):
        raise ChatError(f"{where}.uuid must be a string of 1 to {MAX_UUID_CHARS} characters", where)
    if row.modality == "video":
        videos.append(VideoPart(_media_url(part_url(part), uuid, where, "video"), uuid, where))
        return {"type": "video"}
    if row.form == "embeds":
        data, grid = part_embeds(part)
        if data is None and uuid is None:
            raise ChatError(
                f"{where}: {row.name} needs its data, or the uuid of an image sent before", where
            )
        embeds = None if data is None else (data, grid)
        images.append(ImagePart(None, uuid, where, embeds, is_embeds=True))
        return {"type": "image"}
    images.append(ImagePart(_media_url(part_url(part), uuid, where, "image"), uuid, where))
    return {"type": "image"}


def _media_url(url: object, uuid: str | None, where: str, noun: str) -> str | None:
    """The part's URL, checked; None for a part named by its uuid alone."""
    if url is None and uuid is not None:
        return None
    if not isinstance(url, str) or not url:
        raise ChatError(
            f"{where}: the {noun} URL must be a non-empty string (or give the uuid of "
            f"{'a video' if noun == 'video' else 'an image'} sent before)"
        )
    return url
