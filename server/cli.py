"""`iris` command line: one subcommand per entry point, imported lazily.

Lazy imports keep `iris --help` instant and let each subcommand pull in only what it
needs (the generator needs transformers' model classes, `generate` needs the engine).

Like the launcher, this module composes the roles, through their public surfaces only
(`iris_serve.scheduler`, `iris_serve.tokenizer_worker`): `generate` is the scheduler's
command, handed the tokenizer worker's `PromptBuilder` to build its prompt (see
`scheduler.generate` for why the scheduler does not import it itself).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "tiny-model": "write a small random-weight checkpoint in the Hugging Face layout",
        "generate": "run the in-process engine on one prompt (no server)",
        "serve": "start the OpenAI-compatible server (tokenizer workers + scheduler)",
    }
    if not argv or argv[0] not in commands:
        parser = argparse.ArgumentParser(
            prog="iris", description="Iris VLM inference server", allow_abbrev=False
        )
        sub = parser.add_subparsers(dest="command", required=True)
        for name, help_text in commands.items():
            sub.add_parser(name, help=help_text, add_help=False)
        parser.parse_args(argv[:1])  # prints usage and exits for a missing or unknown command
        return 2
    command, rest = argv[0], argv[1:]
    if command == "tiny-model":
        from iris_serve.scheduler import main_tiny_model

        return main_tiny_model(rest)
    if command == "serve":
        from iris_serve.server.args import parse_serve_args

        args = parse_serve_args(rest)  # before the launcher's imports: `--help` stays quick
        from iris_serve.server.launcher import serve

        return serve(args)
    from iris_serve.scheduler import main_generate

    return main_generate(rest, _prompt_builder)


def _prompt_builder(model_dir: Path) -> Any:
    """The tokenizer worker's prompt builder for `model_dir`, imported only once
    `iris generate` has parsed its flags."""
    from iris_serve.tokenizer_worker import PromptBuilder

    return PromptBuilder(model_dir)


if __name__ == "__main__":
    raise SystemExit(main())
