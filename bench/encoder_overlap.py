"""The vision encoder beside the steps against inside them, in process, and where the time
goes.

The closed loop of `bench.compute_bound` (one new image per request, a few requests in
flight, answers of a fixed length with EOS ignored, greedy) through two engines on the same
checkpoint, both resident, in alternating rounds with fresh images each round:

- `beside`: `--mm-encoder-beside` (the default on a CPU): the tower in a thread of its
  own, on CUDA on a stream of its own, on a CPU with its share of the cores and the
  step pacer;
- `inline`: `--mm-encoder-inline --max-itl-stretch 0` (the default on CUDA): the engine
  before issue 12.

Per variant: requests/s, TTFT and TPOT per request (from `add_request` to the step that
returned the first token, and from there to the last), and where the loop spent its time:
the steps' model calls (`ModelRunner.execute`: their count, share of the time, decodes per step),
the vision tower inside the steps (`EncoderManager.encode`; inline only), the waits of steps
with nothing to run while images encode, and the tower calls themselves (CUDA events on
CUDA, so a call slowed by the steps beside it shows as longer).

    python -m bench.encoder_overlap [--size small | --model DIR] [--device auto]
        [--requests 16] [--concurrency 4] [--rounds 2] [--image 1280x720] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bench.images import jpeg_bytes
from bench.load_client import random_text
from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_common_arguments,
    add_model_argument,
    markdown_table,
    write_result,
)
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.engine import Engine
from iris_serve.tokenizer_worker.prompt import PromptBuilder, load_image

VARIANTS = {
    "beside": {"mm_encoder_placement": "thread"},
    "inline": {"mm_encoder_placement": "inline", "max_itl_stretch": 0.0},
}


@dataclass
class Trace:
    """What one round's loop spent its time on (seconds are wall-clock in the loop)."""

    steps: int = 0
    step_s: float = 0.0
    decodes: int = 0
    decode_steps: int = 0
    inline_tower_s: float = 0.0
    idle_waits: int = 0
    idle_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    tower_calls_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


def traced(engine: Engine) -> list[Trace]:
    """Wraps the engine's model calls, in-step encodes and idle waits; they add to the
    returned holder's trace (`closed_loop` puts a fresh one in it per round)."""
    trace = [Trace()]
    runner, encoder = engine.runner, engine.encoder_manager
    execute, encode, wait = runner.execute, encoder.encode, encoder.wait

    def timed_execute(plan: Any, images: Any) -> Any:
        started = time.perf_counter()
        sampled = execute(plan, images)
        now = trace[0]
        now.step_s += time.perf_counter() - started
        now.steps += 1
        now.decodes += plan.num_decodes
        now.decode_steps += plan.num_decodes > 0
        return sampled

    def timed_encode(chunks: Any) -> Any:
        started = time.perf_counter()
        images = encode(chunks)
        trace[0].inline_tower_s += time.perf_counter() - started
        return images

    def timed_wait(timeout: float) -> None:
        started = time.perf_counter()
        wait(timeout)
        trace[0].idle_waits += 1
        trace[0].idle_s += time.perf_counter() - started

    runner.execute, encoder.encode, encoder.wait = timed_execute, timed_encode, timed_wait
    return trace


def closed_loop(
    engine: Engine, holder: list[Trace], prompts: list[Any], params: Sampling, concurrency: int
) -> Trace:
    trace = holder[0] = Trace()
    engine.tower.drain_seconds()
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    pending, in_flight = deque(enumerate(prompts)), 0
    tag = f"{id(trace):x}"
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, prompt = pending.popleft()
            request_id = f"{tag}-{i}"
            engine.add_request(request_id, prompt, params)
            added[request_id] = time.perf_counter()
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
                trace.ttft_s.append(now - added[out.request_id])
            if out.finished:
                in_flight -= 1
                tokens = out.completion_tokens
                if tokens > 1:
                    trace.tpot_s.append((now - first[out.request_id]) / (tokens - 1))
    trace.wall_s = time.perf_counter() - started
    trace.tower_calls_s = engine.tower.drain_seconds()
    return trace


def tower_alone_ms(engine: Engine, prompt: Any, reps: int) -> dict[str, float]:
    """The best of `reps` tower calls for the prompt's first image with no step running:
    in this thread, and through the encoder thread (whose submit copies the pixels first;
    on a CPU it runs on its share of the cores). A call beside the steps that takes far
    longer than these is slowed by the steps, not by running in a thread."""
    tower, executor = engine.tower, engine.encoder_executor
    pixels, grids = [prompt.pixels[0]], [prompt.prompt.images[0].grid_thw]
    device = engine.device

    def timed(call: Any) -> float:
        best = float("inf")
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
        return best * 1e3

    with torch.inference_mode():
        found = {"in the caller's thread": timed(lambda: tower(pixels, grids))}
    if executor.placement == "thread":
        found["through the encoder thread"] = timed(lambda: executor.submit(pixels, grids).result())
    tower.drain_seconds()  # not the closed loop's
    return found


