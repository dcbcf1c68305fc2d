"""A request's image parts: their uuids, and each one's pixels (or the client's
embeddings) pinned in the arena, with every client error named after its part.

Per image (`docs/design.md`, "Life of an image"): its bytes are keyed with the processor
settings (`image_key`); a processor-cache hit pins the cached pixels, a miss decodes and
resizes the image into a new entry, pinned. An `image_embeds` part's tensors, checked
(`image_embeds`), go into an anonymous entry, pinned. A part with data and a `uuid`
binds the uuid to what the image became; a later part with the uuid alone gets the
cached pixels, or, evicted since, goes to the scheduler without pixels (its embedding
cache must serve it) (`image_uuids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...ipc.messages import ShmPointer
from ...ipc.shm_arena import ArenaFull, ShmArena
from ..arena_wait import NoRoom
from ..chat import ImagePart
from ..config import WorkerConfig
from ..media.fetch import MediaError, decode_image
from ..prompt import Grid, ImageSize, PromptBuilder
from .embeds import embeds_key, read_embeds
from .key import image_key
from .processor_cache import CachedImage, ProcessorCache
from .uuids import Binding, ImageUuids


@dataclass(frozen=True)
class LoadedImage:
    """One image part ready for the engine."""

    key: bytes
    pointer: ShmPointer | None  # pinned once for the request; None: named by uuid, evicted
    grid: Grid
    num_tokens: int
    cached: bool = False  # the pixels came from the processor cache
    embeds: bool = False  # `pointer` holds the client's embeddings, not pixels


class ImageParts:
    """The images of the requests one worker handles, over its processor cache."""

    def __init__(
        self,
        config: WorkerConfig,
        builder: PromptBuilder,
        cache: ProcessorCache,
        arena: ShmArena,
    ) -> None:
        self.config = config
        self.builder = builder
        self.cache = cache
        self.arena = arena
        self.uuids: ImageUuids[Binding] = ImageUuids(config.max_image_uuids)
        self.images_processed = 0  # decoded and processed (cache misses, or all if disabled)

    def check_uuids(self, parts: Sequence[ImagePart], size: ImageSize) -> None:
        """Refuses a part named by a uuid this worker does not know, before any work
        (a uuid bound earlier in the same request counts as known)."""
        bound = {part.uuid for part in parts if part.has_data}
        for part in parts:
            if not part.has_data and part.uuid not in bound:
                assert part.uuid is not None  # `parse_messages` gives a part a URL or a uuid
                if self.uuids.recall(part.uuid, size) is None:
                    raise MediaError(
                        f"{part.where}: no image with uuid {part.uuid!r} is known (never sent, "
                        "forgotten, or sent with other min/max pixels): send it again with its "
                        "data and the same uuid",
                        part.where,
                    )

    def load(
        self, parts: Sequence[ImagePart], encoded: Sequence[bytes], size: ImageSize
    ) -> list[LoadedImage]:
        """The image of every part, pinned, in order; `encoded` holds the data of the parts
        with a URL. Those go first, so a uuid bound anywhere in the request names its new
        image everywhere in it. Raises holding nothing: `NoRoom` with the bytes these
        images need when the arena is full of pinned entries."""
        settings = self.builder.image_settings(size)
        data = iter(encoded)
        images: list[LoadedImage | None] = [None] * len(parts)
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
            self.release(held)
            raise NoRoom(needed) from e
        except BaseException:
            self.release([image for image in images if image is not None])
            raise
        return [image for image in images if image is not None]

    def release(self, images: Sequence[LoadedImage]) -> None:
        """Drop the pins of `images`."""
        for image in images:
            if image.pointer is not None:
                self.arena.release(image.pointer)

    def _image(self, data: bytes, size: ImageSize, settings: tuple, where: str) -> LoadedImage:
        """One image's pixels in the arena, pinned once: a cached entry or a new one."""
        key = image_key(data, settings)
        cached = self.cache.lookup(key)
        hit = cached is not None
        if cached is None:
            cached = self._process(key, data, size, where)
        return LoadedImage(key, cached.pointer, cached.grid, cached.num_tokens, hit)

    def _embeds(self, part: ImagePart) -> LoadedImage:
        """A part's embeddings, checked (`image_embeds`), in an anonymous arena entry pinned
        once: the scheduler copies them into its embedding cache and lets the entry go."""
        assert part.embeds is not None
        data, grid = part.embeds
        merge = self.builder.merge_size
        tensor, thw = read_embeds(data, grid, merge, self.config.max_image_bytes, part.where)
        key = embeds_key(tensor, thw, str(self.builder.model_dir))
        pointer = self.arena.put(None, tensor)
        return LoadedImage(key, pointer, thw, tensor.shape[0], embeds=True)

    def _recalled(self, uuid: str, size: ImageSize) -> LoadedImage:
        """The image a uuid is bound to (checked by `check_uuids`): its cached pixels,
        pinned, or none (the scheduler's embedding cache must serve it)."""
        binding = self.uuids.peek(uuid, size)
        assert binding is not None, "checked by check_uuids"
        cached = self.cache.lookup(binding.key)
        if cached is None:
            return LoadedImage(binding.key, None, binding.grid, binding.num_tokens)
        return LoadedImage(binding.key, cached.pointer, cached.grid, cached.num_tokens, True)

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
