"""`iris serve` flags. Names follow vLLM's where one exists."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20,
          "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip
GiB = 1 << 30
_CACHES = """\
Each tokenizer worker owns one shared-memory arena of --mm-processor-cache-gb GiB. It
carries the pixels of the images in flight to the scheduler and keeps, in the rest, the
processor cache: processed images by the hash of their bytes and processor settings,
least recently used evicted first when room is needed; an image in flight is never
evicted. A request goes to the worker most of its images were sent to before, so a
conversation or an agent's window of screenshots finds its earlier images there.
/dev/shm must hold tokenizer-workers x that size (the arenas are reserved at start-up).
The scheduler keeps vision-encoder outputs per image in the embedding cache and KV pages
in the prefix cache.
Flags without a default here keep the engine's (scheduler.config.EngineConfig)."""


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes."""
    try:
        return int(float(text))
    except ValueError:
        pass
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MB)")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_arena_bytes(text: str) -> int:
    """`--mm-shm-arena-bytes`: a positive size (see `parse_bytes`)."""
    size = parse_bytes(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(_ARENA_NOT_EMPTY)
    return size


def parse_arena_gib(text: str) -> int:
    """`--mm-processor-cache-gb`: GiB as a float, to bytes."""
    size = int(_non_negative(text) * GiB)
    if size <= 0:
        raise argparse.ArgumentTypeError(_ARENA_NOT_EMPTY)
    return size


def parse_cache_gib(text: str) -> int:
    """`--mm-embedding-cache-gb`: GiB as a float (0 allowed), to bytes."""
    return int(_non_negative(text) * GiB)


def parse_positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_ARENA_NOT_EMPTY = (
    "must be positive: the arena also carries the images in flight "
    "(--disable-mm-processor-cache turns the cache off)"
)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def parse_mm_limit(text: str) -> int:
    """`--limit-mm-per-prompt 4` or vLLM's JSON form `'{"image": 4}'`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a number or JSON object: {text!r}") from None
    if isinstance(value, dict):
        value = value.get("image", 0)
    if not isinstance(value, int) or value < 0:
        raise argparse.ArgumentTypeError(f"the image limit must be a non-negative int: {text!r}")
    return value


@dataclass(frozen=True)
class ServeArgs:
    model: str | None
    host: str
    port: int
    served_model_name: list[str] | None
    tokenizer_workers: int
    scheduler_threads: int | None
    device: str
    dtype: str
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_cache_memory: int
    gpu_memory_utilization: float
    limit_mm_per_prompt: int
    allowed_local_media_path: str | None
    allowed_media_domains: list[str] | None
    media_timeout: float
    mm_processor_cache_bytes: int  # per tokenizer worker: its arena's size
    disable_mm_processor_cache: bool
    mm_embedding_cache_bytes: int | None  # None: the engine's default
    disable_mm_embedding_cache: bool
    max_num_encoder_tokens: int | None
    mm_cache_granularity: str | None
    disable_chunked_mm_encoding: bool
    disable_prefix_caching: bool
    api_key: str | None
    log_level: str
    startup_timeout: float


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="iris serve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="OpenAI-compatible server. MODEL: a local folder or a hub id; "
        "without one, the built-in tiny Qwen2.5-VL checkpoint is generated and served.",
    )
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--tokenizer-workers", type=parse_positive_int, default=2)
    p.add_argument(
        "--scheduler-threads",
        type=parse_positive_int,
        default=None,
        help="torch CPU threads of the scheduler (default: every core it may run on)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), ...")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=1 << 30, help="bytes, CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--limit-mm-per-prompt", type=parse_mm_limit, default=16)
    p.add_argument("--allowed-local-media-path", default=None)
    p.add_argument("--allowed-media-domains", nargs="+", default=None)
    p.add_argument("--media-timeout", type=float, default=10.0, help="seconds per http fetch")
    caches = p.add_argument_group("multimodal and prefix caches", _CACHES)
    caches.add_argument(
        "--mm-processor-cache-gb",
        dest="mm_processor_cache_bytes",
        type=parse_arena_gib,
        default=GiB,
        metavar="GIB",
        help="size of each tokenizer worker's arena: images in flight plus the processor "
        "cache (default: 1)",
    )
    caches.add_argument(
        "--mm-shm-arena-bytes",
        dest="mm_processor_cache_bytes",
        type=parse_arena_bytes,
        default=argparse.SUPPRESS,
        metavar="SIZE",
        help="the same size in bytes (e.g. 512MiB); the later of the two flags wins",
    )
    caches.add_argument(
        "--disable-mm-processor-cache",
        action="store_true",
        help="decode and process every image; the arena only carries the images in flight",
    )
    caches.add_argument(
        "--mm-embedding-cache-gb",
        dest="mm_embedding_cache_bytes",
        type=parse_cache_gib,
        default=None,
        metavar="GIB",
        help="the scheduler's per-image embedding cache, LRU-bounded on the device (images "
        "of running requests stay, so it may briefly exceed the bound)",
    )
    caches.add_argument("--disable-mm-embedding-cache", action="store_true")
    caches.add_argument(
        "--max-num-encoder-tokens",
        type=parse_positive_int,
        default=None,
        help="image tokens (after merging) per vision-encoder call",
    )
    caches.add_argument(
        "--mm-cache-granularity",
        choices=("image", "request"),
        default=None,
        help="cache keys per image, or one over all of a request's images (a new image "
        "then invalidates them all; for comparison)",
    )
    caches.add_argument(
        "--disable-chunked-mm-encoding",
        action="store_true",
        help="encode every image of a request in its first prefill chunk",
    )
    caches.add_argument("--disable-prefix-caching", action="store_true")
    p.add_argument("--api-key", default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    return p


def parse_serve_args(argv: list[str]) -> ServeArgs:
    namespace = build_parser().parse_args(argv)
    if namespace.tokenizer_workers < 1:
        build_parser().error("--tokenizer-workers must be at least 1")
    return ServeArgs(**vars(namespace))
