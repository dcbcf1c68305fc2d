"""`WorkerConfig`: everything a tokenizer worker process is started with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    """One tokenizer worker. Socket addresses and the arena name derive from these.

    `run_dir` holds the instance's ipc sockets; the arena is
    `ipc.shm_arena.segment_name(instance_id, worker_id)`. Media limits: local files only
    under `allowed_local_media_path` (disabled when None), http(s) hosts only from
    `allowed_media_domains` when set (exact host names), `media_timeout_s` per fetch,
    `max_image_bytes` per encoded image and `max_image_pixels` per decoded image (checked
    on the header, before decoding: the decompression-bomb limit).

    `arena_bytes` is the size of the worker's shared-memory arena, which holds the pixels
    of the images in flight and, in the rest, the processor cache (LRU, evicted only when
    room is needed; `processor_cache`): it bounds the cache in bytes. With
    `enable_processor_cache=False` nothing is kept: every image is decoded and processed,
    and its entry is freed when the scheduler releases it.
    """

    worker_id: int
    model_path: str
    run_dir: str
    instance_id: str
    arena_bytes: int = 1 << 30
    enable_processor_cache: bool = True
    limit_mm_per_prompt: int = 16
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    media_timeout_s: float = 10.0
    max_image_bytes: int = 32 << 20
    max_image_pixels: int = 8192 * 8192
    log_level: str = "INFO"

    @property
    def name(self) -> str:
        """The process name, also the name of its request socket."""
        return f"tokenizer-{self.worker_id}"
