"""Turns a step plan into one forward pass: inputs, image embeddings, attention, sampling."""

from __future__ import annotations

import torch

from iris_serve.scheduler.attention import PagedAttention, SequenceChunk
from iris_serve.scheduler.batch_planner import ScheduledChunk, StepPlan
from iris_serve.scheduler.image_encoder import ImageEncoder
from iris_serve.scheduler.kv_cache import KVCache
from iris_serve.scheduler.sampling import Sampler, SamplingRow


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        dtype: torch.dtype,
        image_encoder: ImageEncoder,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()
        self.image_encoder = image_encoder

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Runs the step; returns one sampled token per chunk that completes its sequence."""
        chunks = plan.chunks
        token_ids = [t for c in chunks for t in c.request.token_ids(c.start, c.end)]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.cat([c.request.positions(c.start, c.end) for c in chunks], dim=1)

        embeddings = self.model.embed_tokens(input_ids)
        self.image_encoder.prepare(chunks)
        self._splice_images(embeddings, chunks)

        attention = PagedAttention(
            self.kv_cache,
            [SequenceChunk(c.request.pages, c.start, c.num_tokens) for c in chunks],
            self.device,
        )
        hidden = self.model(embeddings, positions.to(self.device), attention)

        sampling_chunks = [c for c in chunks if c.completes_sequence]
        self._drop_consumed_images(chunks)
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

    @staticmethod
    def _splice_images(embeddings: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
        row = 0
        for chunk in chunks:
            for index, image in enumerate(chunk.request.images):
                if not image.overlaps(chunk.start, chunk.end):
                    continue
                first = max(chunk.start, image.offset)
                last = min(chunk.end, image.end)
                source = chunk.request.image_embeddings[index]
                rows = slice(row + first - chunk.start, row + last - chunk.start)
                embeddings[rows] = source[first - image.offset : last - image.offset]
            row += chunk.num_tokens

    @staticmethod
    def _drop_consumed_images(chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            embeddings = chunk.request.image_embeddings
            for index in list(embeddings):
                if chunk.request.images[index].end <= chunk.end:
                    del embeddings[index]


def _last_row_indices(chunks: list[ScheduledChunk], sampling: list[ScheduledChunk]) -> list[int]:
    ends: dict[int, int] = {}
    row = 0
    for chunk in chunks:
        row += chunk.num_tokens
        ends[id(chunk)] = row - 1
    return [ends[id(c)] for c in sampling]
