"""What a prefill chunk after cached tokens pays for attention on a CPU: one SDPA call
over its whole context with a shifted causal mask, against its own tokens causally and
its history unmasked, merged by log-sum-exps (`scheduler/attention/sdpa.py`,
`SPLIT_MIN_NEW_TOKENS`). In one run, alternating:

- per layer: the `sdpa` backend's `attend` for one chunk of `new` tokens after `cached`
  ones, at the checkpoint's heads, KV heads and head dim;
- end to end: the time to first token of a long text prompt through the in-process
  engine at the default token budget (2,048), so every chunk but the first comes after
  history.

    python -m bench.chunk_attention [--size small] [--prompt-tokens 8000] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from bench.load_client import random_text
from bench.results_io import (
    ARCH_TITLES,
    add_arch_argument,
    checkpoint_label,
    markdown_table,
    write_result,
)
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.attention import SequenceChunk, sdpa
from iris_serve.scheduler.kv_cache import KVCache, KVLayout
from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint

MASKED = 1 << 30  # a threshold no chunk reaches: every chunk after history masked
SHAPES = [(256, 1400), (512, 512), (1202, 290), (1024, 1024), (2048, 2048), (2048, 6144)]
PAGE = 16


@contextlib.contextmanager
def split_from(threshold: int) -> Iterator[None]:
    """`sdpa.SPLIT_MIN_NEW_TOKENS` set to `threshold` inside the block."""
    default = sdpa.SPLIT_MIN_NEW_TOKENS
    sdpa.SPLIT_MIN_NEW_TOKENS = threshold
    try:
        yield
    finally:
        sdpa.SPLIT_MIN_NEW_TOKENS = default


def layer_ms(heads: int, kv_heads: int, dim: int, new: int, cached: int, reps: int) -> float:
    """Milliseconds of one layer's `attend` (the k/v write included) for one chunk."""
    pages = -(-(new + cached) // PAGE)
    cache = KVCache(KVLayout(1, kv_heads, dim, PAGE, torch.float32), pages, torch.device("cpu"))
    chunk = SequenceChunk.of(cache.pool.allocate(pages), cached, new)
    q = torch.randn(new, heads, dim)
    k, v = torch.randn(new, kv_heads, dim), torch.randn(new, kv_heads, dim)
    step = sdpa.SdpaBackend(cache, torch.device("cpu")).prepare([chunk])
    step.attend(0, q, k, v)
    started = time.perf_counter()
    for _ in range(reps):
        step.attend(0, q, k, v)
    return (time.perf_counter() - started) / reps * 1e3


def first_token_seconds(
    model_dir: Path, prompt_tokens: int, reps: int
) -> tuple[dict[str, list[float]], int]:
    """Each variant's times to first token, the variants alternating on one engine, and
    the prompts' length in tokens."""
    from iris_serve.scheduler.config import EngineConfig
    from iris_serve.scheduler.engine import Engine
    from iris_serve.tokenizer_worker.prompt import PromptBuilder

    builder, rng = PromptBuilder(model_dir), np.random.default_rng(0)
    engine = Engine(EngineConfig(model=str(model_dir), enable_prefix_caching=False))
    once = Sampling(temperature=0.0, max_tokens=1)

    def prompt():
        text = random_text(builder.tokenizer, rng, prompt_tokens)
        content = [{"type": "text", "text": text}]
        return builder.build(builder.render_chat([{"role": "user", "content": content}]), [])

    engine.generate([prompt()], once)  # warm-up
    seconds: dict[str, list[float]] = {"masked": [], "split": []}
    for _ in range(reps):
        for variant, threshold in (("masked", MASKED), ("split", sdpa.SPLIT_MIN_NEW_TOKENS)):
            request = prompt()
            with split_from(threshold):
                started = time.perf_counter()
                engine.generate([request], once)
                seconds[variant].append(time.perf_counter() - started)
    return seconds, len(request.token_ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    add_arch_argument(parser)
    parser.add_argument("--prompt-tokens", type=int, default=8000, help="about this many")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    shapes = SHAPES
    if args.quick:
        args.size, args.prompt_tokens, args.reps, shapes = "tiny", 2000, 1, [(600, 100)]
    torch.set_num_threads(args.threads)
    model_dir = builtin_checkpoint(arch=args.arch, size=args.size)
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    dim = text.get("head_dim") or text["hidden_size"] // heads

    layer_rows = []
    for new, cached in shapes:
        masked_ms, split_ms = [], []
        for _ in range(args.reps):  # alternating, so drift hits both alike
            with split_from(MASKED):
                masked_ms.append(layer_ms(heads, kv_heads, dim, new, cached, 10))
            with split_from(1):  # every shape, those below the default threshold too
                split_ms.append(layer_ms(heads, kv_heads, dim, new, cached, 10))
        masked, split = min(masked_ms), min(split_ms)
        layer_rows.append([new, cached, masked, split, split / masked])
        print(f"{new} after {cached}: masked {masked:.2f} ms, split {split:.2f} ms", flush=True)

    seconds, tokens = first_token_seconds(model_dir, args.prompt_tokens, args.reps)
    masked_s, split_s = statistics.median(seconds["masked"]), statistics.median(seconds["split"])
    runs = {variant: " ".join(f"{s:.2f}" for s in seconds[variant]) for variant in seconds}
    title = f"{ARCH_TITLES[args.arch]} `{args.size}`"
    body = (
        f"Generated {title}, float32, {args.threads} torch threads; {heads} heads, {kv_heads} "
        f"KV heads, head dim {dim}. Each figure the best (per layer) or the median (end to "
        f"end) of {args.reps} alternating runs. `split` is the default from "
        f"{sdpa.SPLIT_MIN_NEW_TOKENS} new tokens on.\n\n"
        "## One layer's attention for one chunk after history\n\n"
        + markdown_table(
            ["new tokens", "cached tokens", "masked ms", "split ms", "split ÷ masked"],
            layer_rows,
        )
        + "\n\n## Time to first token of a long prompt (in-process engine, budget 2,048)\n\n"
        + markdown_table(
            ["prompt tokens", "masked s", "split s", "split ÷ masked", "runs masked", "runs split"],
            [[tokens, masked_s, split_s, split_s / masked_s, runs["masked"], runs["split"]]],
        )
    )
    suffix = "_quick" if args.quick else ""
    write_result(
        f"chunk_attention_{checkpoint_label(args.arch, args.size)}{suffix}",
        "Attention of prefill chunks after history: masked vs split (CPU)",
        body,
        args.out,
    )


if __name__ == "__main__":
    main()
