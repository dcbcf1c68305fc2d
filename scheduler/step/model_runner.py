"""Turns a step plan and its image embeddings into one forward pass: inputs, attention,
sampling. A step is built in two halves so that tensor-parallel ranks can share the
second: `inputs` (rank 0: token ids, positions, attention chunks, the image rows and
their embeddings, and the device work the plan carries) and `forward` (every rank: that
device work, the model, then the logits of the rows that sample); rank 0 sends each
step's `StepInputs` to the other ranks between the two. The runner decides nothing: it
applies what the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ...ipc.messages import TokenLogprob
from ..attention import AttentionBackend, SequenceChunk
from ..encoder.manager import ChunkImages
from ..hybrid.linear_state import (
    LinearStates,
    LinearStepContext,
    SequenceStates,
)
from ..hybrid.state_slots import SlotOp
from ..kv.host_tier import HostCopy, HostMemory
from ..sampling.sampler import Sampler, SamplingRow, token_logprobs
from .batch_planner import ScheduledChunk, StepPlan
from .faults import RanksOutOfStep
from .request import Request, RequestResources

if TYPE_CHECKING:
    from ..models.qwen2_vl import Qwen2VLForCausalLM
    from .decode_graphs import DecodeGraphs


@dataclass
class StepInputs:
    """What one forward pass reads; the same on every tensor-parallel rank."""

    input_ids: torch.Tensor  # [N] int64, on the device
    positions: torch.Tensor  # [3, N] int64, on the device
    chunks: list[SequenceChunk]
    image_rows: list[tuple[int, int]]  # [start, end) rows that take image embeddings
    image_embeddings: torch.Tensor | None  # [sum of rows, H * (1 + L)], rows in order
    logit_rows: list[int]  # rows whose logits are computed (each completes a sequence)
    # the plan's device work (`StepPlan`): a hybrid model's chunk slots and slot clears
    # and copies, and the host tier's copies, which a rank given a `host_memory` makes
    # first (the other ranks; rank 0 made them as it planned)
    linear: list[SequenceStates] | None = None
    slot_ops: list[SlotOp] = field(default_factory=list)
    host_copies: list[HostCopy] = field(default_factory=list)
    # host copies of input_ids and positions (rank 0 sends them without a device read)
    host_input_ids: list[int] | None = None
    host_positions: torch.Tensor | None = None


@dataclass
class Sampled:
    """A step's sampled tokens, one per chunk that completes its sequence, and, where its
    request asked for them, their logprobs (None for the others)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]


class Followers(Protocol):
    """The other tensor-parallel ranks, as rank 0 sees them."""

    def send(self, plan: StepPlan, inputs: StepInputs) -> None: ...


