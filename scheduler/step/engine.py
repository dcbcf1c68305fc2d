"""The in-process engine: add requests, step, read outputs (`docs/design.md`, "The
engine's step").

The scheduler process drives exactly this object from its socket loop; `iris generate`,
the tests and the benchmarks call it directly. When encoding, the forward or sampling
raises, only the requests concerned fail (they come out of `pop_failed`) and the engine
goes on with the rest (see step_faults.py). A request ends in one place, `_finish`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence

import msgspec
import torch

from ...ipc.local import PromptInput
from ...ipc.messages import (
    EngineStats,
    FinishReason,
    ImageRef,
    ImageReport,
    RequestOutput,
    Sampling,
    context_length_error,
)
from ..config import EngineConfig
from ..device_state import DeviceState
from ..encoder.executor import Tower, encoder_executor
from ..encoder.given_images import hold_given_images
from ..encoder.manager import EncoderManager, request_scoped_keys
from ..encoder.patches import PatchMaker
from ..encoder.pixels import Pin, PixelStore
from ..kv.kv_events import KvEvent
from ..models.mrope import mrope_positions
from ..models.tensor_parallel import SINGLE, TPShard
from ..sampling.sampler import check_sampling, check_token_ids
from ..sampling.structured_output import Grammars
from .batch_planner import BatchPlanner, StepPlan
from .faults import (
    FailedRequest,
    client_message,
    is_isolatable,
    release_device_memory,
)
from .model_runner import Followers, ModelRunner, Sampled
from .pacing import PrefillPacing
from .request import Request, RequestResources
from .wiring import build_caches

logger = logging.getLogger(__name__)

# How long a step with nothing to run (every request waits for an image being encoded)
# waits for the encoder thread before returning, so callers do not spin.
ENCODE_WAIT_SECONDS = 0.01


class Engine:
    """`tp` and `followers`: under tensor parallelism the engine is rank 0, holding its
    shard of the model; it plans every step and sends the other ranks what to run."""

    def __init__(
        self,
        config: EngineConfig,
        tp: TPShard = SINGLE,
        followers: Followers | None = None,
        replica: int = 0,
    ) -> None:
        if config.tensor_parallel_size != tp.size:
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} needs a process group of "
                f"that size (`iris serve` starts one); this engine has {tp.size} rank(s)"
            )
        self.config = config
        if config.seed is not None:  # unseeded requests draw from torch's default generator
            torch.manual_seed(config.seed)
        self.replica = replica
        state = DeviceState.build(config, tp, replica)
        self.device, self.dtype, self.model = state.device, state.dtype, state.model
        self.kv_cache, self.attention = state.kv_cache, state.attention
        model_config = self.model.config
        self.eos_token_ids = frozenset(model_config.eos_token_ids)  # generate's rule
        self.grammars = Grammars(config.model, model_config.vocab_size, self.eos_token_ids)
        self.grammars.prepare_in_background()
        capacity = self.kv_cache.num_pages * config.page_size
        self.max_model_len = state.max_model_len
        if config.max_model_len and self.max_model_len < config.max_model_len:
            logger.warning(
                "max_model_len lowered from %d to %d: the KV cache holds %d tokens",
                config.max_model_len,
                self.max_model_len,
                capacity,
            )
        caches = build_caches(config, state, record_copies=followers is not None)
        self.host_tier, self.prefix_cache = caches.host_tier, caches.prefix_cache
        self.embedding_cache, self.state_slots = caches.embedding_cache, caches.state_slots
        self.kv_events = caches.kv_events
        self.pixels = PixelStore()
        self.patches = PatchMaker.from_checkpoint(config.model, self.device, self.dtype)
        self.tower = Tower(self.model, self.patches)
        self.encoder_executor = encoder_executor(
            config.resolved_mm_encoder_placement(self.device),
            self.tower,
            config.resolved_encoder_threads(),
        )
        self.encoder_manager = EncoderManager(
            config,
            self.embedding_cache,
            self.pixels,
            self.encoder_executor,
            self.patches.merge_size,
        )
        self.pacing = PrefillPacing.build(config, self.device, self.encoder_manager)
        self.planner = BatchPlanner(
            self.kv_cache.pool,
            config.page_size,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.prefix_cache,
            self.encoder_manager.ready_until,
            self.pacing,
            self.state_slots,  # admissions; each chunk's slot; slot clears and copies
            self.host_tier,  # the copies it made while planning, in the plan
        )
        self.runner = ModelRunner(  # applies what the plan says, decides nothing
            self.model,
            self.attention,
            self.device,
            self.dtype,
            followers,
            state.decode_graphs,
            state.linear_states,
        )
        # Every owner of per-request state, in the order `_finish` releases them (the
        # planner first: the pages it registers are what snapshots are keyed by).
        self._owners: tuple[RequestResources, ...] = (
            self.planner,  # KV pages, queues
            *(() if self.state_slots is None else (self.state_slots,)),  # linear-layer state
            self.encoder_manager,  # embedding-cache holds, embeddings in hand
            self.pixels,  # pixels and their shared-memory pins
            self.runner,  # sampler state (penalty rows)
        )
        self.requests: dict[str, Request] = {}
        self._failed: list[FailedRequest] = []
        self._generate_ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    # -- the public surface -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        sampling: Sampling,
        pins: Sequence[Pin | None] = (),
        reports: Sequence[ImageReport] = (),
    ) -> None:
        """Admits a prompt descriptor and its pixels; `pins` (one per image, None for an
        image without one) are released through `pop_released_pins` once its pixels are
        no longer needed. An image without pixels must have its embedding cached (else
        `given_images.RefusedImage`). `reports` (one per image of a chat request) come
        back, with the cache levels filled in, on the request's first output. On
        ValueError nothing was taken: the caller keeps its pins."""
        token_ids = prompt.token_ids
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        check_sampling(sampling)
        if not token_ids:
            raise ValueError("the prompt is empty")
        # max_tokens is a cap here (a request stops at the context length), not a demand
        too_long = context_length_error(self.max_model_len, len(token_ids), 0)
        if too_long is not None:
            raise ValueError(too_long)
        if reports and len(reports) != len(prompt.images):
            raise ValueError(f"{len(reports)} image reports for {len(prompt.images)} images")
        for image, pixels in zip(prompt.images, prompt.pixels, strict=True):
            if pixels is not None and not image.embeds:
                self.patches.check(pixels, image.grid_thw, image.frames)
        vocab = self.model.config.vocab_size
        if max(token_ids) >= vocab or min(token_ids) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        check_token_ids(sampling, vocab)
        positions, rope_delta = mrope_positions(
            len(token_ids),
            [(image.offset, image.length) for image in prompt.images],
            [image.grid_thw for image in prompt.images],
            self.model.config.spatial_merge_size,
            [(image.rope_time, image.continue_block) for image in prompt.images],
            [image.kept for image in prompt.images],
        )
        seed = sampling.seed
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling=sampling,
            images=self._own_images(prompt.images),
            eos_token_ids=self.eos_token_ids,
            image_reports=list(reports),
            prompt_positions=positions,
            rope_delta=rope_delta,
            generator=None if seed is None else torch.Generator(self.device).manual_seed(seed),
            grammar=None
            if sampling.structured is None
            else self.grammars.matcher(sampling.structured),
        )
        try:  # the client's embeddings, and the cached ones of images sent by uuid alone
            hold_given_images(request, prompt.pixels, self.encoder_manager, self.model)
        except ValueError:
            for owner in self._owners:  # nothing was admitted: not `_finish`
                owner.release(request)
            raise
        self.pixels.add(request_id, prompt.pixels, pins)
        for index, image in enumerate(prompt.images):
            if image.embeds:  # copied into the embedding cache: the arena entry can go
                self.pixels.drop(request_id, index)
        self.requests[request_id] = request
        self.planner.add(request)
        self._prompt_tokens += len(token_ids)

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, "abort")  # its pins wait in `pop_released_pins`

    def media_work(self, worker_id: int, busy: bool) -> None:
        """A tokenizer worker starts or ends decoding media (`MediaWork`): on a CPU the steps
        leave it a core meanwhile (`CoreSharing`)."""
        self.pacing.cores.media_work(worker_id, busy)

    def pop_released_pins(self) -> list[Pin]:
        """Shared-memory pins whose pixels no step will read again, each exactly once: an
        image's as soon as its request holds the embedding, the rest when the request
        finishes or is aborted. The scheduler process sends them back after every step."""
        return self.pixels.pop_released()

    def pop_failed(self) -> list[FailedRequest]:
        """Requests that a failed step ended since the previous call, each exactly once
        (see `step`). The scheduler process sends each to its client as an error."""
        failed, self._failed = self._failed, []
        return failed

    def drain_encoder_seconds(self) -> list[float]:
        """Durations of the vision-tower calls since the previous drain."""
        return self.tower.drain_seconds()

    def stats(self) -> EngineStats:
        """The engine's gauges and counters now, as the scheduler process sends them (the
        device's memory and the encoder timings are the process's to add); what each is
        on /metrics is its row in `ipc.stats`."""
        pool = self.kv_cache.pool
        cache = self.embedding_cache
        prefix = self.prefix_cache
        slots = self.state_slots
        host = self.host_tier
        return EngineStats(
            replica=self.replica,
            num_running=len(self.planner.running),
            num_waiting=len(self.planner.waiting),
            kv_pages_used=pool.num_pages - pool.num_free,
            kv_pages_total=pool.num_pages,
            pinned_images=self.pixels.num_pinned,
            num_preemptions=self.planner.num_preemptions,
            images_encoded=self.encoder_manager.images_encoded,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prefix_cache_hit_tokens=0 if prefix is None else prefix.hit_tokens,
            prefix_cache_query_tokens=0 if prefix is None else prefix.query_tokens,
            mm_embedding_cache_hits=cache.hits,
            mm_embedding_cache_misses=cache.misses,
            mm_embedding_cache_usage_bytes=cache.usage_bytes,
            linear_state_snapshot_queries=0 if slots is None else slots.snapshot_queries,
            linear_state_snapshot_hits=0 if slots is None else slots.snapshot_hits,
            linear_state_snapshots=0 if slots is None else slots.num_stored,
            linear_state_slots_held=0 if slots is None else slots.num_held,
            prefix_cache_host_hit_tokens=0 if prefix is None else prefix.host_hit_tokens,
            mm_embedding_cache_host_hits=cache.host_hits,
            host_tier_capacity_bytes=0 if host is None else host.capacity_bytes,
            host_tier_usage_bytes=0 if host is None else host.usage_bytes,
            host_tier_pages=0 if host is None else host.num_pages,
            host_tier_embeddings=0 if host is None else host.num_embeddings,
            host_tier_bytes_to_host=0 if host is None else host.bytes_to_host,
            host_tier_bytes_to_device=0 if host is None else host.bytes_to_device,
            host_tier_copy_seconds=0.0 if host is None else host.copy_seconds,
            host_tier_page_copies=0 if host is None else host.pages_spilled + host.pages_reloaded,
            host_tier_failed_reloads=0 if host is None else host.failed_reloads,
        )

    def has_unfinished_requests(self) -> bool:
        return self.planner.has_work()

    def take_kv_events(self) -> list[KvEvent]:
        """The KV events since the last call (none without `--kv-events-config`)."""
        return [] if self.kv_events is None else self.kv_events.take()

    def step(self) -> list[RequestOutput]:
        self._collect_images()  # the encoder thread's finished calls in, the next ones out
        plan = self.planner.schedule()  # within the prefill pacing's caps
        for request in plan.preempted:
            self._preempt(request)
        if not plan.chunks:
            self.encoder_manager.wait(ENCODE_WAIT_SECONDS)  # only images are being worked on
            return []
        started = time.perf_counter()
        sampled = self._run(plan)  # encode what the chunks overlap, forward, sample
        if sampled is None:  # it raised: the step's requests failed, the others go on
            return []
        return self._account(plan, sampled, time.perf_counter() - started)

    def generate(
        self, prompts: Sequence[PromptInput], sampling: Sampling | Sequence[Sampling]
    ) -> list[list[int]]:
        """Runs prompts to completion (all added at once) and returns their output ids."""
        params = [sampling] * len(prompts) if isinstance(sampling, Sampling) else sampling
        ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(request_id, prompt, p)
        outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
        for output in self.run_until_idle():
            outputs[output.request_id].extend(output.new_token_ids)
        failed = [failure for failure in self.pop_failed() if failure.request_id in outputs]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(ids)} prompts failed: {failed[0].message}")
        return [outputs[request_id] for request_id in ids]

    def run_until_idle(self) -> Iterable[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()

    def close(self) -> None:
        """Stops the encoder thread (a call already running finishes in the background)."""
        self.encoder_executor.close()

    # -- internals ----------------------------------------------------------------------

    def _account(self, plan: StepPlan, sampled: Sampled, seconds: float) -> list[RequestOutput]:
        """The step's outputs; `seconds` its wall time, counted to each request whose prompt
        it computed."""
        outputs = []
        tokens = iter(zip(sampled.tokens, sampled.logprobs, strict=True))
        for chunk in plan.chunks:
            request = chunk.request  # its progress was advanced when the step was planned
            if chunk.start < request.prompt_len:
                request.prefill_step_seconds += seconds
            if not chunk.completes_sequence:
                continue
            token, logprob = next(tokens)
            request.output_token_ids.append(token)
            self._generation_tokens += 1
            images = self._image_reports(request)  # before a finish releases its images
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[token],
                    logprobs=None if logprob is None else [logprob],
                    finished=reason is not None,
                    finish_reason=reason,
                    prompt_tokens=request.prompt_len,
                    cached_tokens=request.num_cached_tokens,
                    host_cached_tokens=None
                    if self.host_tier is None
                    else request.num_host_cached_tokens,
                    completion_tokens=len(request.output_token_ids),
                    images=images,
                    **(
                        self._first_token_times(request)
                        if len(request.output_token_ids) == 1
                        else {}
                    ),
                )
            )
        return outputs

    @staticmethod
    def _first_token_times(request: Request) -> dict[str, float | None]:
        """What a request's first output says of its time before it (`RequestOutput`)."""
        first_step = request.first_step_at
        return {
            "queue_seconds": request.queue_seconds,
            "prefill_seconds": None if first_step is None else time.monotonic() - first_step,
            "prefill_step_seconds": request.prefill_step_seconds,
        }

    def _collect_images(self) -> None:
        """Takes the encoder thread's finished calls (failing the requests of one that raised)
        and starts the next: running requests' images first, then the waiting ones', each from
        its first token not computed (or, waiting, not cached). Inline: nothing to do."""
        manager = self.encoder_manager
        failed: dict[str, tuple[Request, Exception]] = {}
        for request, error in manager.collect():
            if not isinstance(error, Exception) or not is_isolatable(error):
                raise error
            failed.setdefault(request.request_id, (request, error))
        for request, error in failed.values():
            logger.error("encoding an image of %s failed", request.request_id, exc_info=error)
            self._finish(request, "abort", error)
            if isinstance(error, torch.OutOfMemoryError):
                release_device_memory(self.device)
        planner = self.planner
        manager.prefetch(  # only requests with images: a prefix-cache match is not free
            itertools.chain(
                ((r, r.page_table.num_computed_tokens) for r in planner.running if r.images),
                ((r, planner.cached_prefix_tokens(r)) for r in planner.waiting if r.images),
            )
        )

    def _run(self, plan: StepPlan) -> Sampled | None:
        """Encodes the images the plan's chunks overlap, runs the forward (the snapshots it
        wrote are then kept) and samples; None when that raised an error the step's
        requests can fail alone with."""
        forward_began = False
        try:
            with self.pacing.timed(plan):
                images = self.encoder_manager.encode(plan.chunks)
                forward_began = True
                logits = self.runner.run(plan, images)
                if self.state_slots is not None:
                    self.state_slots.step_ran()
                return self.runner.sample(plan, logits)
        except Exception as error:
            if not is_isolatable(error):
                raise
            if not forward_began:  # no rank made the plan's device work: the next plan's
                self.planner.defer_device_work(plan)
            out_of_memory = self._fail_step(plan, error)
        if out_of_memory:  # now that the traceback, and the step's tensors it held, are gone
            release_device_memory(self.device)
        return None

    def _preempt(self, request: Request) -> None:
        """The planner preempted the request (its pages are back in the pool already)."""
        for owner in self._owners:
            owner.preempt(request)

    def _finish(
        self, request: Request, reason: FinishReason, error: Exception | None = None
    ) -> None:
        """Ends a request, however it ends: every owner lets go of what it holds for it (its pins
        wait in `pop_released_pins`); with an `error`, its client is told through `pop_failed`."""
        request.finish_reason = reason
        for owner in self._owners:
            owner.release(request)
        del self.requests[request.request_id]
        if error is not None:
            self._failed.append(FailedRequest(request.request_id, client_message(error)))

    def _image_reports(self, request: Request) -> list[ImageReport] | None:
        """On a chat request's first token (every image has been looked up by then), the
        deepest cache that served each image: its KV, its embedding, its pixels, or none."""
        if not request.image_reports or len(request.output_token_ids) != 1:
            return None
        hits = self.encoder_manager.embedding_hits(request.request_id)
        reports = []
        for index, (image, report) in enumerate(
            zip(request.images, request.image_reports, strict=True)
        ):
            if image.end <= request.num_cached_tokens:
                report = msgspec.structs.replace(report, cache="prefix")
            elif index in hits:
                report = msgspec.structs.replace(report, cache="embedding")
            reports.append(report)
        return reports

    def _fail_step(self, plan: StepPlan, error: Exception) -> bool:
        """Ends every request with a chunk in the failed step, as on an abort, with the
        error for its client; requests outside the step are left alone. Only what earlier
        steps computed may reach the prefix cache: the step's own KV was never (or only
        partly) written. Returns whether it was an OOM."""
        ids = [chunk.request.request_id for chunk in plan.chunks]
        logger.error(
            "a step failed; ending its %d requests (%s)", len(ids), ", ".join(ids), exc_info=error
        )
        for chunk in plan.chunks:
            for owner in self._owners:
                owner.rewind(chunk.request, chunk.start)
            self._finish(chunk.request, "abort", error)
        return isinstance(error, torch.OutOfMemoryError)

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        sampling = request.sampling
        if request.grammar is not None:
            # A complete grammar allows only EOS next, so a constrained request ends on
            # EOS as any other (the server never shows a "stop"'s last token), min_tokens
            # or not: nothing may follow a complete answer.
            if not request.grammar.accept(token):
                logger.warning(  # the mask allowed only what the grammar accepts: a bug
                    "request %s left its grammar: %s", request.request_id, request.grammar.error
                )
                return "abort"
            if token in self.eos_token_ids:
                return "stop"
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

    def _own_images(self, images: Sequence[ImageRef]) -> list[ImageRef]:
        """The request's image spans, re-keyed per request when the cache granularity is
        "request"."""
        if self.config.mm_cache_granularity == "request":
            keys = request_scoped_keys([image.key for image in images])
            return [
                msgspec.structs.replace(image, key=key)
                for image, key in zip(images, keys, strict=True)
            ]
        return list(images)