def make_prompts(
    builder: PromptBuilder, n: int, seed: int, size: tuple[int, int], text_tokens: int
) -> list[Any]:
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        text = random_text(builder.tokenizer, rng, text_tokens)
        content = [{"type": "text", "text": text}, {"type": "image"}]
        image = load_image(jpeg_bytes(*size, seed * 10_000 + i))
        rendered = builder.render_chat([{"role": "user", "content": content}])
        prompts.append(builder.build(rendered, [image]))
    return prompts


def summary_row(name: str, traces: list[Trace], requests: int) -> list[object]:
    wall = sum(t.wall_s for t in traces)
    steps = sum(t.steps for t in traces)
    decode_steps = sum(t.decode_steps for t in traces) or 1
    ttft = [s for t in traces for s in t.ttft_s]
    tpot = [s for t in traces for s in t.tpot_s]
    calls = [s for t in traces for s in t.tower_calls_s]
    return [
        name,
        requests * len(traces) / wall,
        statistics.mean(ttft) * 1e3,
        statistics.median(ttft) * 1e3,
        statistics.mean(tpot) * 1e3,
        steps,
        sum(t.decodes for t in traces) / decode_steps,
        sum(t.step_s for t in traces) / wall,
        sum(t.inline_tower_s for t in traces) / wall,
        sum(t.idle_s for t in traces) / wall,
        sum(t.idle_waits for t in traces),
        len(calls),
        statistics.mean(calls) * 1e3 if calls else 0.0,
    ]


HEADER = [
    "variant", "req/s", "TTFT mean ms", "TTFT median ms", "TPOT mean ms", "steps",
    "decodes/step", "model calls (of wall)", "tower in steps (of wall)",
    "idle waits (of wall)", "idle waits", "tower calls", "tower call ms",
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, quick_help="a few small requests (smoke test)")
    add_arch_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--requests", type=int, default=16, help="per round and variant")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--image", default="1280x720", help="WIDTHxHEIGHT")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--text-tokens", type=int, default=200)
    parser.add_argument("--kv-pages", type=int, default=4096, help="per engine (both resident)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.rounds, args.image = 3, 2, 1, "224x168"
        args.output_tokens, args.text_tokens = 4, 16
    size = tuple(int(side) for side in args.image.split("x"))
    checkpoint = Checkpoint.of(args)
    model = str(checkpoint.model_dir)
    builder = PromptBuilder(model)
    engines, holders = {}, {}
    for name, overrides in VARIANTS.items():
        # Two engines in one process: each takes at most half of a GPU.
        config = EngineConfig(
            model=model,
            device=args.device,
            num_kv_pages=args.kv_pages,
            gpu_memory_utilization=0.45,
            **overrides,
        )
        engines[name] = Engine(config)
        holders[name] = traced(engines[name])
    params = Sampling(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    warm = make_prompts(builder, 2, 999, size, args.text_tokens)
    device = engines["beside"].device
    traces: dict[str, list[Trace]] = {name: [] for name in engines}
    try:
        for name, engine in engines.items():  # warm-up: images of its own
            closed_loop(engine, holders[name], warm, params, args.concurrency)
        alone = tower_alone_ms(engines["beside"], warm[0], reps=3)
        for round_ in range(args.rounds):
            prompts = make_prompts(builder, args.requests, 1000 + round_, size, args.text_tokens)
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:  # the same new images for both: each has its own caches
                trace = closed_loop(engines[name], holders[name], prompts, params, args.concurrency)
                traces[name].append(trace)
                rate = args.requests / trace.wall_s
                print(f"round {round_} {name}: {rate:.3f} req/s", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
        engines.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    rows = [summary_row(name, runs, args.requests) for name, runs in traces.items()]
    rates = {row[0]: row[1] for row in rows}
    ratios = ", ".join(
        f"{name} {rate / rates['inline']:.2f}" for name, rate in rates.items() if name != "inline"
    )
    body = (
        f"{checkpoint.sentence} Device {device}, {args.rounds} rounds of {args.requests} "
        f"requests per variant, {args.concurrency} in flight, each with {args.text_tokens} "
        f"random text tokens and one new {args.image} JPEG, {args.output_tokens} tokens back "
        f"(EOS ignored); both engines resident, rounds alternating. Requests/s ÷ "
        f"inline's: **{ratios}**.\n\n"
        + markdown_table(HEADER, rows)
        + "\n\nShares are of the loop's wall time; `tower call ms` is each call's own "
        "duration (on CUDA between events on the encoder's stream).\n\n"
        "One tower call for one such image with no step running (best of 3, ms): "
        + ", ".join(f"{where} {ms:.1f}" for where, ms in alone.items())
        + ".\n"
    )
    suffix = "_quick" if args.quick else ""
    write_result(
        f"encoder_overlap_{checkpoint.label}{suffix}",
        f"Encoder beside the steps vs inline, in process: {checkpoint.title}",
        body,
        args.out,
    )


if __name__ == "__main__":
    main()
