"""`iris` command line: one subcommand per entry point, imported lazily, so `iris --help`
is instant and each subcommand pulls in only what it needs (the generator transformers'
model classes, `generate` the engine).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "tiny-model": "write a small random-weight checkpoint in the Hugging Face layout",
        "generate": "run the in-process engine on one prompt (no server)",
        "serve": "start the OpenAI-compatible server (tokenizer workers + scheduler)",
    }
    if argv[:1] in (["--version"], ["-V"]):
        from ..common.version import iris_version

        print(f"iris {iris_version()}")
        return 0
    if not argv or argv[0] not in commands:
        parser = argparse.ArgumentParser(
            prog="iris", description="Iris VLM inference server", allow_abbrev=False
        )
        parser.add_argument("--version", "-V", action="store_true", help="print the version")
        sub = parser.add_subparsers(dest="command", required=True)
        for name, help_text in commands.items():
            sub.add_parser(name, help=help_text, add_help=False)
        parser.parse_args(argv[:1])  # prints usage and exits for a missing or unknown command
        return 2
    command, rest = argv[0], argv[1:]
    if command == "tiny-model":
        from ..tiny_checkpoint import main_tiny_model

        return main_tiny_model(rest)
    if command == "serve":
        from .args import parse_serve_args

        args = parse_serve_args(rest)  # before the launcher's imports: `--help` stays quick
        from .launcher import serve

        return serve(args)
    from .generate import main_generate

    return main_generate(rest)


if __name__ == "__main__":
    raise SystemExit(main())
