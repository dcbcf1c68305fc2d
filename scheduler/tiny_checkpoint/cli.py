"""`iris tiny-model`: write a random-weight checkpoint to a folder."""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import ARCHS, DTYPES, SIZES, generate_checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iris tiny-model",
        description="Write a deterministic random-weight checkpoint in the Hugging Face layout.",
    )
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--size", default="tiny", choices=SIZES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the weights")
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help='shard the safetensors, e.g. "200KB" (default: one file)',
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    try:
        out = generate_checkpoint(
            args.arch,
            args.out,
            size=args.size,
            seed=args.seed,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
        )
    except (OSError, ValueError) as exc:
        print(f"iris tiny-model: error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    print(f"wrote {args.arch} ({args.size}, {args.dtype}) in {elapsed:.1f}s", file=sys.stderr)
    print(out)  # stdout carries only the path, for scripts
    return 0
