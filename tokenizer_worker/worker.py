"""The tokenizer worker's logic, free of processes and sockets (tested in-process).

    TokenizeRequest → EngineRequest (token ids + one pinned arena pointer per image)
                      or RequestError (400 for the client's mistakes, 500)
                      or nothing yet: the arena is full of pinned entries, the request
                      waits for releases (`arena_wait`; `retry_waiting` answers it, or
                      `expire_waiting` with a 503 at its deadline)
    AbortRequest    → AbortEngineRequest (always; the scheduler ignores unknown ids),
                      and a waiting request is dropped
    ReleaseImages   → unpin

The request's path to the engine is `prompt_path`; per image (`image_parts`):
`docs/design.md`, "Life of an image" (bytes, key, processor cache, arena and pin); a
video is a run of temporal patches, each pinned like an image (`video_parts`,
`video_loader`). Whatever fails, the pins this request took are dropped, so an error
leaks no arena byte (entries stay cached, unpinned).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from typing import TypeAlias

from ..ipc.messages import (
    AbortEngineRequest,
    AbortRequest,
    EngineRequest,
    ReleaseImages,
    RequestError,
    ServerToTokenizer,
    TokenizeRequest,
    WorkerStats,
)
from ..ipc.shm_arena import EntryTooLarge, ShmArena, StaleHandle
from ..ipc.shm_names import SHM_DIR, segment_name
from .arena_wait import NoRoom, WaitingRequests
from .chat import ChatError
from .config import WorkerConfig
from .images.parts import ImageParts
from .images.processor_cache import ProcessorCache
from .media.fetch import MediaError, MediaFetcher
from .prompt import PromptBuilder
from .prompt_path import BadRequest, MediaWorkContext, PromptPath
from .video.parts import VideoParts, open_video_parts

logger = logging.getLogger("iris.tokenizer")

Reply: TypeAlias = EngineRequest | AbortEngineRequest | RequestError


class TokenizerWorker:
    """One worker's owners, composed: the arena and its processor cache, the image and
    video parts over them, the prompt path through them, and the requests waiting for
    arena room. This class answers messages, maps failures to replies, takes the pins
    the scheduler gives back and counts what it did."""

    def __init__(
        self,
        config: WorkerConfig,
        builder: PromptBuilder,
        arena: ShmArena,
        fetcher: MediaFetcher | None = None,
        media_work: MediaWorkContext = nullcontext,
    ) -> None:
        """`media_work()`: entered while a request's fetched media is decoded and resized
        (`PromptPath`)."""
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
        self.images = ImageParts(config, builder, self.cache, arena)
        self.videos: VideoParts | None = open_video_parts(config, builder, self.cache, arena)
        self.prompts = PromptPath(
            config, builder, arena, self.fetcher, self.images, self.videos, media_work
        )
        self.waiting = WaitingRequests()
        self._room_freed = False  # pins were dropped since the waiting requests' last try
        self.requests_processed = 0

    @property
    def images_processed(self) -> int:
        """Images decoded and processed (cache misses, or all if the cache is off)."""
        return self.images.images_processed

    @classmethod
    def open(
        cls,
        config: WorkerConfig,
        media_work: MediaWorkContext = nullcontext,
    ) -> TokenizerWorker:
        """Load the tokenizer and processor and create the arena (replacing a stale one
        of the same name, left by a killed predecessor)."""
        builder = PromptBuilder(config.model_path, chat_template=config.chat_template)
        fetcher = MediaFetcher.from_config(config)
        name = segment_name(config.instance_id, config.worker_id)
        (SHM_DIR / name).unlink(missing_ok=True)
        arena = ShmArena(name, config.arena_bytes, worker_id=config.worker_id)
        return cls(config, builder, arena, fetcher, media_work)

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
            return self.prompts.engine_request(request)
        except (BadRequest, ChatError, MediaError) as e:
            return RequestError(rid, e.status, e.message, param=e.param)
        except EntryTooLarge as e:
            return RequestError(
                rid, 400, f"an image is too large for the arena: {e}", param="messages"
            )
        except NoRoom as e:
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
        """Drop the pins the scheduler gives back; the waiting requests may now fit."""
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
        """What each owner counts, as the server's metrics read it."""
        return WorkerStats(
            worker_id=self.config.worker_id,
            arena_used_bytes=self.arena.usage_bytes,
            arena_capacity_bytes=self.arena.capacity_bytes,
            arena_pinned_entries=self.arena.num_pinned,
            requests_processed=self.requests_processed,
            images_processed=self.images_processed,
            processor_cache_hits=self.cache.hits,
            processor_cache_misses=self.cache.misses,
            image_uuid_hits=self.images.uuids.hits,
            image_uuid_misses=self.images.uuids.misses,
            image_uuids=len(self.images.uuids),
            arena_waiting_requests=len(self.waiting),
        )


def drop_aborted(messages: list[ServerToTokenizer]) -> list[ServerToTokenizer]:
    """Skip the TokenizeRequests that an AbortRequest later in the same batch cancels (the
    AbortRequests stay: they are forwarded whether or not the request was)."""
    aborted = {m.request_id for m in messages if isinstance(m, AbortRequest)}
    return [m for m in messages if isinstance(m, AbortRequest) or m.request_id not in aborted]
