"""The compute bound of a served-load workload: the same requests through the
in-process engine on the same cores, with no HTTP, no IPC and no second process."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.images import jpeg_bytes
from bench.load_client import Workload, noise_jpeg, random_text


@dataclass
class Bound:
    workload: str
    requests: int
    prompt_tokens: float  # per request
    output_tokens: float  # per request
    preprocess_s: float  # total: JPEG decode + PromptBuilder
    engine_s: float  # total: ViT + prefill + decode at the workload's concurrency

    @property
    def seconds(self) -> float:
        return self.preprocess_s + self.engine_s

    @property
    def request_throughput(self) -> float:
        return self.requests / self.seconds

    @property
    def output_throughput(self) -> float:
        return self.requests * self.output_tokens / self.seconds


def compute_bound(
    model_dir: Path, w: Workload, output_lens: Sequence[int], seed: int, image_source: str
) -> Bound:
    """The workload through the in-process engine: no HTTP, no IPC, no second process."""
    from iris_serve.ipc.messages import Sampling
    from iris_serve.scheduler import Engine, EngineConfig
    from iris_serve.tokenizer_worker import PromptBuilder, load_image

    builder = PromptBuilder(model_dir)
    rng = np.random.default_rng(seed)

    def request(i: int) -> tuple[str, bytes | None]:
        text = random_text(builder.tokenizer, rng, w.input_len)
        if not w.image:
            return text, None
        if image_source == "vllm":
            return text, noise_jpeg(*w.image, rng)
        return text, jpeg_bytes(*w.image, seed * 10_000 + i)

    def prepare(text: str, data: bytes | None):
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        images = []
        if data is not None:
            content.append({"type": "image"})
            images.append(load_image(data))
        return builder.build(builder.render_chat([{"role": "user", "content": content}]), images)

    # An earlier bound's engine is unreachable by now, but its reference cycles hold its
    # device memory until collected: on CUDA each engine takes its share of the GPU
    # (`--gpu-memory-utilization`), so a second beside an uncollected first runs out.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine = Engine(EngineConfig(model=str(model_dir)))
    try:
        warm = [request(-1 - i) for i in range(2)]  # distinct inputs: no cache hits later
        engine.generate([prepare(*r) for r in warm], Sampling(temperature=0.0, max_tokens=4))

        inputs = [request(i) for i in range(w.num_prompts)]  # generated outside the timings
        started = time.perf_counter()
        prompts = [prepare(*r) for r in inputs]
        preprocess_s = time.perf_counter() - started

        params = [
            Sampling(temperature=0.0, max_tokens=max(1, n), ignore_eos=True) for n in output_lens
        ]
        pending, in_flight = deque(range(len(prompts))), 0
        started = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and in_flight < w.concurrency:
                i = pending.popleft()
                engine.add_request(f"bound-{i}", prompts[i], params[i])
                in_flight += 1
            in_flight -= sum(out.finished for out in engine.step())
        engine_s = time.perf_counter() - started
    finally:
        engine.close()
    return Bound(
        w.name,
        len(prompts),
        statistics.mean(len(p.token_ids) for p in prompts),
        statistics.mean(p.max_tokens for p in params),
        preprocess_s,
        engine_s,
    )
