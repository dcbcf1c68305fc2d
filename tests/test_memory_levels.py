"""Memory that levels off (issue 47, item 4): every cache of a server reaches its bound
and holds it, and once they all have, no process's memory goes on growing.

One `iris serve` on the tiny checkpoint with every bound small: the KV cache (1 MiB: 128
pages) and the host tier under it (64 pages), the embedding cache, the processor cache
(the arena's cached pixels) and the uuid bindings.
Distinct images with prompts of varied length drive them all past their bounds; then
HELD_REQUESTS more must leave each process's resident memory where it was, within what
the allocator's own noise moves it. A leak of per-request state (a dict entry, a detokenizer,
a request's logprobs) would grow it by the same amount for every request of the second
half. Every prompt has a length of its own, as a server's prompts do: oneDNN compiles a
primitive per input shape, and its caches must hold their bound too.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from tests.server_harness import RunningServer, iris_server

FILL_REQUESTS = 160  # past every bound below (each request: a new image, 3-6 new pages), and past
# oneDNN's 128 primitives: every prompt has its own length, so a shape of its own
HELD_REQUESTS = 60  # after which no process may have grown
GROWTH_ALLOWED = 0.02  # of a process's RSS; the bar for the soak
NOISE_BYTES = 4 << 20  # what the allocator moves an idle process by
EMBEDDING_CACHE_GB = 0.0002  # ~50 of these images
PROCESSOR_CACHE_GB = 0.002
BOUNDS = (
    "--kv-cache-memory", "1MiB", "--kv-offload-gib", "0.0005",
    "--mm-embedding-cache-gb", str(EMBEDDING_CACHE_GB),
    "--mm-processor-cache-gb", str(PROCESSOR_CACHE_GB), "--max-image-uuids", "32",
)  # fmt: skip


def image_url(seed: int, size: int = 112) -> str:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).resize((size, size), Image.NEAREST).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(client: httpx.Client, server: RunningServer, model: str, index: int) -> None:
    content = [
        {"type": "image_url", "image_url": {"url": image_url(index)}, "uuid": f"image-{index}"},
        {"type": "text", "text": f"Image {index}: what is in it? " + "more " * index},
    ]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    response = client.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


def process_tree(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        children += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return [pid, *(p for child in children for p in process_tree(child))]


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) << 10


def test_every_cache_reaches_its_bound_and_memory_levels_off(
    qwen2_5_vl_tiny: Path, tmp_path: Path
) -> None:
    with (
        iris_server(qwen2_5_vl_tiny, *BOUNDS, tmp_path=tmp_path) as server,
        httpx.Client(timeout=120) as client,
    ):
        for index in range(FILL_REQUESTS):
            ask(client, server, str(qwen2_5_vl_tiny), index)
        metrics = server.metrics()
        full = {
            "host tier": metrics["iris_host_tier_usage_bytes"]
            / metrics["iris_host_tier_capacity_bytes"],
            "embedding cache": metrics["iris_mm_embedding_cache_usage_bytes"]
            / (EMBEDDING_CACHE_GB * (1 << 30)),
            "processor cache": metrics["iris_shm_arena_usage_bytes"]
            / (PROCESSOR_CACHE_GB * (1 << 30)),
        }
        # the host tier fills only with pages the full KV cache evicted
        assert all(share > 0.8 for share in full.values()), f"caches not full: {full}"
        pids = process_tree(server.process.pid)
        before = {pid: resident_bytes(pid) for pid in pids}
        for index in range(FILL_REQUESTS, FILL_REQUESTS + HELD_REQUESTS):
            ask(client, server, str(qwen2_5_vl_tiny), index)
        after = {pid: resident_bytes(pid) for pid in pids}
        grown = {
            pid: (after[pid] - before[pid]) >> 20
            for pid in pids
            if after[pid] - before[pid] > max(GROWTH_ALLOWED * before[pid], NOISE_BYTES)
        }
        assert not grown, f"MiB grown over {HELD_REQUESTS} requests with full caches: {grown}"
