"""Turns a step plan into one forward pass: inputs, image embeddings, attention, sampling."""

from __future__ import annotations

import torch

from scheduler.attention import PagedAttention, SequenceChunk
from scheduler.batch_planner import ScheduledChunk, StepPlan
from scheduler.kv_cache import KVCache
from scheduler.request import Request
from scheduler.sampling import Sampler, SamplingRow


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()
        self.images_encoded = 0

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Runs the step; returns one sampled token per chunk that completes its sequence."""
        chunks = plan.chunks
        token_ids = [t for c in chunks for t in c.request.token_ids(c.start, c.end)]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.cat([c.request.positions(c.start, c.end) for c in chunks], dim=1)

        embeddings = self.model.embed_tokens(input_ids)
        self._encode_images(chunks)
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

    def _encode_images(self, chunks: list[ScheduledChunk]) -> None:
        """Encodes, in one vision-tower call, every image a chunk overlaps and lacks."""
        pending: list[tuple[Request, int]] = []
        for chunk in chunks:
            request = chunk.request
            for index, image in enumerate(request.images):
                if index not in request.image_embeddings and image.overlaps(chunk.start, chunk.end):
                    pending.append((request, index))
        if not pending:
            return
        images = [request.images[index] for request, index in pending]
        pixel_values = torch.cat([image.pixel_values for image in images])
        pixel_values = pixel_values.to(self.device, self.dtype)
        grid_thw = torch.tensor([image.grid_thw for image in images], device=self.device)
        embeddings = self.model.encode_images(pixel_values, grid_thw)
        for (request, index), part in zip(
            pending, embeddings.split([image.length for image in images]), strict=True
        ):
            request.image_embeddings[index] = part
        self.images_encoded += len(images)

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
