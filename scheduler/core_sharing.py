"""On a CPU, the cores split between the engine's steps and the encoder thread.

While the encoder thread runs a vision-tower call, a step runs with the cores it leaves
(`step_threads`); with no step to run, the encoder thread takes every core. On CUDA there
is nothing to split (the encoder works on a side stream)."""

from __future__ import annotations

import torch

from iris_serve.scheduler.encoder_thread import EncoderThread


class CoreSharing:
    def __init__(self, encoder: EncoderThread | None, device: torch.device) -> None:
        """`encoder`: the engine's encoder thread (None with `--mm-encoder-inline`).

        torch's thread count is per thread, but a thread that never read or used it takes
        the last one set by any thread: reading it here, on the engine's thread, pins the
        steps' own."""
        self.encoder = encoder if device.type == "cpu" else None
        self.cpu_threads = torch.get_num_threads() if device.type == "cpu" else 0

    def step_threads(self, encoding: bool) -> int:
        """The torch threads the next step runs with (0 on CUDA), `encoding`: whether a
        vision-tower call is in flight on the encoder thread. Also the step pacer's key:
        a step's costs depend on it."""
        if self.encoder is None or not encoding:
            return self.cpu_threads
        return max(1, self.cpu_threads - self.encoder.num_threads)

    def share(self, threads: int, idle: bool) -> None:
        """Sets the step's `threads`; with no step to run (`idle`), the encoder thread
        takes every core.

        More OpenMP threads than cores spin-wait on each other: on 2 cores, a decode step
        beside a vision-tower call took 47 ms median, 261 ms p99 with 2 step threads and
        1 encoder thread, against 24.5 / 33 ms with 1 + 1 (23 / 26 ms alone). Setting the
        count costs well under a microsecond."""
        if self.encoder is None:
            return
        self.encoder.steps_idle = idle
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
