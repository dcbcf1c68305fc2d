"""`WorkerConfig`: everything a tokenizer worker process is started with.

`iris serve` derives its worker flags from the fields' `metadata` (the keys are those of
`scheduler.config`'s; `aliases` adds more flags for the same field, the later one given
wins); fields without a `flag` are set by the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_CACHES = "caches"  # the help section of the cache flags (`launch.args`)
# Per request, of each modality a `--limit-mm-per-prompt` leaves out: a video costs up to
# hundreds of frames' work, so fewer of them
DEFAULT_MM_LIMITS = {"image": 16, "video": 2}
_ARENA_NOT_EMPTY = (
    "must be positive: the arena also carries the images in flight "
    "(--disable-mm-processor-cache turns the cache off)"
)


def _flag(flag: str, help: str, **more: object) -> dict[str, object]:
    """A field's command-line flag, for its `metadata`."""
    return {"flag": flag, "help": help, **more}


@dataclass(frozen=True)
class WorkerConfig:
    """One tokenizer worker. Socket addresses and the arena name derive from these.

    `run_dir` holds the instance's ipc sockets; the arena is
    `ipc.shm_names.segment_name(instance_id, worker_id)`. Media limits: local files only
    under `allowed_local_media_path` (disabled when None), http(s) hosts only from
    `allowed_media_domains` when set (exact host names, trusted whatever their
    addresses), no loopback, private or other non-public address otherwise unless
    `allow_private_media_hosts` (`media_hosts`), `media_timeout_s` per fetch,
    `max_image_bytes` per encoded image and `max_image_pixels` per decoded image (checked
    on the header, before decoding: the decompression-bomb limit); for videos
    `max_video_bytes`, `max_image_pixels` per frame and `max_video_frames` in the file,
    also checked on the header.

    `arena_bytes` is the size of the worker's shared-memory arena, which holds the pixels
    of the images in flight and, in the rest, the processor cache (LRU, evicted only when
    room is needed; `processor_cache`): it bounds the cache in bytes. With
    `enable_processor_cache=False` nothing is kept: every image is decoded and processed,
    and its entry is freed when the scheduler releases it. A request whose images find
    the arena full of pinned entries waits up to `arena_wait_timeout_s` for releases
    (`arena_wait`).
    """

    worker_id: int
    model_path: str
    run_dir: str
    instance_id: str
    arena_bytes: int = field(
        default=1 << 30,
        metadata=_flag(
            "--mm-processor-cache-gb",
            "size of each tokenizer worker's arena: images in flight plus the processor cache",
            parse="gib",
            min=1,
            min_error=_ARENA_NOT_EMPTY,
            metavar="GIB",
            group=_CACHES,
            aliases=(
                _flag(
                    "--mm-shm-arena-bytes",
                    "the same size in bytes (e.g. 512MiB); the later of the two flags wins",
                    parse="size",
                    min=1,
                    min_error=_ARENA_NOT_EMPTY,
                    metavar="SIZE",
                ),
            ),
        ),
    )
    enable_processor_cache: bool = field(
        default=True,
        metadata=_flag(
            "--disable-mm-processor-cache",
            "decode and process every image; the arena only carries the images in flight",
            group=_CACHES,
        ),
    )
    arena_wait_timeout_s: float = field(
        default=30.0,
        metadata=_flag(
            "--mm-arena-wait-timeout",
            "seconds a request waits for room in a tokenizer worker's arena while requests "
            "in flight pin it all, before a 503 (0: the 503 at once)",
            min=0,
            metavar="SECONDS",
            group=_CACHES,
        ),
    )
    max_image_uuids: int = field(
        default=1 << 16,
        metadata=_flag(
            "--max-image-uuids",
            "client image uuids each tokenizer worker remembers (least recently used "
            "forgotten first; a forgotten uuid sent without data is a 400 asking for it)",
            min=0,
            group=_CACHES,
        ),
    )
    enable_mm_embeds: bool = field(
        default=False,
        metadata=_flag(
            "--enable-mm-embeds",
            "accept image_embeds content parts (precomputed vision-tower outputs; for "
            "trusted clients: the model reads them as they are)",
        ),
    )
    limit_mm_per_prompt: dict[str, int] = field(
        default_factory=dict,
        metadata=_flag(
            "--limit-mm-per-prompt",
            'images and videos per request: vLLM\'s JSON form \'{"image": 4, "video": 1}\' '
            f"(default: {DEFAULT_MM_LIMITS['image']} images, {DEFAULT_MM_LIMITS['video']} "
            "videos), or a number of images",
            parse="mm_limit",
        ),
    )
    allowed_local_media_path: str | None = field(
        default=None,
        metadata=_flag(
            "--allowed-local-media-path",
            "read local image files only under this folder (default: none are read)",
        ),
    )
    allowed_media_domains: tuple[str, ...] | None = field(
        default=None,
        metadata=_flag(
            "--allowed-media-domains",
            "fetch http(s) images only from these hosts (exact names; default: any host "
            "at a public address), at whatever addresses they resolve to",
        ),
    )
    allow_private_media_hosts: bool = field(
        default=False,
        metadata=_flag(
            "--allow-private-media-hosts",
            "fetch http(s) images from loopback, private, link-local and other non-public "
            "addresses too (default: refused, as a guard against requests reaching the "
            "server's own network)",
        ),
    )
    media_timeout_s: float = field(
        default=10.0, metadata=_flag("--media-timeout", "seconds per http(s) image fetch")
    )
    video_decode_threads: int = field(
        default=1,
        metadata=_flag(
            "--video-decode-threads",
            "FFmpeg threads decoding one video in a tokenizer worker (workers decode side by "
            "side: scale with --tokenizer-workers first)",
            min=1,
        ),
    )
    video_pruning_rate: float = field(
        default=0.0,
        metadata=_flag(
            "--video-pruning-rate",
            "EVS-style video token pruning: each temporal patch after a video's first keeps "
            "round(n * (1 - RATE)) of its n tokens, those that changed most since the patch "
            "before it, at their own positions (0: off)",
            parse="rate",
            metavar="RATE",
        ),
    )
    max_image_bytes: int = 32 << 20
    max_image_pixels: int = 8192 * 8192  # also per video frame
    max_video_bytes: int = 128 << 20
    # frames in a video file: every one up to the last sampled frame is decoded (10 min at 30 fps)
    max_video_frames: int = 18000
    log_level: str = "INFO"
    replica: int = 0  # the data-parallel replica whose scheduler gets this worker's requests
    chat_template: str | None = None  # replaces the tokenizer's (`iris serve --chat-template`)

    def mm_limit(self, modality: str) -> int:
        """How many parts of `modality` ("image" or "video") a request may have."""
        return self.limit_mm_per_prompt.get(modality, DEFAULT_MM_LIMITS[modality])

    @property
    def name(self) -> str:
        """The process name, also the name of its request socket."""
        return f"tokenizer-{self.worker_id}"
