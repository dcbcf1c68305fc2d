"""The 128-bit key of an image: xxh3_128 over length-prefixed parts.

Length prefixes make the encoding injective: no two different (bytes, settings) pairs
feed the hasher the same stream, so a collision needs a real 128-bit hash collision.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def image_key(data: bytes, settings: Iterable[tuple[str, object]]) -> bytes:
    """Key of encoded image bytes under the processor settings that shape its pixels."""
    hasher = xxhash.xxh3_128()
    _feed(hasher, data)
    for name, value in sorted(settings):
        _feed(hasher, name.encode())
        _feed(hasher, repr(value).encode())
    return hasher.digest()


def _feed(hasher: xxhash.xxh3_128, part: bytes) -> None:
    hasher.update(len(part).to_bytes(8, "little"))
    hasher.update(part)
