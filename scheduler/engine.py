"""The in-process engine: add requests, step, read outputs.

One `step()` reads as the whole loop: plan the batch, run it, account the results.
The scheduler process (server issue) drives exactly this object from its socket loop.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from iris_serve.ipc.messages import (
    FinishReason,
    RequestOutput,
    Sampling,
    context_length_error,
)
from iris_serve.scheduler.batch_planner import BatchPlanner, StepPlan
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.embedding_cache import EmbeddingCache
from iris_serve.scheduler.image_encoder import ImageEncoder, request_scoped_keys
from iris_serve.scheduler.kv_cache import KVCache, KVLayout
from iris_serve.scheduler.model_runner import ModelRunner
from iris_serve.scheduler.models.mrope import mrope_positions
from iris_serve.scheduler.models.registry import load_model
from iris_serve.scheduler.prefix_cache import PrefixCache
from iris_serve.scheduler.request import EnginePrompt, ImageInput, Request
from iris_serve.scheduler.sampling import check_sampling

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        self.model = load_model(config.model, dtype=self.dtype, device=self.device)
        model_config = self.model.config
        self.eos_token_ids = frozenset(model_config.eos_token_ids)  # generate's rule

        layout = KVLayout(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            page_size=config.page_size,
            dtype=self.dtype,
        )
        num_pages = config.num_kv_pages or layout.pages_for_budget(self._kv_budget_bytes())
        self.kv_cache = KVCache(layout, num_pages, self.device)
        capacity = num_pages * config.page_size
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
            capacity,
        )
        if config.max_model_len and self.max_model_len < config.max_model_len:
            logger.warning(
                "max_model_len lowered from %d to %d: the KV cache holds %d tokens",
                config.max_model_len,
                self.max_model_len,
                capacity,
            )
        self.prefix_cache = (
            PrefixCache(self.kv_cache.pool, config.page_size)
            if config.enable_prefix_caching
            else None
        )
        self.planner = BatchPlanner(
            self.kv_cache.pool,
            config.page_size,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.prefix_cache,
        )
        self.embedding_cache = EmbeddingCache(
            config.mm_embedding_cache_bytes if config.enable_mm_embedding_cache else 0
        )
        self.image_encoder = ImageEncoder(
            self.model,
            self.embedding_cache,
            self.device,
            self.dtype,
            config.max_num_encoder_tokens,
            chunked=config.chunked_mm_encoding,
            shared=config.enable_mm_embedding_cache,
        )
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.device, self.dtype, self.image_encoder
        )
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()

    # -- the public surface -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: EnginePrompt,
        sampling: Sampling,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        check_sampling(sampling)
        if not prompt.token_ids:
            raise ValueError("the prompt is empty")
        # max_tokens is a cap here (a request stops at the context length), not a demand
        too_long = context_length_error(self.max_model_len, len(prompt.token_ids), 0)
        if too_long is not None:
            raise ValueError(too_long)
        vocab = self.model.config.vocab_size
        if max(prompt.token_ids) >= vocab or min(prompt.token_ids) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        positions, rope_delta = mrope_positions(
            len(prompt.token_ids),
            [(image.offset, image.length) for image in prompt.images],
            [image.grid_thw for image in prompt.images],
            self.model.config.spatial_merge_size,
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt.token_ids),
            sampling=sampling,
            images=self._own_images(prompt.images),
            eos_token_ids=self.eos_token_ids,
            prompt_positions=positions,
            rope_delta=rope_delta,
        )
        if sampling.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.requests[request_id] = request
        self.planner.add(request)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.planner.finish(request)
            request.finish_reason = "abort"
            self.embedding_cache.release(request_id)
            self.image_encoder.forget(request_id)  # the caller releases all its pins now

    @property
    def prefix_cache_hit_tokens(self) -> int:
        """Prompt tokens found in the prefix cache, summed over requests."""
        return self.prefix_cache.hit_tokens if self.prefix_cache is not None else 0

    # -- images: shared-memory pins and metrics -----------------------------------------

    def pop_pixels_done(self) -> list[tuple[str, int]]:
        """(request id, image index) of images whose pixels no step will read again: the
        request holds their embeddings until it ends. The owner of the shared-memory pins
        pops this after every step and releases those pins at once; each image is reported
        at most once (never for an image the request never needed, e.g. a prefix-cache hit,
        nor after an abort: those pins go with the request)."""
        return self.image_encoder.pop_pixels_done()

    def drain_encoder_seconds(self) -> list[float]:
        """Durations of the vision-tower calls since the previous drain."""
        return self.image_encoder.drain_seconds()

    @property
    def mm_embedding_cache_hits(self) -> int:
        """Images a request got without running the vision tower for them."""
        return self.embedding_cache.hits

    @property
    def mm_embedding_cache_misses(self) -> int:
        return self.embedding_cache.misses

    @property
    def mm_embedding_cache_usage_bytes(self) -> int:
        return self.embedding_cache.usage_bytes

    @property
    def images_encoded(self) -> int:
        """Images run through the vision tower."""
        return self.image_encoder.images_encoded

    def has_unfinished_requests(self) -> bool:
        return self.planner.has_work()

    def step(self) -> list[RequestOutput]:
        plan = self.planner.schedule()
        if not plan.chunks:
            return []
        sampled = self.runner.execute(plan)
        return self._account(plan, sampled)

    def generate(
        self, prompts: Sequence[EnginePrompt], sampling: Sampling | Sequence[Sampling]
    ) -> list[list[int]]:
        """Runs prompts to completion (all added at once) and returns their output ids."""
        params = [sampling] * len(prompts) if isinstance(sampling, Sampling) else sampling
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(request_id, prompt, p)
        outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
        for output in self.run_until_idle():
            outputs[output.request_id].extend(output.new_token_ids)
        self.pop_pixels_done()  # in process, nobody holds shared-memory pins
        return [outputs[request_id] for request_id in ids]

    def run_until_idle(self) -> Iterable[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()

    # -- internals ----------------------------------------------------------------------

    def _account(self, plan: StepPlan, sampled: list[int]) -> list[RequestOutput]:
        outputs = []
        tokens = iter(sampled)
        for chunk in plan.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.end
            if not chunk.completes_sequence:
                continue
            token = next(tokens)
            request.output_token_ids.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                request.finish_reason = reason
                self.planner.finish(request)
                self.embedding_cache.release(request.request_id)
                del self.requests[request.request_id]
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[token],
                    finished=reason is not None,
                    finish_reason=reason,
                    prompt_tokens=request.prompt_len,
                    cached_tokens=request.num_cached_tokens,
                    completion_tokens=len(request.output_token_ids),
                )
            )
        return outputs

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        sampling = request.sampling
        if len(request.output_token_ids) >= sampling.min_tokens:
            if token in sampling.stop_token_ids:
                return "stop"
            if token in self.eos_token_ids and not sampling.ignore_eos:
                return "stop"
        if len(request.output_token_ids) >= sampling.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _own_images(self, images: Sequence[ImageInput]) -> list[ImageInput]:
        """The request's own copies (it drops their pixels), re-keyed per request when
        the cache granularity is "request"."""
        if self.config.mm_cache_granularity == "request":
            keys = request_scoped_keys([image.key for image in images])
            return [replace(image, key=key) for image, key in zip(images, keys, strict=True)]
        return [replace(image) for image in images]

    def _kv_budget_bytes(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            activation_reserve = 2 << 30
            return int(total * self.config.gpu_memory_utilization) - used - activation_reserve
        return self.config.kv_cache_memory
