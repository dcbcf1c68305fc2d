"""The tokenizer worker's logic, free of processes and sockets (tested in-process).

    TokenizeRequest → EngineRequest (token ids + one pinned arena pointer per image)
                      or RequestError (400 for the client's mistakes, 500)
                      or nothing yet: the arena is full of pinned entries, the request
                      waits for releases (`arena_wait`; `retry_waiting` answers it, or
                      `expire_waiting` with a 503 at its deadline)
    AbortRequest    → AbortEngineRequest (always; the scheduler ignores unknown ids),
                      and a waiting request is dropped
    ReleaseImages   → unpin

Per image: `docs/design.md`, "Life of an image" (bytes, key, processor cache, arena and
pin); a video is a run of temporal patches, each pinned like an image (`video_loader`).
Whatever fails, the pins this request took are dropped, so an error leaks no arena byte
(entries stay cached, unpinned).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from jinja2 import TemplateError

from ..ipc.messages import (
    AbortEngineRequest,
    AbortRequest,
    EngineRequest,
    ImageRef,
    ImageReport,
    ReleaseImages,
    RequestError,
    ServerToTokenizer,
    ShmPointer,
    TokenizeRequest,
    WorkerStats,
    pack_token_ids,
)
from ..ipc.shm_arena import ArenaFull, EntryTooLarge, ShmArena, StaleHandle
from ..ipc.shm_names import SHM_DIR, segment_name
from .arena_wait import WaitingRequests
from .chat import ChatError, ImagePart, VideoPart, parse_messages
from .config import WorkerConfig
from .image_embeds import embeds_key, read_embeds
from .image_key import image_key
from .image_uuids import Binding, ImageUuids
from .media import MediaError, MediaFetcher, decode_image
from .processor_cache import CachedImage, ProcessorCache
from .prompt import Grid, ImageSize, PromptBuilder, Replacement
from .video_loader import LoadedVideo, VideoLimits, VideoLoader
from .video_parts import VideoParts, video_options
from .video_rules import VideoOptions

logger = logging.getLogger("iris.tokenizer")

Reply = EngineRequest | AbortEngineRequest | RequestError


class BadRequest(ValueError):
    status = 400

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class _NoRoom(Exception):
    """The arena is full of pinned entries; the request, its pins dropped, needs at least
    `needed` bytes of it (its images so far and the one that found no room)."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


@dataclass(frozen=True)
class _Image:
    key: bytes
    pointer: ShmPointer | None  # pinned once for the request; None: named by uuid, evicted
    grid: Grid
    num_tokens: int
    cached: bool = False  # the pixels came from the processor cache
    embeds: bool = False  # `pointer` holds the client's embeddings, not pixels


