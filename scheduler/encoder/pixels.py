"""The one owner of every admitted image's pixels and of the pin that keeps them readable
(`docs/design.md`, "Shared memory has an owner and a lifetime"); in one process they
are plain tensors with no pin. They are held here from admission until no step will
read them again: `drop(request_id, index)` once the request holds the image's embedding
(the encoder manager calls it), `release(request)` when the request ends, however it
ends; a preemption keeps them.

A dropped image's pin (if it has one) is queued exactly once; the scheduler process
sends what `pop_released()` returns back to the owning workers after every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...ipc.messages import ShmPointer
from ..step.request import Request, RequestResources

Pin = ShmPointer  # an image of a served request; one in process has none


class PixelStore(RequestResources):
    def __init__(self) -> None:
        self._pixels: dict[str, dict[int, torch.Tensor]] = {}
        self._pins: dict[str, dict[int, Pin]] = {}
        self._released: list[Pin] = []

    def add(
        self,
        request_id: str,
        pixels: Sequence[torch.Tensor | None],
        pins: Sequence[Pin | None] = (),
    ) -> None:
        """Takes a new request's pixels (one per image; None for an image that came
        without) and their pins (none in process)."""
        if pins and len(pins) != len(pixels):
            raise ValueError(f"{len(pins)} pins for {len(pixels)} images")
        held_pixels = {index: p for index, p in enumerate(pixels) if p is not None}
        if held_pixels:
            self._pixels[request_id] = held_pixels
        held = {index: pin for index, pin in enumerate(pins) if pin is not None}
        if held:
            self._pins[request_id] = held

    def has(self, request_id: str, index: int) -> bool:
        return index in self._pixels.get(request_id, {})

    def get(self, request_id: str, index: int) -> torch.Tensor:
        try:
            return self._pixels[request_id][index]
        except KeyError:
            raise RuntimeError(
                f"image {index} of {request_id!r} is to be encoded but its pixels were released"
            ) from None

    def drop(self, request_id: str, index: int) -> None:
        """No step reads these pixels again: they go, and their pin is queued for release."""
        pixels = self._pixels.get(request_id, {})
        pixels.pop(index, None)
        if not pixels:
            self._pixels.pop(request_id, None)
        pins = self._pins.get(request_id, {})
        pin = pins.pop(index, None)
        if pin is not None:
            self._released.append(pin)
        if not pins:
            self._pins.pop(request_id, None)

    def release(self, request: Request) -> None:
        self.drop_request(request.request_id)

    def drop_request(self, request_id: str) -> None:
        """The request ended: everything it still holds goes."""
        self._pixels.pop(request_id, None)
        self._released.extend(self._pins.pop(request_id, {}).values())

    def pop_released(self) -> list[Pin]:
        """Pins dropped since the previous call, each exactly once, in drop order."""
        released, self._released = self._released, []
        return released

    @property
    def num_pinned(self) -> int:
        """Pins held and not yet dropped."""
        return sum(len(pins) for pins in self._pins.values())
