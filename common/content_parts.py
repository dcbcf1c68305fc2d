"""The content-part types of an OpenAI chat message that Iris takes: one table, and how a
part of each names its media.

`PART_TYPES` is read by all three roles that look at parts, so they cannot disagree about
which types exist: the server's protocol builds its validation from it
(`server.protocol`), the server's image router routes every media part by the data read
here (`server.image_router`), and the tokenizer worker turns each part into the chat
template's placeholder of its modality and loads the media read here
(`tokenizer_worker.chat`). The message list crosses the server → tokenizer worker
boundary as it came (`TokenizeRequest.messages`), so these readers are shared vocabulary
of that wire. A new type of an existing `form` is one row.

A media part may also carry `uuid` (vLLM's field): the client's id for the image or video.
Sent with the data, it names that image from then on; sent alone (`"image_url": null`, or
no `url`), it asks for the one sent before under that id (`tokenizer_worker.image_uuids`).
An `image_embeds` part carries the vision tower's output instead of an image
(`tokenizer_worker.image_embeds`). A `video_url` part names a video as an `image_url` part
names an image; the router keeps it with the worker that has its frames, as it keeps an
image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "PART_TYPES",
    "PartType",
    "media_part_type",
    "part_data",
    "part_embeds",
    "part_modality",
    "part_type",
    "part_url",
    "part_uuid",
]

Modality = Literal["text", "image", "video"]
# How a part holds its content, each read one way here and checked one way by the protocol:
#   "text":   `{field: "..."}`;
#   "url":    `{field: {"url": URL}}` (the worker also takes `{field: URL}`), or the uuid alone;
#   "embeds": `{field: {"image_embeds": B64, "image_grid_thw": B64}}`, or `{field: B64,
#             "image_grid_thw": [t, h, w]}`, or the uuid alone.
Form = Literal["text", "url", "embeds"]


@dataclass(frozen=True)
class PartType:
    """One content-part type: its `type`, the modality it becomes in the chat template
    (the worker renders every image part as `{"type": "image"}`, every video part as
    `{"type": "video"}`), the field that holds its content and that field's `form`.
    `flag` names the server option a type needs (None: always taken)."""

    name: str
    modality: Modality
    field: str
    form: Form
    flag: str | None = None

    @property
    def is_media(self) -> bool:
        """An image or a video: fetched by the worker, routed by the server."""
        return self.modality != "text"


PART_TYPES: tuple[PartType, ...] = (
    PartType("text", "text", "text", "text"),
    PartType("image_url", "image", "image_url", "url"),
    PartType("video_url", "video", "video_url", "url"),
    PartType("image_embeds", "image", "image_embeds", "embeds", flag="--enable-mm-embeds"),
)
_BY_NAME = {row.name: row for row in PART_TYPES}


def part_type(part: object) -> PartType | None:
    """The row of a part's `type`; None for a type Iris does not take, or no object."""
    kind = part.get("type") if isinstance(part, dict) else None
    return _BY_NAME.get(kind) if isinstance(kind, str) else None


def media_part_type(part: object) -> PartType | None:
    """The row of an image or video part; None for a text part or anything else."""
    row = part_type(part)
    return row if row is not None and row.is_media else None


def part_modality(part: object) -> Modality | None:
    """The modality of a part's type; None for a type Iris does not take."""
    row = part_type(part)
    return None if row is None else row.modality


def part_url(part: dict[str, Any]) -> object:
    """What a "url" part names as its URL, unchecked: `<field>.url`, or a bare `<field>`
    string; None for a part of another form."""
    row = part_type(part)
    if row is None or row.form != "url":
        return None
    spec = part.get(row.field)
    return spec.get("url") if isinstance(spec, dict) else spec


def part_embeds(part: dict[str, Any]) -> tuple[object, object]:
    """An "embeds" part's (embeddings, grid), unchecked, from vLLM's form
    `{"image_embeds": {"image_embeds": B64, "image_grid_thw": B64}}` or the flat one
    `{"image_embeds": B64, "image_grid_thw": [t, h, w]}`; (None, None) for a part of
    another form."""
    row = part_type(part)
    if row is None or row.form != "embeds":
        return None, None
    data, grid = part.get(row.field), part.get("image_grid_thw")
    if isinstance(data, dict):
        return data.get("image_embeds"), data.get("image_grid_thw", grid)
    return data, grid


def part_data(part: dict[str, Any]) -> object:
    """What identifies a media part's data for routing, unchecked: its URL, or its
    embeddings; None for a part of neither form."""
    row = part_type(part)
    if row is not None and row.form == "embeds":
        return part_embeds(part)[0]
    return part_url(part)


def part_uuid(part: dict[str, Any]) -> object:
    """The client's id of a media part (`uuid`), unchecked; None when it has none."""
    return part.get("uuid")
