"""How much prefill a step carries and on how many cores it runs: the engine's one
policy, handed to the batch planner (`PrefillPolicy`, batch_planner.py). It joins
`StepPacer` (step_pacer.py: the prefill a step with decodes may carry, from measured step
times) and `CoreSharing` (core_sharing.py: on a CPU under the `thread` placement, the
cores split between the steps and the encoder thread, which a step's prefill may hold;
while it waits for that the caps change).

The planner asks `caps()` as it starts planning a step and tells `planned(plan)` what it
planned (the policy then holds or releases the encoder thread and sets the step's
threads); the engine times the step's run in `timed(plan)`, which feeds the pacer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from ..encoder.thread import EncoderThread
from .batch_planner import UNCAPPED, PrefillCaps, StepPlan
from .core_sharing import CoreSharing
from .pacer import StepPacer

if TYPE_CHECKING:
    import torch

    from ..config import EngineConfig
    from ..encoder.manager import EncoderManager


class EncoderState(Protocol):
    """What the policy reads of the encoder manager."""

    @property
    def encoding(self) -> bool: ...  # calls in flight in the encoder thread

    @property
    def images_encoded(self) -> int: ...  # images run through the tower so far


class StepPolicy:
    def __init__(self, pacer: StepPacer | None, cores: CoreSharing, encoder: EncoderState) -> None:
        """`pacer`: None when prefill is not paced (the caps are then none)."""
        self.pacer = pacer
        self.cores = cores
        self.encoder = encoder
        self._encoding = False  # a tower call in flight as the step was planned
        self._threads = cores.step_threads(False)  # the planned step's torch threads

    @classmethod
    def build(
        cls, config: EngineConfig, device: torch.device, encoder: EncoderManager
    ) -> StepPolicy:
        """The engine's: paced by `max_itl_stretch` (resolved for `device`); the cores
        shared with the encoder thread, if there is one, on a CPU."""
        stretch = config.resolved_itl_stretch(device)
        pacer = StepPacer(stretch, config.page_size) if stretch else None
        thread = encoder.executor if isinstance(encoder.executor, EncoderThread) else None
        return cls(pacer, CoreSharing(thread, device, hold_for_prefill=pacer is not None), encoder)

    def caps(self) -> PrefillCaps:
        """Ends a hold of the encoder thread that is over; the pacer's cap for a step with
        decodes (none while the steps wait for the encoder to park), and for one without
        while the tower runs alongside it and a hold could soon give the steps every core."""
        self._encoding = self.encoder.encoding
        threads = self.cores.begin_step(self._encoding)
        if self.pacer is None:
            return UNCAPPED
        cap = self.pacer.cap(threads)
        return PrefillCaps(
            with_decodes=0 if self.cores.awaiting_park else cap,
            alone=cap if self.cores.lone_prefill_paced(self._encoding) else None,
        )

    def planned(self, plan: StepPlan) -> None:
        """Holds the encoder thread for the step's prefill (or releases it) and sets the
        threads the step runs with; with nothing to run, the encoder takes every core."""
        self._threads = self.cores.after_plan(self._encoding, plan.num_prefill_tokens)
        self.cores.share(self._threads, idle=not plan.chunks)

    @contextmanager
    def timed(self, plan: StepPlan) -> Iterator[None]:
        """Times the planned step's run for the pacer, unless it raised or ran the vision
        tower (inline placement), whose time says nothing of the step's own cost."""
        started, encoded = time.perf_counter(), self.encoder.images_encoded
        yield
        if self.pacer is not None and self.encoder.images_encoded == encoded:
            seconds = time.perf_counter() - started
            self.pacer.observe(plan.num_decodes, plan.num_prefill_tokens, seconds, self._threads)
