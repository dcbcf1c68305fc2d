"""How a message union travels: a msgpack codec per union that refuses another union's
messages and explains a bad frame, and token ids as packed int32 bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar, get_args

import msgspec
import numpy as np

T = TypeVar("T")


class MessageError(ValueError):
    """Bytes that are not a message of the expected union (a bug in the sender)."""


def _int_tag(struct: type[msgspec.Struct]) -> int:
    tag = struct.__struct_config__.tag
    if not isinstance(tag, int):
        raise TypeError(f"{struct.__name__} has no int tag (every message sets one)")
    return tag


class Codec(Generic[T]):
    """msgpack encoder/decoder for one union; refuses to send a message of another."""

    def __init__(self, union: Any, name: str) -> None:
        self.name = name
        self._encoder = msgspec.msgpack.Encoder()
        self.types: tuple[type[msgspec.Struct], ...] = get_args(union) or (union,)
        self._tags = sorted(_int_tag(t) for t in self.types)
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode(self, msg: T) -> bytes:
        if not isinstance(msg, self.types):
            raise TypeError(f"{type(msg).__name__} is not a {self.name} message")
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as e:
            raise MessageError(f"bad {self.name} message: {self._explain(data, e)}") from e

    def _explain(self, data: bytes | memoryview, error: Exception) -> str:
        try:
            raw = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            return str(error)
        if isinstance(raw, list) and raw and raw[0] not in self._tags:
            return f"unknown tag {raw[0]!r} (expected one of {self._tags})"
        return str(error)


# --- token ids --------------------------------------------------------------------

_INT32_LE = np.dtype("<i4")


def pack_token_ids(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes (the `EngineRequest.token_ids` form)."""
    return np.asarray(token_ids, dtype=_INT32_LE).tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=_INT32_LE).tolist()
