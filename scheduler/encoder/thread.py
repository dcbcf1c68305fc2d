"""The `thread` placement of the vision tower (`docs/design.md`, "The engine's step"): the
encoder manager hands each batch of images to one thread and the steps go on.

- On a CPU the cores are shared, never oversubscribed (more OpenMP threads than cores
  spin-wait on each other). torch's thread count is per calling thread: while the steps
  run, the encoder uses `--encoder-threads` of the cores (`CoreSharing.share`); while
  they have nothing to run, every core. It looks before each part of each vision block
  (`adapt_threads`, a forward pre-hook), so it follows the steps within a fraction of a
  block, and parks there while `CoreSharing` holds it (`hold`/`release`) so that a
  prefill gets every core. A call takes at most `CPU_CALL_TOKENS` image tokens: one large
  image already keeps the cores busy, and batching more makes the first image's request
  wait for the others'.
- On CUDA the thread runs on a stream of its own; a result is handed over once an event
  says its work finished, and is marked as used by the main stream, so the caching
  allocator never recycles it under a step still reading it.

A submitted call owns its pixels: the caller's views of a worker's shared memory (whose
pin an ended request gives back at any time) are copied before `submit` returns, on CUDA
by a DMA from the pinned segment (`pinned_host.py`), waited for. Calls run one at a time,
in order, so the tower's activations are those of one call, as inline.

On CUDA the thread lives as long as the encoder: torch keeps cuDNN's attention graphs
per thread. On a CPU it exits as soon as no call is queued: libgomp keeps a pool of
workers for every thread that ran a parallel region until that thread exits, and with
more of them than cores puts idle workers to sleep at once, so each parallel region of a
step would pay a futex wake-up for as long as an idle encoder thread lived.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Literal

import torch

Grid = tuple[int, int, int]
_NAME = "iris-encoder"
CPU_CALL_TOKENS = 1024  # image tokens per call on a CPU (see the module's docstring)
TowerCall = Callable[[Sequence[torch.Tensor], Sequence[Grid]], torch.Tensor]


class EncoderThread:
    """The `thread` placement's `EncoderExecutor` (encoder_executor.py)."""

    placement: Literal["thread"] = "thread"

    def __init__(
        self,
        call: TowerCall,
        device: torch.device,
        num_threads: int,
        all_threads: int,
        keep_alive: bool | None = None,
    ) -> None:
        """`call(pixels, grids)`: the images' embeddings (patch maker and vision tower); on a CPU,
        `num_threads` torch threads for it while the steps run, `all_threads` while they do not.
        `keep_alive`: one thread until `close()` (None: on CUDA only; see the module docstring)."""
        if num_threads < 1:
            raise ValueError(f"the encoder needs at least one thread, got {num_threads}")
        self._call = call
        self.device = device
        self.num_threads = num_threads
        self.call_tokens = CPU_CALL_TOKENS if device.type == "cpu" else None
        self.all_threads = max(all_threads, num_threads)
        self.steps_idle = False  # `set_steps_idle`; read in this thread before each block
        # A hold parks the encoder thread before its next block part, so a prefill can
        # have every core (core_sharing.py); `parked` says it waits there.
        self._hold = threading.Condition()
        self._held = False
        self.parked = False
        self._stream: torch.cuda.Stream | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._copy_stream = torch.cuda.Stream(device)
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)  # a call queued, or closed
        self._keep_alive = device.type == "cuda" if keep_alive is None else keep_alive
        self._queue: deque[tuple[Future, list[torch.Tensor], list[Grid]]] = deque()
        self._worker: threading.Thread | None = None  # alive while calls are queued, or kept
        self._closed = False

    def submit(self, pixels: Sequence[torch.Tensor], grids: Sequence[Grid]) -> Future:
        """Queues a call on copies of `pixels` (made here); its future holds the
        embeddings."""
        future: Future = Future()
        owned = self._own(pixels)
        with self._lock:
            if self._closed:
                raise RuntimeError("the encoder thread is closed")
            self._queue.append((future, owned, list(grids)))
            self._queued.notify()
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name=_NAME, daemon=True)
                self._worker.start()
        return future

    def _own(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `pixels` that outlive their pins (see the module's docstring). On CUDA
        on a stream of their own: on the encoder's they would queue behind a running call,
        and the wait for them would hold the steps for as long."""
        if self._stream is None or self._copy_stream is None:
            return [image.clone() for image in pixels]
        with torch.cuda.stream(self._copy_stream):
            owned = [image.to(self.device, non_blocking=True) for image in pixels]
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        copied.synchronize()
        for image in owned:  # read on the encoder's stream: not reused before it is done
            image.record_stream(self._stream)
        return owned

    def close(self) -> None:
        """Cancels the calls not started and lets the running one finish in the background."""
        with self._lock:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._queued.notify_all()
        for future, _, _ in queued:
            future.cancel()
        self.release()

    def hold(self) -> None:
        """Asks the encoder thread to park before its next block part (or call) until
        `release()`; `parked` turns True once it does."""
        with self._hold:
            self._held = True

    def release(self) -> None:
        with self._hold:
            self._held = False
            self.parked = False  # for the caller at once: the thread is about to run
            self._hold.notify_all()

    @property
    def held(self) -> bool:
        return self._held

    def set_steps_idle(self, idle: bool) -> None:
        """Whether the steps have nothing to run: the encoder then takes every core."""
        self.steps_idle = idle

    # -- in the encoder thread ----------------------------------------------------------------

    def adapt_threads(self, *_: object) -> None:
        """Every core while the steps have nothing to run, else the encoder's share (a
        forward pre-hook in the vision blocks; acts in the encoder thread only)."""
        if self.device.type == "cpu" and threading.current_thread().name.startswith(_NAME):
            self._park_while_held()
            wanted = self.all_threads if self.steps_idle else self.num_threads
            if torch.get_num_threads() != wanted:
                torch.set_num_threads(wanted)

    def _park_while_held(self) -> None:
        with self._hold:
            while self._held:  # a hold asked again before this thread woke: still parked
                self.parked = True
                self._hold.wait()
            self.parked = False

    def _drain(self) -> None:
        """The worker thread: runs the queued calls; ends when none is left (on CUDA
        once closed)."""
        if self.device.type == "cpu":
            torch.get_num_threads()  # a thread's first read takes its count in; then set it
            torch.set_num_threads(self.num_threads)
        while True:
            with self._lock:
                while self._keep_alive and not self._queue and not self._closed:
                    self._queued.wait()
                if not self._queue:
                    self._worker = None
                    return
                future, pixels, grids = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            if self.device.type == "cpu":
                self._park_while_held()
            try:
                future.set_result(self._run(pixels, grids))
            except BaseException as error:  # the future carries it to the engine
                future.set_exception(error)

    def _run(self, pixels: list[torch.Tensor], grids: list[Grid]) -> torch.Tensor:
        with torch.inference_mode():  # thread-local, as the grad mode is
            if self._stream is None:
                return self._call(pixels, grids)
            with torch.cuda.stream(self._stream):
                embeddings = self._call(pixels, grids)
                done = torch.cuda.Event()
                done.record(self._stream)
            done.synchronize()
            embeddings.record_stream(torch.cuda.default_stream(self.device))
            return embeddings
