"""On a CPU, the cores split between the engine's steps, the encoder thread and the
tokenizer workers decoding media (on CUDA nothing is split): one part of prefill pacing,
which `PrefillPacing` (pacing.py) drives once per step.

A step's OpenMP threads meet at a barrier after every parallel region, so a step that
asks for more threads than there are free cores waits at each region for a thread the
kernel has descheduled, and a decode step takes many times its own length. So the steps
never take a core that another part of the server is busy on: the encoder thread's share
while a tower call runs, and one core per tokenizer worker while it decodes and resizes a
request's media (the worker says so, `MediaWork`; `media_work` here).

Splitting suits decodes, not prefill: a decode step barely gains from a second core, but
a prefill token is several times slower with one thread alongside the tower (whose
activations evict the step's caches) than with every core alone. So when a step plans
prefill alongside a running tower call, the steps hold the encoder thread (`after_plan`)
and it parks before its next block part. Until it has, decodes go on alone and a step
without decodes takes a paced chunk (`lone_prefill_paced`); once it has, the steps
prefill on every core, and the first step that plans no prefill gives the tower its core
back. A hold lasts at most `MAX_HOLD_SECONDS` and the next one waits as long as it
lasted, so a stream of prefill never takes more than half of the tower's time.
"""

from __future__ import annotations

import os
import time

import torch

from ..encoder.thread import EncoderThread

MAX_HOLD_SECONDS = 1.0


class CoreSharing:
    def __init__(
        self, encoder: EncoderThread | None, device: torch.device, hold_for_prefill: bool = True
    ) -> None:
        """`encoder`: the engine's encoder thread (None under the `inline` placement);
        `hold_for_prefill`: whether prefill may park it (the engine asks so only when it
        paces prefill, which sizes the chunks while the steps wait for the cores).

        torch's thread count is per thread, but a thread that never read or used it takes
        the last one set by any thread: reading it here, on the engine's thread, pins the
        steps' own."""
        self.on_cpu = device.type == "cpu"
        self.encoder = encoder if self.on_cpu else None
        self.cpu_threads = torch.get_num_threads() if self.on_cpu else 0
        self.cores = usable_cores() if self.on_cpu else 0
        self.busy_workers: set[int] = set()  # tokenizer workers decoding media now
        self.hold_for_prefill = hold_for_prefill and self.encoder is not None
        self.holds = 0  # holds asked so far (the tests read it)
        self._hold_started = 0.0
        self._no_hold_until = 0.0

    def step_threads(self, encoding: bool) -> int:
        """The torch threads the next step runs with (0 on CUDA) while a vision-tower call
        is in flight (`encoding`) or not; also the latency budget's key, as a step's costs
        depend on it."""
        if not self.on_cpu:
            return 0
        encoder = self.encoder
        tower = 0 if encoder is None or not encoding or encoder.parked else encoder.num_threads
        free = self.cores - len(self.busy_workers)
        return max(1, min(self.cpu_threads, free) - tower)

    def media_work(self, worker_id: int, busy: bool) -> None:
        """Tokenizer worker `worker_id` starts or ends decoding media: while it does, the
        steps leave it a core."""
        if busy:
            self.busy_workers.add(worker_id)
        else:
            self.busy_workers.discard(worker_id)

    def begin_step(self, encoding: bool, now: float | None = None) -> int:
        """Ends a hold whose call is over or that has lasted `MAX_HOLD_SECONDS` (the next
        one then waits as long), and returns the threads the step plans with."""
        encoder = self.encoder
        if self.hold_for_prefill and encoder is not None and encoder.held:
            lasted = _now(now) - self._hold_started
            if not encoding or lasted >= MAX_HOLD_SECONDS:
                encoder.release()
                if encoding:
                    self._no_hold_until = self._hold_started + 2 * lasted
        return self.step_threads(encoding)

    @property
    def awaiting_park(self) -> bool:
        """A hold is asked and the encoder thread has not parked yet: a step's decodes go on
        alone, its prefill waits for the cores (or is paced, `lone_prefill_paced`)."""
        return self.encoder is not None and self.encoder.held and not self.encoder.parked

    def lone_prefill_paced(self, encoding: bool, now: float | None = None) -> bool:
        """Whether a step without decodes takes a paced chunk instead of all the prefill it can:
        the tower runs alongside it, and a hold could soon give the steps every core."""
        if not self.hold_for_prefill or not encoding:
            return False
        assert self.encoder is not None
        if self.encoder.parked:
            return False
        return self.encoder.held or _now(now) >= self._no_hold_until

    def after_plan(self, encoding: bool, prefill_tokens: int, now: float | None = None) -> int:
        """Holds the encoder thread when the planned step carries prefill alongside a running
        tower call; releases a parked one when a step plans none. Returns the threads the
        step runs with (the encoder's share back, once released)."""
        encoder = self.encoder
        if self.hold_for_prefill and encoder is not None:
            now = _now(now)
            if not encoder.held:
                if encoding and prefill_tokens and now >= self._no_hold_until:
                    encoder.hold()
                    self.holds += 1
                    self._hold_started = now
            elif encoder.parked and not prefill_tokens:
                encoder.release()
        return self.step_threads(encoding)

    def share(self, threads: int, idle: bool) -> None:
        """Sets the step's `threads`; with no step to run (`idle`), the encoder thread
        takes every core.

        More OpenMP threads than cores spin-wait on each other, so the steps and the
        encoder thread never ask for more between them. Setting the count is cheap."""
        if not self.on_cpu:
            return
        if self.encoder is not None:
            self.encoder.set_steps_idle(idle)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
