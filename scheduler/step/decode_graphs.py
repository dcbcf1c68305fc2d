"""CUDA graphs for decode steps: one graph per batch size of a ladder, captured at start-up,
replayed for every decode-only step.

A decode step is hundreds of small kernels whose launch gaps from Python cost more than
the kernels at small batches; a graph replays them in one launch. What a graph reads
stays at fixed addresses: token ids and M-RoPE positions in buffers here, the attention
metadata in the backend's `StaticDecode`, the logits in its own output. A step of `n`
decodes runs the graph of the smallest captured size `>= n`; the rows past `n` are
padding, whose KV is never written and whose logits are dropped.

Only pure decode steps replay (every chunk one token after a cached history, no image
rows); anything else, or a batch larger than the largest graph, runs eagerly, as does
everything under `--enforce-eager`. Sampling runs after the replay, never captured.

A hybrid model's linear layers read their sequences' state slots by index from a fixed
buffer too (`slot_ids`); padding rows point at the pool's scratch slot, its last, which
no request holds. Snapshots a decode step takes (a copy of a slot after its token) vary
from step to step, so they are copied after the replay, not recorded.

Capture (`CudaGraphCapture`) runs the step once on a side stream first, so Triton
compiles and cuBLAS picks its kernels outside the capture; graphs are captured largest
first into one memory pool, so the smaller ones reuse its blocks. CPU tests capture with
`EagerReplay`, which runs the same closure over the same fixed buffers.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

from ..attention import AttentionBackend, StaticDecode
from ..hybrid.linear_state import (
    LinearStates,
    LinearStepContext,
    SequenceStates,
)

if TYPE_CHECKING:
    from ..models.qwen2_vl import Qwen2VLForCausalLM
    from .model_runner import StepInputs

logger = logging.getLogger(__name__)
MAX_CAPTURE_SIZE = 512  # vLLM's cap: beyond it a graph saves little over the kernels' time


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder, 1, 2, 4, every 8 to 256, then every 16, ending at `max_num_seqs`
    (at most `MAX_CAPTURE_SIZE`) so that every batch the scheduler forms has a graph."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_CAPTURE_SIZE + 1, 16)]
    return [size for size in ladder if size < top] + [top]


@dataclass
class CapturedStep:
    """A recorded step: `replay()` reruns it, rewriting `output` in place."""

    output: torch.Tensor
    replay: Callable[[], None]


class Capture(Protocol):
    def __call__(self, step: Callable[[], torch.Tensor]) -> CapturedStep: ...


class CudaGraphCapture:
    """Records steps as CUDA graphs sharing one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []  # kept alive with their pool

    def __call__(self, step: Callable[[], torch.Tensor]) -> CapturedStep:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles and autotunes, never recorded
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        self.graphs.append(graph)
        return CapturedStep(output, graph.replay)


def eager_replay(step: Callable[[], torch.Tensor]) -> CapturedStep:
    """A stand-in for capture where there is no CUDA (tests): a replay reruns `step` on
    the same fixed buffers and copies its result into the first result's tensor."""
    output = step()

    def replay() -> None:
        output.copy_(step())

    return CapturedStep(output, replay)


class DecodeGraphs:
    """The captured decode steps of one rank and the fixed buffers they read."""

    def __init__(
        self,
        model: Qwen2VLForCausalLM,
        attention: StaticDecode,
        device: torch.device,
        max_num_seqs: int,
        capture: Capture,
        linear_states: LinearStates | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        self.sizes = capture_sizes(max_num_seqs)
        self.capture = capture
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(3, top, dtype=torch.long, device=device)
        self.linear_states = linear_states
        self.scratch_slot = -1 if linear_states is None else linear_states.num_slots - 1
        self.slot_ids = torch.full((top,), self.scratch_slot, dtype=torch.long, device=device)
        self.steps: dict[int, CapturedStep] = {}
        self.replays: Counter[int] = Counter()  # graph size -> steps it ran (tests, logs)

    @classmethod
    def build(
        cls,
        model: Qwen2VLForCausalLM,
        backend: AttentionBackend,
        device: torch.device,
        max_num_seqs: int,
        max_pages: int,
        capture: Capture,
        linear_states: LinearStates | None = None,
    ) -> DecodeGraphs | None:
        """Graphs captured for every size of the ladder, or None (logged) where the
        backend has no fixed-buffer decode. `linear_states`: a hybrid model's pool."""
        static = backend.static_decode(min(max_num_seqs, MAX_CAPTURE_SIZE), max_pages)
        if static is None:
            logger.info("decode runs eagerly: the %s backend has no CUDA-graph path", backend.name)
            return None
        graphs = cls(model, static, device, max_num_seqs, capture, linear_states)
        graphs.capture_all()
        return graphs

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        """Captures the ladder, largest first, logging progress: each graph runs a
        warm-up step, so on a large model this is seconds, not milliseconds."""
        started = time.monotonic()
        last_log = started
        logger.info("capturing CUDA graphs for decode at %d batch sizes", len(self.sizes))
        for done, size in enumerate(reversed(self.sizes), start=1):
            self.attention.fill([], size)
            self.steps[size] = self.capture(partial(self._step, size))
            if time.monotonic() - last_log > 5:
                last_log = time.monotonic()
                logger.info("captured %d of %d decode graphs", done, len(self.sizes))
        logger.info(
            "captured %d decode graphs (batch 1 to %d) in %.1f s",
            len(self.sizes),
            self.max_size,
            time.monotonic() - started,
        )

    def handles(self, inputs: StepInputs) -> bool:
        """Whether the step is a pure decode step a graph can run."""
        num_seqs = len(inputs.chunks)
        return (
            0 < num_seqs <= self.max_size
            and inputs.image_embeddings is None
            and len(inputs.logit_rows) == num_seqs
            and all(chunk.is_decode for chunk in inputs.chunks)
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's fp32 logits `[n, vocab]`, from the graph of the smallest size that
        holds its `n` sequences. A view of the graph's output: valid until the next run.
        A hybrid model's slot clears and copies (`inputs.slot_ops`) are the caller's, done
        before."""
        num_seqs = len(inputs.chunks)
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        # padding rows keep stale ids and positions: valid values, and rows never mix
        self.input_ids[:num_seqs].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:, :num_seqs].copy_(inputs.positions, non_blocking=True)
        self.attention.fill(inputs.chunks, size)
        if inputs.linear is not None:
            slots = [sequence.slot for sequence in inputs.linear]
            slots += [self.scratch_slot] * (size - num_seqs)
            self.slot_ids[:size].copy_(torch.tensor(slots), non_blocking=True)
        step = self.steps[size]
        step.replay()
        self.replays[size] += 1
        if inputs.linear is not None and self.linear_states is not None:
            for sequence in inputs.linear:
                for _, snapshot in sequence.captures:
                    self.linear_states.copy(sequence.slot, snapshot)
        return step.output[:num_seqs]

    def _step(self, size: int) -> torch.Tensor:
        """What a graph of `size` records: the model over the fixed buffers, every row's
        logits (the same as an eager step whose every row samples)."""
        embeddings = self.model.embed_tokens(self.input_ids[:size])
        attention = self.attention.context(size)
        positions = self.positions[:, :size]
        if self.linear_states is None:
            hidden = self.model(embeddings, positions, attention, None)
        else:
            padding = [SequenceStates(self.scratch_slot, 1)] * size  # read: `slot_ids`
            linear = LinearStepContext(self.linear_states, padding, self.slot_ids[:size])
            hidden = self.model(embeddings, positions, attention, None, states=linear)
        return self.model.compute_logits(hidden)
