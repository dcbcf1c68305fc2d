"""The `gaps` workload of `bench.serve_load`: a stream's inter-token gaps while new images
arrive and encode, the figure that says whether image work reaches the decode path.

One request streams (a short text prompt, greedy, `ignore_eos`). Once it has sent
`WARM_TOKENS` chunks, `images` requests, each with one new image, are sent at once, one
token asked back each; their bodies are built before the stream starts, so the client
spends no CPU on them in the window. The window runs from their sending to the last
one's answer, and every gap of the stream that overlaps it counts; then the stream is
cut. On a CPU the images' work (the workers' decoding and resizing, the vision tower,
the prefill of their tokens) shares the cores with the stream's decode steps.

Figures per round: the largest gap in the window, the median gap in it, the median gap
before it (the quiet decode step), the window's length and the image requests' TTFT.
A machine's hiccup (a VM's stolen time) lands in one round's largest gap: compare
servers on the median over rounds, which `bench.serve_load_report` shows beside the
mean.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.images import image_part

WARM_TOKENS = 32  # stream chunks before the images are sent
TAIL_SECONDS = 0.05  # the stream runs on this long after the window


@dataclass(frozen=True)
class GapsWorkload:
    name: str
    images: int  # requests sent at once, one new image each
    size: tuple[int, int]  # (width, height) of every image

    @property
    def num_prompts(self) -> int:
        """The requests a round counts as completed: the image requests."""
        return self.images

    def describe(self) -> str:
        width, height = self.size
        return (
            f"`{self.name}`: one greedy stream (`ignore_eos`); after its first {WARM_TOKENS} "
            f"chunks, {self.images} requests with one new {width}×{height} JPEG each are sent "
            "at once (1 token back each, bodies built beforehand); the stream's gaps that "
            "overlap the window from their sending to the last one's answer are its figures."
        )


def measure(w: GapsWorkload, base_url: str, model: str, seed: int) -> dict[str, Any]:
    """One round against the server at `base_url`: the summary metrics."""
    return asyncio.run(_round(w, base_url, model, seed))


async def _round(w: GapsWorkload, base_url: str, model: str, seed: int) -> dict[str, Any]:
    url = f"{base_url}/v1/chat/completions"
    headers = {"content-type": "application/json"}
    stream_body = _body(model, "Tell me a long story.", None, stream=True)  # cut after the window
    image_bodies = [
        _body(model, [{"type": "text", "text": "What is it?"}, image_part(*w.size, seed + i)], 1)
        for i in range(w.images)
    ]
    chunks: list[float] = []  # when each of the stream's chunks with output arrived
    warm, cut = asyncio.Event(), asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def stream() -> None:
            try:
                async with client.stream("POST", url, content=stream_body, headers=headers) as r:
                    if r.status_code != 200:
                        await r.aread()
                        raise RuntimeError(f"the stream got HTTP {r.status_code}: {r.text[:500]}")
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"content"' in line:
                            chunks.append(time.perf_counter())
                            if len(chunks) == WARM_TOKENS:
                                warm.set()
                            if cut.is_set():
                                return
            finally:
                warm.set()  # ended early or failed: the wait below gives up

        async def image(body: bytes) -> tuple[float, float]:
            sent = time.perf_counter()
            response = await client.post(url, content=body, headers=headers)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
            return sent, time.perf_counter()

        streaming = asyncio.create_task(stream())
        await warm.wait()
        if streaming.done():
            await streaming  # its error, if it failed
            raise RuntimeError(f"the stream ended after {len(chunks)} chunks")
        spans = await asyncio.gather(*(image(body) for body in image_bodies))
        await asyncio.sleep(TAIL_SECONDS)
        cut.set()
        await streaming
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    pairs = list(itertools.pairwise(chunks))
    during = [b - a for a, b in pairs if b > start and a < end]
    before = [b - a for a, b in pairs if b <= start]
    ttfts = [e - s for s, e in spans]
    return {
        "completed": len(spans),
        "total_input_tokens": 0,
        "total_output_tokens": len(spans),
        "max_gap_ms": 1e3 * max(during),
        "median_gap_ms": 1e3 * statistics.median(during),
        "quiet_gap_ms": 1e3 * statistics.median(before),
        "window_ms": 1e3 * (end - start),
        "mean_ttft_ms": 1e3 * statistics.fmean(ttfts),
    }


def _body(model: str, content: Any, max_tokens: int | None, stream: bool = False) -> bytes:
    """A greedy chat request; no `max_tokens`: as many as the context allows."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body |= {"stream": True, "ignore_eos": True}
    return json.dumps(body).encode()
