"""Where the vision tower runs: the executor half of the image encoder (`docs/design.md`,
"The engine's step"). `EncoderManager` hands each batch to an `EncoderExecutor`, which
returns a future of the embeddings: `InlineExecutor` (`inline`) runs the call at once,
inside the step; `EncoderThread` (`thread`, encoder_thread.py) in a thread of its own.

Both run the same `Tower`: patches from the uint8 pixels, then the vision tower, each
call timed (the scheduler's encoder-duration histogram).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from .patches import PatchMaker
from .thread import EncoderThread, Grid

if TYPE_CHECKING:
    from ..models.qwen2_vl import Qwen2VLForCausalLM

Placement = Literal["inline", "thread"]
MAX_TIMINGS = 4096  # tower durations kept until drained (a histogram feed, not a log)


class EncoderExecutor(Protocol):
    """Runs batches of images through the tower for the encoder manager."""

    @property
    def placement(self) -> Placement: ...

    @property
    def call_tokens(self) -> int | None:
        """The most image tokens a call should take beyond the encoder budget (None: no
        more limit than the budget)."""
        ...

    def submit(self, pixels: Sequence[torch.Tensor], grids: Sequence[Grid]) -> Future: ...

    def close(self) -> None: ...


class Tower:
    """The embeddings of images given by their uint8 pixels: patches, then the vision
    tower; every call timed (CUDA events on a GPU, read when drained; else wall time)."""

    def __init__(self, model: Qwen2VLForCausalLM, patches: PatchMaker) -> None:
        self.model = model
        self.patches = patches
        self.device = patches.device
        self._timings: deque[float | tuple[torch.cuda.Event, torch.cuda.Event]] = deque(
            maxlen=MAX_TIMINGS
        )

    def __call__(self, pixels: Sequence[torch.Tensor], grids: Sequence[Grid]) -> torch.Tensor:
        cuda = self.device.type == "cuda"
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        began = time.perf_counter()
        try:
            pixel_values = self.patches(pixels, grids)
            grid_tensor = torch.tensor(grids, device=self.device)
            return self.model.encode_images(pixel_values, grid_tensor)
        finally:  # a call that raised is timed too
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._timings.append((start, end))
            else:
                self._timings.append(time.perf_counter() - began)

    def drain_seconds(self) -> list[float]:
        """Durations of the calls since the previous drain."""
        seconds = []
        for timing in self._timings:
            if isinstance(timing, tuple):
                start, end = timing
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1000)
            else:
                seconds.append(timing)
        self._timings.clear()
        return seconds


class InlineExecutor:
    """Runs each call at once, in the caller's thread (the step's)."""

    placement: Literal["inline"] = "inline"
    call_tokens = None

    def __init__(self, tower: Tower) -> None:
        self.tower = tower

    def submit(self, pixels: Sequence[torch.Tensor], grids: Sequence[Grid]) -> Future:
        """The call's future, already done: its embeddings, or what it raised."""
        future: Future = Future()
        try:
            future.set_result(self.tower(pixels, grids))
        except Exception as error:
            future.set_exception(error)
        return future

    def close(self) -> None:
        pass


def encoder_executor(placement: Placement, tower: Tower, num_threads: int) -> EncoderExecutor:
    """The executor of `placement`; `num_threads`: the encoder thread's torch threads on a
    CPU while the steps run (on every core while they have nothing to run)."""
    if placement == "inline":
        return InlineExecutor(tower)
    thread = EncoderThread(tower, tower.device, num_threads, torch.get_num_threads())
    for block in getattr(tower.model.visual, "blocks", ()):  # its attention and MLP
        for part in block.children():
            part.register_forward_pre_hook(thread.adapt_threads)
    return thread
