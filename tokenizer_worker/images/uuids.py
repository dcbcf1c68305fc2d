"""Client-supplied image ids (`uuid` on an image part, vLLM's field): send once, name later.

A part sent with its data and a uuid binds the uuid to the image key, the grid and the
token count. A later part with the uuid and no data is served from the processor cache
if the arena still holds the pixels, else without pixels (the scheduler's embedding
cache must hold it, or refuses it with a 400). A uuid nobody bound is a 400 asking to
resend the data.

The uuid is only an alias of the content key (`docs/design.md`, "Hash once, early, on
the cheapest bytes"), unlike vLLM's, which is the key itself: two uuids of the same bytes
share every cache entry, a uuid re-sent with other bytes is re-bound to them, and no
client can make the server answer from an image it never sent.

A binding holds for the size bounds it was made under (`min_pixels`/`max_pixels` change
the key and the grid): the map is keyed by (uuid, size). It lives in the worker that
processed the image (`server.image_router` routes the uuid there) and is bounded: least
recently used bindings go first past `capacity` (about 200 bytes each).

A video's uuid works the same way, in a map of its own: it names what the video became
(`video_loader.VideoLayout`: every temporal patch's key), under the video settings it was
sent with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, NamedTuple, TypeVar

from ..prompt import Grid


class Binding(NamedTuple):
    key: bytes  # the image key (`image_key`): the processor and embedding caches' key
    grid: Grid
    num_tokens: int


B = TypeVar("B")


class ImageUuids(Generic[B]):
    """uuid → binding (an image's `Binding`), per size, LRU-bounded to `capacity` entries.
    The size is what else the binding depends on: an image's `ImageSize`, a video's
    settings."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the uuid capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self.hits = 0  # parts without data whose uuid was known
        self.misses = 0  # parts without data whose uuid was not
        self._bindings: OrderedDict[tuple[str, Hashable], B] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bindings)

    def bind(self, uuid: str, size: Hashable, binding: B) -> None:
        """The image sent with `uuid` (its data hashed to `binding.key`); replaces an
        earlier binding of the uuid at this size."""
        entry = (uuid, size)
        self._bindings[entry] = binding
        self._bindings.move_to_end(entry)
        while len(self._bindings) > self.capacity:
            self._bindings.popitem(last=False)

    def recall(self, uuid: str, size: Hashable) -> B | None:
        """The binding of a part sent with `uuid` and no data; None (counted) if unknown."""
        entry = (uuid, size)
        binding = self._bindings.get(entry)
        if binding is None:
            self.misses += 1
            return None
        self._bindings.move_to_end(entry)
        self.hits += 1
        return binding

    def peek(self, uuid: str, size: Hashable) -> B | None:
        """The binding, without counting or refreshing it."""
        return self._bindings.get((uuid, size))
