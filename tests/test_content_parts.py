"""One list of content-part types (`common.content_parts.PART_TYPES`): every type in it is
taken by the server's protocol, routed by its media by the image router, and rendered by
the tokenizer worker as its modality; a new row of an existing form needs no other edit."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from iris_serve.common import content_parts
from iris_serve.common.content_parts import PART_TYPES, PartType, part_type
from iris_serve.server import protocol
from iris_serve.server.image_router import image_parts
from iris_serve.server.protocol import ChatMessage
from iris_serve.tokenizer_worker.chat import ChatError, parse_messages

DATA = "https://example.com/media-1"


def sample(row: PartType) -> dict[str, Any]:
    """A well-formed part of `row`'s type, its content `DATA`."""
    if row.form == "text":
        return {"type": row.name, row.field: DATA}
    if row.form == "url":
        return {"type": row.name, row.field: {"url": DATA}, "uuid": "u1"}
    return {"type": row.name, row.field: DATA, "image_grid_thw": [1, 2, 2], "uuid": "u1"}


def check_router_and_worker(row: PartType, wire: list[dict[str, Any]]) -> None:
    """The router routes the part of `row` in `wire` by its data when it is media, and the
    worker renders it as its modality."""
    assert wire[0]["content"] == [sample(row)]  # what crosses to the worker, as sent
    assert image_parts(wire) == ([(DATA, "u1")] if row.is_media else [])
    chat = parse_messages(wire)
    assert chat.messages[0]["content"] == [
        {"type": "text", "text": DATA} if row.modality == "text" else {"type": row.modality}
    ]
    given: dict[str, list[Any]] = {"image": chat.images, "video": chat.videos}
    for modality, parts in given.items():
        assert len(parts) == (1 if modality == row.modality else 0)
    if row.is_media:
        [part] = given[row.modality]
        assert part.uuid == "u1" and part.where == "messages[0].content[0]"
        if row.form == "embeds":
            assert part.embeds == (DATA, [1, 2, 2])
        else:
            assert part.url == DATA


@pytest.mark.parametrize("row", PART_TYPES, ids=[row.name for row in PART_TYPES])
def test_every_listed_part_type_is_taken_by_the_protocol_router_and_worker(row: PartType):
    message = ChatMessage.model_validate({"role": "user", "content": [sample(row)]})
    assert message.has_images == row.is_media
    check_router_and_worker(row, [message.wire()])


def test_a_new_row_of_an_existing_form_needs_no_other_edit(monkeypatch):
    row = PartType("image_link", "image", "image_link", "url")
    monkeypatch.setattr(content_parts, "PART_TYPES", (*PART_TYPES, row))
    monkeypatch.setitem(content_parts._BY_NAME, row.name, row)
    # the protocol builds its models from the table at import: build this row's the same way
    model = protocol._part_model(row)
    part = model.model_validate(sample(row))
    check_router_and_worker(
        row, [{"role": "user", "content": [part.model_dump(exclude_none=True)]}]
    )
    with pytest.raises(ValidationError, match=re.escape("an image part needs image_link.url")):
        model.model_validate({"type": "image_link", "image_link": {}})


def test_the_protocol_builds_one_model_per_row():
    assert list(protocol.PART_MODELS) == [row.name for row in PART_TYPES]
    assert not set(protocol._PARTS_NOT_TAKEN) & set(protocol.PART_MODELS)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image", "image": DATA},  # Qwen's form: neither the server nor the worker
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "hologram"},
    ],
)
def test_a_type_off_the_list_is_refused_by_every_role(part: dict[str, Any]):
    assert part_type(part) is None
    message = {"role": "user", "content": [part]}
    with pytest.raises(ValidationError, match="the supported types are text, image_url"):
        ChatMessage.model_validate(message)
    assert image_parts([message]) == []
    with pytest.raises(ChatError, match=f"unsupported content part type {part['type']!r}"):
        parse_messages([message])
