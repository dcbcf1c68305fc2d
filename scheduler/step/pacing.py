"""Prefill pacing: how much prefill a step carries and on how many cores it runs, the one
policy the batch planner consults (`docs/design.md`, "The engine's step"). Two parts:

- `LatencyBudget` (latency_budget.py): the prefill a step with decodes may carry so each
  running stream's next token waits at most `--max-itl-stretch` decode steps, from
  measured step times;
- `CoreSharing` (core_sharing.py): on a CPU under the `thread` placement, the cores split
  between the steps and the encoder thread, which a step's prefill may hold (while it
  waits for that the caps change).

The planner asks `caps()` as it starts planning a step and tells `planned(plan)` what it
planned (the pacing then holds or releases the encoder thread and sets the step's
threads); the engine times the step's run in `timed(plan)`, which feeds the budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..encoder.thread import EncoderThread
from .core_sharing import CoreSharing
from .latency_budget import LatencyBudget

if TYPE_CHECKING:
    import torch

    from ..config import EngineConfig
    from ..encoder.manager import EncoderManager
    from .batch_planner import StepPlan


@dataclass(frozen=True)
class PrefillCaps:
    """Prefill tokens a step may carry (None: the whole token budget)."""

    with_decodes: int | None = None  # in a step that has decodes
    alone: int | None = None  # in a step that has none


UNCAPPED = PrefillCaps()


class EncoderState(Protocol):
    """What the pacing reads of the encoder manager."""

    @property
    def encoding(self) -> bool: ...  # calls in flight in the encoder thread

    @property
    def images_encoded(self) -> int: ...  # images run through the tower so far


class PrefillPacing:
    def __init__(
        self, latency: LatencyBudget | None, cores: CoreSharing, encoder: EncoderState
    ) -> None:
        """`latency`: None when prefill is not paced (the caps are then none)."""
        self.latency = latency
        self.cores = cores
        self.encoder = encoder
        self._encoding = False  # a tower call in flight as the step was planned
        self._threads = cores.step_threads(False)  # the planned step's torch threads

    @classmethod
    def build(
        cls, config: EngineConfig, device: torch.device, encoder: EncoderManager
    ) -> PrefillPacing:
        """The engine's: paced by `max_itl_stretch` (resolved for `device`); the cores
        shared with the encoder thread, if there is one, on a CPU."""
        stretch = config.resolved_itl_stretch(device)
        latency = LatencyBudget(stretch, config.page_size) if stretch else None
        thread = encoder.executor if isinstance(encoder.executor, EncoderThread) else None
        cores = CoreSharing(thread, device, hold_for_prefill=latency is not None)
        return cls(latency, cores, encoder)

    def caps(self) -> PrefillCaps:
        """Ends a hold of the encoder thread that is over; the latency budget's cap for a
        step with decodes (none while the steps wait for the encoder to park), and for one
        without while the tower runs alongside it and a hold could soon give the steps
        every core."""
        self._encoding = self.encoder.encoding
        threads = self.cores.begin_step(self._encoding)
        if self.latency is None:
            return UNCAPPED
        cap = self.latency.cap(threads)
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
        """Times the planned step's run for the latency budget, unless it raised or ran the
        vision tower (inline placement), whose time says nothing of the step's own cost."""
        started, encoded = time.perf_counter(), self.encoder.images_encoded
        yield
        if self.latency is not None and self.encoder.images_encoded == encoded:
            seconds = time.perf_counter() - started
            self.latency.observe(plan.num_decodes, plan.num_prefill_tokens, seconds, self._threads)
