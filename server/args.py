"""`iris serve` flags. Names follow vLLM's where one exists."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20,
          "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip


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
    mm_shm_arena_bytes: int
    api_key: str | None
    log_level: str
    startup_timeout: float


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="iris serve",
        description="OpenAI-compatible server. MODEL: a local folder or a hub id; "
        "without one, the built-in tiny Qwen2.5-VL checkpoint is generated and served.",
    )
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--tokenizer-workers", type=int, default=2)
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
    p.add_argument(
        "--mm-shm-arena-bytes", type=parse_bytes, default=1 << 30, help="per tokenizer worker"
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    return p


def parse_serve_args(argv: list[str]) -> ServeArgs:
    namespace = build_parser().parse_args(argv)
    if namespace.tokenizer_workers < 1:
        build_parser().error("--tokenizer-workers must be at least 1")
    return ServeArgs(**vars(namespace))