class ModelRunner(RequestResources):
    def __init__(
        self,
        model: Qwen2VLForCausalLM,
        attention: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        followers: Followers | None = None,
        decode_graphs: DecodeGraphs | None = None,
        linear_states: LinearStates | None = None,
        host_memory: HostMemory | None = None,
    ) -> None:
        """`linear_states`: this rank's pool of a hybrid model's linear-attention state
        (None for the others). `host_memory`: where a rank other than 0 makes the host
        tier's copies the step carries (None on rank 0, whose tier made them)."""
        self.model = model
        self.linear_states = linear_states
        self.host_memory = host_memory
        self.decode_graphs = decode_graphs
        self.attention = attention
        self.device = device
        self.dtype = dtype
        self.followers = followers
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(self, plan: StepPlan, images: list[ChunkImages]) -> torch.Tensor | None:
        """Runs the step's forward on every rank, splicing in each chunk's `images` (parallel
        to `plan.chunks`); the logits of the chunks that complete their sequence, or None.
        Under tensor parallelism a failure after the other ranks were sent the step leaves
        them inside collectives rank 0 will never finish: it is raised as `RanksOutOfStep`,
        which stops the scheduler."""
        inputs = self.inputs(plan, images)
        if self.followers is None:
            return self.forward(inputs)
        self.followers.send(plan, inputs)
        try:
            return self.forward(inputs)
        except Exception as error:
            raise RanksOutOfStep(f"a tensor-parallel forward failed on rank 0: {error}") from error

    @torch.inference_mode()
    def sample(self, plan: StepPlan, logits: torch.Tensor | None) -> Sampled:
        """One sampled token per chunk that completes its sequence, from `run`'s logits."""
        if logits is None:
            return Sampled([], [])
        sampling_chunks = [c for c in plan.chunks if c.completes_sequence]
        rows = [
            SamplingRow(
                c.request.sampling,
                c.request.generator,
                c.request.suppressed_token_ids(),
                c.request.prompt_token_ids,
                c.request.output_token_ids,
                c.request.grammar,
                c.request.request_id,
            )
            for c in sampling_chunks
        ]
        # From the model's own logits, before the sampler biases or penalises them in place.
        raw = token_logprobs(logits, [row.params.logprobs for row in rows])
        tokens = self.sampler(logits, rows)
        return Sampled(tokens.tolist(), raw(tokens) if raw else [None] * len(rows))

    def release(self, request: Request) -> None:
        """Drops what the runner keeps for a request that has ended (its penalty state;
        a preemption keeps it: the request's outputs stay)."""
        self.sampler.release(request.request_id)

    def inputs(self, plan: StepPlan, images: list[ChunkImages]) -> StepInputs:
        chunks = plan.chunks
        token_ids = [t for c in chunks for t in c.request.token_ids(c.start, c.end)]
        positions = torch.cat([c.request.positions(c.start, c.end) for c in chunks], dim=1)
        image_rows, parts = _image_rows(chunks, images)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=positions.to(self.device),
            chunks=[
                SequenceChunk(
                    c.request.page_table.pages, c.request.page_table.runs, c.start, c.num_tokens
                )
                for c in chunks
            ],
            image_rows=image_rows,
            image_embeddings=torch.cat(parts) if parts else None,
            logit_rows=_last_row_indices(chunks),
            host_input_ids=token_ids,
            host_positions=positions,
            linear=plan.linear,
            slot_ops=plan.slot_ops,
            host_copies=plan.host_copies,
        )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The model over the step's tokens; fp32 logits `[len(logit_rows), vocab]`, or None
        when no row samples. A collective under tensor parallelism: every rank calls it.
        A pure decode step replays a CUDA graph where the rank captured them (every rank
        decides alike, from the same inputs). First the step's device work: the host
        tier's copies (a rank given `host_memory`), then the slot clears and copies."""
        if self.host_memory is not None and inputs.host_copies:
            self.host_memory.apply(inputs.host_copies)
        states = None if inputs.linear is None else self._linear_states(inputs)
        if self.decode_graphs is not None and self.decode_graphs.handles(inputs):
            return self.decode_graphs.run(inputs)
        embeddings = self.model.embed_tokens(inputs.input_ids)
        deepstack = self._splice_images(embeddings, inputs)
        attention = self.attention.prepare(inputs.chunks)
        if states is None:
            hidden = self.model(embeddings, inputs.positions, attention, deepstack)
        else:
            hidden = self.model(embeddings, inputs.positions, attention, deepstack, states=states)
        if not inputs.logit_rows:
            return None
        if inputs.logit_rows == list(range(hidden.shape[0])):  # a step of decodes: every row
            return self.model.compute_logits(hidden)
        rows = torch.tensor(inputs.logit_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])

    def _linear_states(self, inputs: StepInputs) -> LinearStepContext:
        """Applies the step's slot clears and copies, then names each chunk's slot."""
        pool = self.linear_states
        assert pool is not None and inputs.linear is not None, "a hybrid model has a pool"
        for op in inputs.slot_ops:
            if op.source is None:
                pool.clear(op.target)
            else:
                pool.copy(op.source, op.target)
        return LinearStepContext.of(pool, inputs.linear)

    def _splice_images(self, embeddings: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """Writes the image rows' main embeddings into `embeddings`; returns the step's
        DeepStack levels `[L, N, H]` (the same rows of every level, zeros elsewhere), or
        None when the model has none or no row is an image row."""
        source = inputs.image_embeddings
        if source is None:
            return None
        levels = self.model.deepstack_levels
        deepstack = embeddings.new_zeros(levels, *embeddings.shape) if levels else None
        main, extra = self.model.split_embeddings(source)
        offset = 0
        for start, end in inputs.image_rows:
            count = end - start
            embeddings[start:end] = main[offset : offset + count]
            if deepstack is not None:
                deepstack[:, start:end] = extra[:, offset : offset + count]
            offset += count
        return deepstack


def _image_rows(
    chunks: list[ScheduledChunk], images: list[ChunkImages]
) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """The flat rows each chunk's images cover, and the embedding rows that go there."""
    rows: list[tuple[int, int]] = []
    parts: list[torch.Tensor] = []
    row = 0
    for chunk, chunk_images in zip(chunks, images, strict=True):
        for image, source in chunk_images:
            first = max(chunk.start, image.offset)
            last = min(chunk.end, image.end)
            rows.append((row + first - chunk.start, row + last - chunk.start))
            parts.append(source[first - image.offset : last - image.offset])
        row += chunk.num_tokens
    return rows, parts


def _last_row_indices(chunks: list[ScheduledChunk]) -> list[int]:
    """The last row of each chunk that completes its sequence, in chunk order."""
    rows = []
    row = 0
    for chunk in chunks:
        row += chunk.num_tokens
        if chunk.completes_sequence:
            rows.append(row - 1)
    return rows
