"""Offline engine benchmark: prefill and decode tokens/s, ViT images/s (no HTTP, no IPC).

Runs the in-process engine on the generated `tiny` and `small` checkpoints of `--arch`
(Qwen2.5-VL by default) and compares variants side by side in one run:

- prefill: 4 text prompts at a step budget of 2048 tokens vs chunked at 256;
- decode: 8 concurrent requests (continuous batching) vs 1 request at a time;
- ViT: 4 images of 1280×720 encoded in one vision-tower call vs one call per image.

From the repo root:

    python -m bench.engine_offline --sizes tiny small [--arch ARCH] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from bench.results_io import (
    ARCH_TITLES,
    DEFAULT_ARCH,
    add_arch_argument,
    markdown_table,
    write_result,
)
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.engine import Engine
from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import make_image


def text_prompt(builder: PromptBuilder, num_tokens: int, seed: int) -> PromptInput:
    words = " ".join(f"word{(seed * 131 + i) % 997}" for i in range(num_tokens))
    ids = builder.tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
    return PromptInput.text(ids)


def timed_prefill(engine: Engine, prompts: list[PromptInput]) -> float:
    """Seconds to prefill all prompts (each samples one token)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, Sampling(temperature=0.0, max_tokens=1))
    started = time.perf_counter()
    for _ in engine.run_until_idle():
        pass
    return time.perf_counter() - started


def timed_decode(engine: Engine, prompts: list[PromptInput], new_tokens: int) -> float:
    """Seconds spent in decode-only steps once every prompt has been prefilled."""
    params = Sampling(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    engine.step()  # prefill of all prompts (the budget covers them)
    started = time.perf_counter()
    for _ in engine.run_until_idle():
        pass
    return time.perf_counter() - started


def best_seconds(run, repeats: int = 2) -> float:
    """Fastest of `repeats` timed runs after one warm-up run."""
    run()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return min(timings)


def bench_size(arch: str, size: str, quick: bool) -> list[list[object]]:
    model_dir = builtin_checkpoint(arch=arch, size=size)
    builder = PromptBuilder(model_dir)
    prompt_len = 128 if quick else 512
    new_tokens = 8 if quick else 32
    rows: list[list[object]] = []

    def engine(**overrides) -> Engine:
        """A fresh engine, warmed up so first-call costs stay out of the timings."""
        fresh = Engine(EngineConfig(model=str(model_dir), **overrides))
        fresh.generate([text_prompt(builder, 32, seed=99)], Sampling(max_tokens=4))
        return fresh

    prefill_prompts = [text_prompt(builder, prompt_len, seed) for seed in range(4)]
    tokens = sum(len(p.token_ids) for p in prefill_prompts)
    whole = tokens / timed_prefill(engine(max_num_batched_tokens=2048), prefill_prompts)
    chunked = tokens / timed_prefill(engine(max_num_batched_tokens=256), prefill_prompts)
    rows.append(
        [size, "prefill tok/s", "budget 2048", whole, "budget 256", chunked, whole / chunked]
    )

    decode_prompts = [text_prompt(builder, 64, seed) for seed in range(8)]
    batched = 8 * new_tokens / timed_decode(engine(), decode_prompts, new_tokens)
    single_seconds = sum(timed_decode(engine(), [p], new_tokens) for p in decode_prompts[:2])
    single = 2 * new_tokens / single_seconds
    rows.append(
        [size, "decode tok/s", "8 concurrent", batched, "1 at a time", single, batched / single]
    )

    iris = engine()
    width, height = (224, 224) if quick else (1280, 720)
    prompt = builder.build(
        builder.render_chat([{"role": "user", "content": [{"type": "image"}] * 4}]),
        [make_image(width, height, seed=s) for s in range(4)],
    )
    pairs = zip(prompt.pixels, prompt.images, strict=True)
    pixels = [iris.patches([p], [image.grid_thw]) for p, image in pairs]
    grids = [torch.tensor([image.grid_thw], device=iris.device) for image in prompt.images]

    def batched() -> None:
        iris.model.encode_images(torch.cat(pixels), torch.cat(grids))

    def one_by_one() -> None:
        for p, g in zip(pixels, grids, strict=True):
            iris.model.encode_images(p, g)

    with torch.inference_mode():
        one_call = 4 / best_seconds(batched)
        per_image = 4 / best_seconds(one_by_one)
    label = f"ViT img/s ({width}x{height}, {prompt.images[0].length} tok)"
    rows.append(
        [size, label, "4 in one call", one_call, "1 per call", per_image, one_call / per_image]
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    add_arch_argument(parser)
    parser.add_argument("--quick", action="store_true", help="small inputs (smoke test)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for size in args.sizes for row in bench_size(args.arch, size, args.quick)]
    header = ["model", "metric", "variant A", "A", "variant B", "B", "A / B"]
    name = "engine_offline" + ("" if args.arch == DEFAULT_ARCH else f"_{args.arch}")
    write_result(
        name + ("_quick" if args.quick else ""),
        f"Offline engine throughput (in-process, {ARCH_TITLES[args.arch]} generated checkpoints)",
        markdown_table(header, rows),
        args.out,
    )


if __name__ == "__main__":
    main()
