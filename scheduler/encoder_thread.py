"""The vision tower beside the decode loop: its calls run in a thread of their own.

A call through the vision tower takes seconds on a CPU and tens of milliseconds on a GPU;
made inside a step, it stalls every running stream for that long (the inline mode,
`--mm-encoder-inline`). Here the image encoder hands each batch of images to one
background thread and the steps go on; the planner schedules a chunk that overlaps an
image only once its embedding is ready (see image_encoder.py).

- On a CPU the cores are shared, never oversubscribed (more OpenMP threads than cores
  spin-wait on each other). torch's thread count is per calling thread: while the steps
  run, the encoder thread uses `--encoder-threads` of the cores and the steps the rest
  (`Engine._share_cores`); while the steps have nothing to run (every request waits for
  an image), the encoder takes every core. It looks before each part of each vision
  block (`adapt_threads`, a forward pre-hook on its attention, MLP and norms), so it
  follows the steps within a fraction of a block.
- On CUDA the thread launches on a stream of its own, so the device runs the tower
  concurrently with the steps' kernels; a call's result is handed over once its work
  has finished on the device (an event), and is marked as used by the main stream, so
  the caching allocator never recycles it under a step still reading it.

A submitted call owns its pixels: the caller's tensors (views of a worker's shared
memory, whose pin a finished or aborted request gives back at any time) are copied first.
Calls run one at a time, in submission order, so the tower's activations are those of one
call at the encoder budget, as inline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

Grid = tuple[int, int, int]
_NAME = "iris-encoder"
TowerCall = Callable[[Sequence[torch.Tensor], Sequence[Grid]], torch.Tensor]


class EncoderThread:
    def __init__(
        self, call: TowerCall, device: torch.device, num_threads: int, all_threads: int
    ) -> None:
        """`call(pixels, grids)`: the embeddings of the images (the patch maker and the
        vision tower); on a CPU, `num_threads`: torch's intra-op threads for it while the
        steps run, `all_threads` while they do not."""
        if num_threads < 1:
            raise ValueError(f"the encoder needs at least one thread, got {num_threads}")
        self._call = call
        self.device = device
        self.num_threads = num_threads
        self.all_threads = max(all_threads, num_threads)
        self.steps_idle = False  # set by the engine's loop; read here before each block
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, _NAME, initializer=self._start)

    def submit(self, pixels: Sequence[torch.Tensor], grids: Sequence[Grid]) -> Future:
        """Starts a call on copies of `pixels`; its future holds the embeddings."""
        owned = [image.clone() for image in pixels]
        return self._pool.submit(self._run, owned, list(grids))

    @staticmethod
    def wait_any(futures: Sequence[Future], timeout: float) -> None:
        """Returns once one of `futures` is done, or after `timeout` seconds."""
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        """Cancels the calls not started and lets the running one finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- in the encoder thread ----------------------------------------------------------------

    def adapt_threads(self, *_: object) -> None:
        """Every core while the steps have nothing to run, else the encoder's share (a
        forward pre-hook in the vision blocks; acts in the encoder thread only)."""
        if self.device.type == "cpu" and threading.current_thread().name.startswith(_NAME):
            torch.set_num_threads(self.all_threads if self.steps_idle else self.num_threads)

    def _start(self) -> None:
        if self.device.type == "cpu":
            torch.get_num_threads()  # a thread's first read takes its count in; then set it
            torch.set_num_threads(self.num_threads)

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
