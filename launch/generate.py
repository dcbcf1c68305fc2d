"""`iris generate`: one prompt through the in-process engine, for a quick look.

No server and no worker process: the worker's `PromptBuilder` builds the prompt and the
scheduler's `Engine` runs it, each through its role's public surface. Composing two roles
in one process is the composition root's job, hence this command lives here.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..ipc.messages import Sampling
from ..scheduler import Engine, EngineConfig
from ..tiny_checkpoint import builtin_checkpoint
from ..tokenizer_worker import PromptBuilder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iris generate", allow_abbrev=False)
    parser.add_argument("model", nargs="?", help="checkpoint folder (default: built-in tiny)")
    parser.add_argument("--prompt", default="Describe the picture.")
    parser.add_argument("--image", action="append", default=[], help="image file; repeatable")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default=EngineConfig.device)
    parser.add_argument("--dtype", default=EngineConfig.dtype)
    return parser


def main_generate(argv: list[str]) -> int:
    """Parse `argv`, build the prompt, generate, print the text and a one-line summary."""
    parser = build_parser()
    args = parser.parse_args(argv)

    from PIL import Image, UnidentifiedImageError

    model_dir = Path(args.model) if args.model else builtin_checkpoint()
    builder = PromptBuilder(model_dir)
    images = []
    for path in args.image:
        try:
            images.append(Image.open(path))
        except (OSError, UnidentifiedImageError) as error:  # missing, unreadable, no image
            parser.error(f"--image {path}: {error}")
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": args.prompt}]
    prompt = builder.build(builder.render_chat([{"role": "user", "content": content}]), images)

    engine = Engine(EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype))
    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    started = time.perf_counter()
    [output_ids] = engine.generate([prompt], sampling)
    elapsed = time.perf_counter() - started
    print(builder.tokenizer.decode(output_ids, skip_special_tokens=True))
    print(
        f"[{len(prompt.token_ids)} prompt tokens, {len(images)} images, "
        f"{len(output_ids)} output tokens in {elapsed:.2f} s on {engine.device}]"
    )
    return 0
