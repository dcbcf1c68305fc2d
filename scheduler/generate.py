"""`iris generate`: one prompt through the in-process engine, for a quick look.

This is the scheduler side's command: it runs the engine in this process, with no server
and no worker process. It still needs a prompt built from text and images (the chat
template, the image processor, one placeholder expanded per image), which is the
tokenizer worker's knowledge. A role imports only `ipc` and itself, so this module does
not import the worker: it takes a *prompt-builder factory* (`PromptBuilderFactory`,
what it needs of one is `PromptSource`) and the caller composes the two roles. The
caller is `server.cli`, which, as the launcher of `iris serve` does with the two
processes, puts the worker's public `PromptBuilder` and the scheduler's engine together.
The scheduler then depends on the shape of a prompt builder, not on its package.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.config import EngineConfig

if TYPE_CHECKING:
    from PIL import Image


class PromptSource(Protocol):
    """What `iris generate` uses of a prompt builder (the tokenizer worker's
    `PromptBuilder` is one)."""

    tokenizer: Any  # decodes the output ids

    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...

    def build(self, text: str, images: Sequence[Image.Image] = ()) -> PromptInput: ...


PromptBuilderFactory = Callable[[Path], PromptSource]  # model folder → its prompt builder


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


def main_generate(argv: list[str], prompt_builder: PromptBuilderFactory) -> int:
    """Parse `argv`, build the prompt with `prompt_builder(model_dir)`, generate, print
    the text and a one-line summary."""
    parser = build_parser()
    args = parser.parse_args(argv)

    from PIL import Image, UnidentifiedImageError

    from iris_serve.scheduler.engine import Engine
    from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint

    model_dir = Path(args.model) if args.model else builtin_checkpoint()
    builder = prompt_builder(model_dir)
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
