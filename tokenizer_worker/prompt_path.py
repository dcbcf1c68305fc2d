"""One request's path to the engine: `TokenizeRequest` → `EngineRequest`.

Chat messages are checked (`chat`), rendered by the chat template and encoded; the media
URLs are fetched in parallel (`media`); the images and videos are pinned in the arena
(`image_parts`, `video_parts`); the placeholders are expanded to each one's tokens, and
every image and temporal patch of a video becomes an `ImageRef` at its span, in prompt
order. A plain prompt (text or token ids) takes no media, unless a cluster frontend
tokenized the chat itself and sends its media URLs beside the ids (`image_urls`,
`video_urls`). A request with media URLs is turned inside `media_work()`, which the
worker process uses to tell the scheduler that it takes a core meanwhile (`MediaWork`).
Client errors are raised (`BadRequest`, `ChatError`, `MediaError`, `EntryTooLarge`), and
a full arena raises `NoRoom`; whatever fails, the pins this request took are dropped
first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

from jinja2 import TemplateError

from ..ipc.codec import pack_token_ids
from ..ipc.messages import EngineRequest, ImageRef, ImageReport, TokenizeRequest
from ..ipc.shm_arena import ArenaFull, ShmArena
from .arena_wait import NoRoom
from .chat import Chat, ImagePart, VideoPart, parse_messages
from .config import WorkerConfig
from .images.parts import ImageParts, LoadedImage
from .media.fetch import MediaFetcher
from .prompt import ImageSize, PromptBuilder, Replacement
from .video.loader import LoadedVideo
from .video.parts import VideoParts, video_options

MediaWorkContext = Callable[[], AbstractContextManager[object]]  # entered around media work


class BadRequest(ValueError):
    """The request cannot be served as sent; it fails with `status`, naming `param`."""

    status = 400

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PromptPath:
    """Turns the requests of one worker into engine requests (`engine_request`)."""

    def __init__(
        self,
        config: WorkerConfig,
        builder: PromptBuilder,
        arena: ShmArena,
        fetcher: MediaFetcher,
        images: ImageParts,
        videos: VideoParts | None,
        media_work: MediaWorkContext = nullcontext,
    ) -> None:
        self.config = config
        self.builder = builder
        self.arena = arena
        self.fetcher = fetcher
        self.images = images
        self.videos = videos  # None: the model takes no video
        self.media_work = media_work

    def engine_request(self, request: TokenizeRequest) -> EngineRequest:
        """The request's prompt, its images and videos pinned once each (see the module)."""
        size = self._image_size(request)
        if request.messages is None:
            assert request.prompt is not None
            if request.image_urls or request.video_urls:
                with self.media_work():
                    return self._prompt_with_media(request, size)
            return self._expand(request, self._prompt_ids(request.prompt), [], [], [], [])
        chat = parse_messages(request.messages)
        # From here to the pinned pixels, the worker is busy: the notice goes out before
        # the template and the fetch, so the scheduler's steps have shed the core by the
        # time decoding starts.
        with self.media_work() if chat.image_urls or chat.video_urls else nullcontext():
            return self._chat_request(request, chat, size)

    def _chat_request(self, request: TokenizeRequest, chat: Chat, size: ImageSize) -> EngineRequest:
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
        image_fetch = (chat.image_urls, chat.image_url_parts)
        video_fetch = (chat.video_urls, chat.video_url_parts)
        return self._media_request(request, ids, parts, video_parts, image_fetch, video_fetch, size)

    def _prompt_with_media(self, request: TokenizeRequest, size: ImageSize) -> EngineRequest:
        """A token-id prompt that a cluster frontend templated, one placeholder per URL of
        `image_urls` and of `video_urls`: the media go the way of a chat's (media rules,
        keys, processor cache, arena), each named `image_url[i]` / `video_url[i]` in errors."""
        assert isinstance(request.prompt, list)
        urls, video_urls = request.image_urls or [], request.video_urls or []
        parts = [ImagePart(url, None, f"image_url[{i}]") for i, url in enumerate(urls)]
        video_parts = [VideoPart(url, None, f"video_url[{i}]") for i, url in enumerate(video_urls)]
        self._check_limits(parts, video_parts)
        ids = self._prompt_ids(request.prompt, len(parts), len(video_parts))
        image_fetch = (urls, [part.where for part in parts])
        video_fetch = (video_urls, [part.where for part in video_parts])
        return self._media_request(request, ids, parts, video_parts, image_fetch, video_fetch, size)

    def _media_request(
        self,
        request: TokenizeRequest,
        ids: list[int],
        parts: list[ImagePart],
        video_parts: list[VideoPart],
        image_fetch: tuple[list[str], list[str]],
        video_fetch: tuple[list[str], list[str]],
        size: ImageSize,
    ) -> EngineRequest:
        """The media fetched (`*_fetch`: their URLs and where each is), pinned and expanded
        into `ids`; whatever fails, this request's pins are dropped first."""
        self.images.check_uuids(parts, size)
        options = video_options(request)
        if self.videos is not None:
            self.videos.check_uuids(video_parts, options)
        encoded = self.fetcher.fetch_all(*image_fetch)
        encoded_videos = self.fetcher.fetch_all(*video_fetch, video=True)
        images = self.images.load(parts, encoded, size)
        videos: list[LoadedVideo] = []
        try:
            if self.videos is not None:
                videos = self.videos.load(video_parts, encoded_videos, options)
            return self._expand(request, ids, parts, images, video_parts, videos)
        except ArenaFull as e:  # from the videos, which hold nothing; the images are held
            held = [i.pointer.nbytes for i in images if i.pointer is not None]
            self.images.release(images)
            raise NoRoom(sum(map(self.arena.block_bytes, held)) + e.nbytes) from e
        except BaseException:
            self.images.release(images)
            if self.videos is not None:
                self.videos.release(videos)
            raise

    def _expand(
        self,
        request: TokenizeRequest,
        ids: list[int],
        parts: list[ImagePart],
        images: list[LoadedImage],
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
        expected = request.expected_prompt_len
        if expected is not None and len(token_ids) != expected:
            counts = ", ".join(str(image.num_tokens) for image in images)
            raise BadRequest(
                f"the prompt expands to {len(token_ids)} tokens here (images of {counts} "
                f"tokens) but to {expected} in the frontend's count: the frontend sizes "
                "images otherwise than this checkpoint's image processor (its "
                "preprocessor_config.json)",
                "messages",
            )
        hashes = request.image_routing_hashes or [None] * len(images)
        items: list[tuple[ImageRef, ImageReport]] = []
        for part, image, spans, routing in zip(parts, images, image_spans, hashes, strict=True):
            offset, length = spans[0]
            ref = ImageRef(
                image.key,
                offset,
                length,
                image.grid,
                image.pointer,
                image.embeds,
                routing_hash=routing,
            )
            cache = "processor" if image.cached else "none"
            items.append((ref, ImageReport(part.where, part.uuid, cache)))
        for video_part, video, spans in zip(video_parts, videos, video_spans, strict=True):
            assert self.videos is not None  # `_check_limits` refused videos otherwise
            cache = "processor" if video.cached else "none"
            report = ImageReport(video_part.where, video_part.uuid, cache)
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

    def _prompt_ids(
        self, prompt: str | list[int], num_images: int = 0, num_videos: int = 0
    ) -> list[int]:
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
        self._check_placeholders(ids, num_images, num_videos, "prompt")
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
