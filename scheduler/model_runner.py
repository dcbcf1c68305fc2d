"""Turns a step plan and its image embeddings into one forward pass: inputs, attention,
sampling. The embeddings come ready from the image encoder (`Engine.step`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from iris_serve.scheduler.attention import AttentionBackend, SequenceChunk
from iris_serve.scheduler.batch_planner import ScheduledChunk, StepPlan
from iris_serve.scheduler.image_encoder import ChunkImages
from iris_serve.scheduler.sampling import Sampler, SamplingRow

if TYPE_CHECKING:
    from iris_serve.scheduler.models.qwen2_vl import Qwen2VLForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: Qwen2VLForCausalLM,
        attention: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.attention = attention
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, plan: StepPlan, images: list[ChunkImages]) -> list[int]:
        """Runs the step, splicing in each chunk's `images` (parallel to `plan.chunks`);
        returns one sampled token per chunk that completes its sequence."""
        chunks = plan.chunks
        token_ids = [t for c in chunks for t in c.request.token_ids(c.start, c.end)]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.cat([c.request.positions(c.start, c.end) for c in chunks], dim=1)

        embeddings = self.model.embed_tokens(input_ids)
        deepstack = self._splice_images(embeddings, chunks, images)

        attention = self.attention.prepare(
            [
                SequenceChunk(
                    c.request.page_table.pages, c.request.page_table.runs, c.start, c.num_tokens
                )
                for c in chunks
            ]
        )
        hidden = self.model(embeddings, positions.to(self.device), attention, deepstack)

        sampling_chunks = [c for c in chunks if c.completes_sequence]
        if not sampling_chunks:
            return []
        last_rows = torch.tensor(
            _last_row_indices(chunks, sampling_chunks), dtype=torch.long, device=self.device
        )
        logits = self.model.compute_logits(hidden[last_rows])
        rows = [
            SamplingRow(c.request.sampling, c.request.generator, c.request.suppressed_token_ids())
            for c in sampling_chunks
        ]
        return self.sampler(logits, rows).tolist()

    def _splice_images(
        self, embeddings: torch.Tensor, chunks: list[ScheduledChunk], images: list[ChunkImages]
    ) -> torch.Tensor | None:
        """Writes the rows of each image that its chunk covers into `embeddings`; returns the
        step's DeepStack levels `[L, N, H]` (the same rows of every level, zeros elsewhere),
        or None when the model has none or no chunk covers an image row."""
        levels = self.model.deepstack_levels
        deepstack = None
        if levels and any(images):
            deepstack = embeddings.new_zeros(levels, *embeddings.shape)
        row = 0
        for chunk, chunk_images in zip(chunks, images, strict=True):
            for image, source in chunk_images:
                first = max(chunk.start, image.offset)
                last = min(chunk.end, image.end)
                rows = slice(row + first - chunk.start, row + last - chunk.start)
                main, extra = self.model.split_embeddings(
                    source[first - image.offset : last - image.offset]
                )
                embeddings[rows] = main
                if deepstack is not None:
                    deepstack[:, rows] = extra
            row += chunk.num_tokens
        return deepstack


def _last_row_indices(chunks: list[ScheduledChunk], sampling: list[ScheduledChunk]) -> list[int]:
    ends: dict[int, int] = {}
    row = 0
    for chunk in chunks:
        row += chunk.num_tokens
        ends[id(chunk)] = row - 1
    return [ends[id(c)] for c in sampling]
