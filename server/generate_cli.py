"""`iris generate`: one prompt through the in-process engine, for a quick look."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="iris generate")
    parser.add_argument("model", nargs="?", help="checkpoint folder (default: built-in tiny)")
    parser.add_argument("--prompt", default="Describe the picture.")
    parser.add_argument("--image", action="append", default=[], help="image file; repeatable")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)

    from PIL import Image

    from iris_serve.scheduler.config import EngineConfig
    from iris_serve.scheduler.engine import Engine
    from iris_serve.scheduler.sampling import SamplingParams
    from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint
    from iris_serve.tokenizer_worker.prompt import PromptBuilder

    model_dir = Path(args.model) if args.model else builtin_checkpoint()
    builder = PromptBuilder(model_dir)
    images = [Image.open(path) for path in args.image]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": args.prompt}]
    prompt = builder.build(builder.render_chat([{"role": "user", "content": content}]), images)

    engine = Engine(EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype))
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    started = time.perf_counter()
    [output_ids] = engine.generate([prompt], sampling)
    elapsed = time.perf_counter() - started
    print(builder.tokenizer.decode(output_ids, skip_special_tokens=True))
    print(
        f"[{len(prompt.token_ids)} prompt tokens, {len(images)} images, "
        f"{len(output_ids)} output tokens in {elapsed:.2f} s on {engine.device}]"
    )
    return 0