class TokenizerWorker:
    def __init__(
        self,
        config: WorkerConfig,
        builder: PromptBuilder,
        arena: ShmArena,
        fetcher: MediaFetcher | None = None,
    ) -> None:
        self.config = config
        self.builder = builder
        self.arena = arena
        self.cache = ProcessorCache(
            arena,
            builder.num_image_tokens,
            builder.pixel_shape,
            enabled=config.enable_processor_cache,
        )
        self.fetcher = fetcher or MediaFetcher.from_config(config)
        self.uuids: ImageUuids[Binding] = ImageUuids(config.max_image_uuids)
        self.videos: VideoParts | None = None  # None: the model takes no video
        if builder.video_settings is not None:
            limits = VideoLimits(
                config.max_video_frames, config.max_image_pixels, config.video_decode_threads
            )
            model = str(builder.model_dir.resolve())
            loader = VideoLoader(
                builder.video_settings,
                self.cache,
                arena,
                limits,
                model,
                pruning_rate=config.video_pruning_rate,
            )
            self.videos = VideoParts(loader, arena, config.max_image_uuids)
        self.waiting = WaitingRequests()
        self._room_freed = False  # pins were dropped since the waiting requests' last try
        self.requests_processed = 0
        self.images_processed = 0  # decoded and processed (cache misses, or all if disabled)

    @classmethod
    def open(cls, config: WorkerConfig) -> TokenizerWorker:
        """Load the tokenizer and processor and create the arena (replacing a stale one
        of the same name, left by a killed predecessor)."""
        builder = PromptBuilder(config.model_path, chat_template=config.chat_template)
        fetcher = MediaFetcher.from_config(config)
        name = segment_name(config.instance_id, config.worker_id)
        (SHM_DIR / name).unlink(missing_ok=True)
        arena = ShmArena(name, config.arena_bytes, worker_id=config.worker_id)
        return cls(config, builder, arena, fetcher)

    def close(self) -> None:
        """Stop fetching and remove the arena (its segment is unlinked)."""
        self.fetcher.close()
        self.arena.close()
        self.arena.unlink()

    # --- messages in -------------------------------------------------------------

    def handle(self, message: ServerToTokenizer) -> Reply | None:
        """The reply; None while the request waits for arena room (see `tokenize`)."""
        if isinstance(message, AbortRequest):
            self.waiting.remove(message.request_id)  # it holds no pins
            return AbortEngineRequest(message.request_id)
        return self.tokenize(message)

    def tokenize(self, request: TokenizeRequest) -> EngineRequest | RequestError | None:
        """The request's reply, or None when its images find the arena full of pinned
        entries: it then waits, holding nothing, up to `arena_wait_timeout_s` (0: a 503
        at once), and `retry_waiting` or `expire_waiting` answers it."""
        self.requests_processed += 1
        reply = self._attempt(request)
        if reply is not None:
            return reply
        timeout = self.config.arena_wait_timeout_s
        if timeout <= 0:
            return self._busy(request.request_id, "the image arena is full of images in flight")
        logger.info("request %s waits up to %g s for arena room", request.request_id, timeout)
        self.waiting.add(request, time.monotonic() + timeout)
        return None

    def retry_waiting(self) -> list[EngineRequest | RequestError]:
        """The replies of the waiting requests that can now be answered: tried oldest
        first, once pins were dropped since the last try, up to the first one that still
        finds no room (it and those behind it keep waiting)."""
        if not self._room_freed:
            return []
        self._room_freed = False
        replies: list[EngineRequest | RequestError] = []
        while (request := self.waiting.first()) is not None:
            reply = self._attempt(request)
            if reply is None:
                break
            self.waiting.remove(request.request_id)
            replies.append(reply)
        return replies

    def expire_waiting(self, now: float) -> list[RequestError]:
        """A 503 for every waiting request whose deadline is `now` or earlier."""
        timeout = self.config.arena_wait_timeout_s
        why = f"the image arena stayed full of images in flight for {timeout:g} s"
        return [self._busy(r.request_id, why) for r in self.waiting.expired(now)]

    def drop_waiting(self) -> list[RequestError]:
        """A 503 for every waiting request (the worker stops)."""
        why = "the tokenizer worker stopped while the request waited for image arena room"
        return [self._busy(r.request_id, why) for r in self.waiting.expired(math.inf)]

    def _busy(self, rid: str, why: str) -> RequestError:
        logger.warning("request %s: %s", rid, why)
        return RequestError(rid, 503, f"{why}: retry later", type="server_busy")

    def _attempt(self, request: TokenizeRequest) -> EngineRequest | RequestError | None:
        """One try at a request: its reply, or None when it should wait for arena room."""
        rid = request.request_id
        try:
            return self._tokenize(request)
        except (BadRequest, ChatError, MediaError) as e:
            return RequestError(rid, e.status, e.message, param=e.param)
        except EntryTooLarge as e:
            return RequestError(
                rid, 400, f"an image is too large for the arena: {e}", param="messages"
            )
        except _NoRoom as e:
            # Never fits: more than the whole arena, or nothing else holds it any more.
            if e.needed > self.arena.capacity_bytes or self.arena.num_pinned == 0:
                return RequestError(
                    rid,
                    400,
                    f"the images of this prompt need more than the {self.arena.capacity_bytes}"
                    "-byte image arena of a tokenizer worker: send fewer or smaller images, "
                    "or lower max_pixels",
                    param="messages",
                )
            return None
        except Exception as e:
            logger.exception("request %s failed", rid)
            return RequestError(
                rid,
                500,
                f"internal error in tokenizer worker {self.config.worker_id}: "
                f"{type(e).__name__}: {e}",
                type="server_error",
                param=None,
            )

    def release(self, message: ReleaseImages) -> None:
        for handle in message.handles:
            try:
                self.arena.release(handle)
                self._room_freed = True
            except StaleHandle as e:
                logger.warning("ignored a release: %s", e)

    def unpin(self, request: EngineRequest) -> None:
        """Drop the pins of a request that never reached the scheduler."""
        for image in request.images:
            if image.pixels is not None:
                self.arena.release(image.pixels)
                self._room_freed = True

    def stats(self) -> WorkerStats:
        return WorkerStats(
            worker_id=self.config.worker_id,
            arena_used_bytes=self.arena.usage_bytes,
            arena_capacity_bytes=self.arena.capacity_bytes,
            arena_pinned_entries=self.arena.num_pinned,
            requests_processed=self.requests_processed,
            images_processed=self.images_processed,
            processor_cache_hits=self.cache.hits,
            processor_cache_misses=self.cache.misses,
            image_uuid_hits=self.uuids.hits,
            image_uuid_misses=self.uuids.misses,
            image_uuids=len(self.uuids),
            arena_waiting_requests=len(self.waiting),
        )

    # --- one request -------------------------------------------------------------

    def _tokenize(self, request: TokenizeRequest) -> EngineRequest:
        size = self._image_size(request)
        parts: list[ImagePart] = []
        video_parts: list[VideoPart] = []
        if request.messages is not None:
            chat = parse_messages(request.messages)
            parts, video_parts = chat.images, chat.videos
            embeds = next((part for part in parts if part.is_embeds), None)
            if embeds is not None and not self.config.enable_mm_embeds:
                raise BadRequest(
                    f"{embeds.where}: image_embeds parts are off; the server takes them with "
                    "--enable-mm-embeds (for trusted clients)",
                    embeds.where,
                )
            self._check_limits(parts, video_parts)
            try:
                text = self.builder.render_chat(
                    chat.messages, request.tools, **(request.chat_template_kwargs or {})
                )
            except TemplateError as e:
                raise BadRequest(f"the chat template rejected the messages: {e}") from None
            ids = self.builder.encode(text)
            self._check_placeholders(ids, len(parts), len(video_parts), "messages")
            self._check_uuids(parts, size)
            options = video_options(request)
            if self.videos is not None:
                self.videos.check_uuids(video_parts, options)
            encoded = self.fetcher.fetch_all(chat.image_urls, chat.image_url_parts)
            encoded_videos = self.fetcher.fetch_all(
                chat.video_urls, chat.video_url_parts, video=True
            )
        else:
            assert request.prompt is not None
            ids = self._prompt_ids(request.prompt)
            encoded, encoded_videos, options = [], [], VideoOptions()
        images = self._images(parts, encoded, size)
        videos: list[LoadedVideo] = []
        try:
            if self.videos is not None:
                videos = self.videos.load(video_parts, encoded_videos, options)
            return self._engine_request(request, ids, parts, images, video_parts, videos)
        except ArenaFull as e:  # from the videos, which hold nothing; the images are held
            held = [i.pointer.nbytes for i in images if i.pointer is not None]
            self._unpin(images)
            raise _NoRoom(sum(map(self.arena.block_bytes, held)) + e.nbytes) from e
        except BaseException:
            self._unpin(images)
            if self.videos is not None:
                self.videos.release(videos)
            raise

    def _engine_request(
        self,
        request: TokenizeRequest,
        ids: list[int],
        parts: list[ImagePart],
        images: list[_Image],
        video_parts: list[VideoPart],
        videos: list[LoadedVideo],
    ) -> EngineRequest:
        """The placeholders expanded, and an `ImageRef` per image and per temporal patch of
        a video, in prompt order, with its report."""
        builder = self.builder
        image_tokens: list[Replacement] = [
            ([builder.image_token_id] * i.num_tokens, [(0, i.num_tokens)]) for i in images
        ]
        video_tokens = [
            builder.video_tokens(v.layout.token_counts, v.layout.timestamps) for v in videos
        ]
        token_ids, (image_spans, video_spans) = builder.splice(ids, image_tokens, video_tokens)
        items: list[tuple[ImageRef, ImageReport]] = []
        for part, image, spans in zip(parts, images, image_spans, strict=True):
            offset, length = spans[0]
            ref = ImageRef(image.key, offset, length, image.grid, image.pointer, image.embeds)
            cache = "processor" if image.cached else "none"
            items.append((ref, ImageReport(part.where, part.uuid, cache)))
        for part, video, spans in zip(video_parts, videos, video_spans, strict=True):
            assert self.videos is not None  # `_check_limits` refused videos otherwise
            report = ImageReport(part.where, part.uuid, "processor" if video.cached else "none")
            items += [(ref, report) for ref in self.videos.refs(video, spans)]
        items.sort(key=lambda item: item[0].offset)
        return EngineRequest(
            request.request_id,
            pack_token_ids(token_ids),
            request.sampling,
            [ref for ref, _ in items],
            [report for _, report in items],
        )

    def _check_limits(self, parts: list[ImagePart], video_parts: list[VideoPart]) -> None:
        for noun, given in (("image", parts), ("video", video_parts)):
            limit = self.config.mm_limit(noun)
            if len(given) > limit:
                raise BadRequest(
                    f"at most {limit} {noun}s per prompt, got {len(given)} (--limit-mm-per-prompt)"
                )
        if video_parts and self.videos is None:
            raise BadRequest(
                f"{video_parts[0].where}: this model takes no video", video_parts[0].where
            )

    def _image_size(self, request: TokenizeRequest) -> ImageSize:
        for name in ("min_pixels", "max_pixels"):
            value = getattr(request, name)
            if value is not None and value <= 0:
                raise BadRequest(f"{name} must be positive, got {value}", name)
        try:
            return self.builder.image_size(request.min_pixels, request.max_pixels)
        except ValueError as e:
            raise BadRequest(str(e), "min_pixels") from None

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.builder.encode(prompt, add_special_tokens=True)
        else:
            vocab = self.builder.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"token id {bad} is out of the vocabulary [0, {vocab})", "prompt")
            ids = list(prompt)
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        self._check_placeholders(ids, 0, 0, "prompt")
        return ids

    def _check_placeholders(
        self, ids: Sequence[int], num_images: int, num_videos: int, param: str
    ) -> None:
        builder = self.builder
        for noun, token, wanted in (
            ("image", builder.image_token_id, num_images),
            ("video", builder.video_token_id, num_videos),
        ):
            count = 0 if token is None else ids.count(token)
            if count != wanted:
                pad = builder.tokenizer.convert_ids_to_tokens(token)
                raise BadRequest(
                    f"the prompt has {count} {noun} placeholders for {wanted} {noun}s: "
                    f"the text must not contain {pad}",
                    param,
                )

    # --- images ------------------------------------------------------------------

    def _check_uuids(self, parts: list[ImagePart], size: ImageSize) -> None:
        """Refuses a part named by a uuid this worker does not know, before any work
        (a uuid bound earlier in the same request counts as known)."""
        bound = {part.uuid for part in parts if part.has_data}
        for part in parts:
            if not part.has_data and part.uuid not in bound:
                assert part.uuid is not None  # `parse_messages` gives a part a URL or a uuid
                if self.uuids.recall(part.uuid, size) is None:
                    raise BadRequest(
                        f"{part.where}: no image with uuid {part.uuid!r} is known (never sent, "
                        "forgotten, or sent with other min/max pixels): send it again with its "
                        "data and the same uuid",
                        part.where,
                    )

    def _images(
        self, parts: list[ImagePart], encoded: list[bytes], size: ImageSize
    ) -> list[_Image]:
        """The image of every part, in order; `encoded` holds the data of the parts with
        a URL. Those go first, so a uuid bound anywhere in the request names its new
        image everywhere in it."""
        settings = self.builder.image_settings(size)
        data = iter(encoded)
        images: list[_Image | None] = [None] * len(parts)
        try:
            for index, part in enumerate(parts):
                if part.embeds is not None:
                    image = self._embeds(part)
                elif part.url is not None:
                    image = self._image(next(data), size, settings, part.where)
                else:
                    continue
                images[index] = image
                if part.uuid is not None:
                    binding = Binding(image.key, image.grid, image.num_tokens)
                    self.uuids.bind(part.uuid, size, binding)
            for index, part in enumerate(parts):
                if not part.has_data:
                    assert part.uuid is not None  # `parse_messages` gives it a URL or a uuid
                    images[index] = self._recalled(part.uuid, size)
        except ArenaFull as e:
            held = [image for image in images if image is not None]
            sizes = {i.pointer.offset: i.pointer.nbytes for i in held if i.pointer is not None}
            needed = sum(map(self.arena.block_bytes, [*sizes.values(), e.nbytes]))
            self._unpin(held)
            raise _NoRoom(needed) from e
        except BaseException:
            self._unpin([image for image in images if image is not None])
            raise
        return [image for image in images if image is not None]

    def _image(self, data: bytes, size: ImageSize, settings: tuple, where: str) -> _Image:
        """One image's pixels in the arena, pinned once: a cached entry or a new one."""
        key = image_key(data, settings)
        cached = self.cache.lookup(key)
        hit = cached is not None
        if cached is None:
            cached = self._process(key, data, size, where)
        return _Image(key, cached.pointer, cached.grid, cached.num_tokens, hit)

    def _embeds(self, part: ImagePart) -> _Image:
        """A part's embeddings, checked (`image_embeds`), in an anonymous arena entry pinned
        once: the scheduler copies them into its embedding cache and lets the entry go."""
        assert part.embeds is not None
        data, grid = part.embeds
        merge = self.builder.merge_size
        tensor, thw = read_embeds(data, grid, merge, self.config.max_image_bytes, part.where)
        key = embeds_key(tensor, thw, str(self.builder.model_dir))
        pointer = self.arena.put(None, tensor)
        return _Image(key, pointer, thw, tensor.shape[0], embeds=True)

    def _recalled(self, uuid: str, size: ImageSize) -> _Image:
        """The image a uuid is bound to (checked by `_check_uuids`): its cached pixels,
        pinned, or none (the scheduler's embedding cache must serve it)."""
        binding = self.uuids.peek(uuid, size)
        assert binding is not None, "checked by _check_uuids"
        cached = self.cache.lookup(binding.key)
        if cached is None:
            return _Image(binding.key, None, binding.grid, binding.num_tokens)
        return _Image(binding.key, cached.pointer, cached.grid, cached.num_tokens, True)

    def _process(self, key: bytes, data: bytes, size: ImageSize, where: str) -> CachedImage:
        """Decode and resize one image into the cache (a miss); the scheduler normalises
        and patchifies it on the device."""
        try:
            image = decode_image(data, self.config.max_image_pixels)
            try:
                nbytes = self.builder.pixel_bytes(image.width, image.height, size)
            except ValueError as e:  # e.g. an aspect ratio over 200
                raise MediaError(str(e)) from None
            if nbytes > self.arena.capacity_bytes:
                raise MediaError(
                    f"its resized pixels need {nbytes} bytes, more than the "
                    f"{self.arena.capacity_bytes}-byte image arena; lower max_pixels"
                )
        except MediaError as e:
            raise MediaError(f"{where}: {e.message}", where) from None
        pixels, grid = self.builder.resize_image(image, size)
        self.images_processed += 1
        return self.cache.store(key, pixels, grid)

    def _unpin(self, images: list[_Image]) -> None:
        for image in images:
            if image.pointer is not None:
                self.arena.release(image.pointer)


def drop_aborted(messages: list[ServerToTokenizer]) -> list[ServerToTokenizer]:
    """Skip the TokenizeRequests that an AbortRequest later in the same batch cancels (the
    AbortRequests stay: they are forwarded whether or not the request was)."""
    aborted = {m.request_id for m in messages if isinstance(m, AbortRequest)}
    return [m for m in messages if isinstance(m, AbortRequest) or m.request_id not in aborted]
