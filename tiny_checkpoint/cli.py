"""`iris tiny-model`: write a random-weight checkpoint to a folder.

Either a toy checkpoint (`--arch`, `--size`) or a real-size one with a published config
(`--like Qwen2.5-VL-7B-Instruct`; see `like.py`); `--quant fp8|awq|gptq|w4a16` stores it in
the layout of Qwen's block-FP8 or AWQ releases, of AutoGPTQ or of llm-compressor's W4A16
(`fp8.py`, `awq.py`, `gptq.py`, `compressed_tensors.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from . import ARCHS, DTYPES, SIZES, generate_checkpoint
from .awq import write_awq
from .compressed_tensors import write_w4a16
from .fp8 import write_fp8
from .gptq import write_gptq
from .known_configs import KNOWN_CONFIGS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="iris tiny-model",
        description="Write a deterministic random-weight checkpoint in the Hugging Face layout.",
    )
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--arch", choices=ARCHS, help="a toy checkpoint of this architecture")
    kind.add_argument(
        "--like",
        metavar="NAME",
        help="a real-size checkpoint with NAME's published config.json and random weights: "
        f"{', '.join(KNOWN_CONFIGS)} (the Qwen/ prefix and -Instruct suffix are optional)",
    )
    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--size", default="tiny", choices=SIZES, help="with --arch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="dtype of the weights (default: float32 with --arch, bfloat16 with --like)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help='shard the safetensors, e.g. "200KB" (default: one file with --arch, '
        '"4GB" with --like)',
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="with --like: keep only the first N text layers (NOT the named config any more)",
    )
    parser.add_argument(
        "--vision-depth",
        type=int,
        default=None,
        help="with --like: keep only the first N vision blocks (NOT the named config any more)",
    )
    parser.add_argument(
        "--quant",
        choices=["fp8", "awq", "gptq", "w4a16"],
        default=None,
        help="store the decoder's projections quantized: fp8 = block-wise FP8 (e4m3, "
        "128x128 blocks), the layout of Qwen's -FP8 releases; awq = 4-bit AWQ (GEMM "
        "packing, groups of 32 input rows), the layout of Qwen's -AWQ releases; gptq = 4-bit "
        "GPTQ (AutoGPTQ's layout, groups of 32 input rows in input order); w4a16 = "
        "compressed-tensors pack-quantized (4-bit symmetric, groups of 32)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="with --quant awq|gptq|w4a16: input rows per scale (default 32, which the "
        "tiny widths divide; releases use 128)",
    )
    parser.add_argument(
        "--sym",
        action="store_true",
        help="with --quant gptq: symmetric (every zero point 8), as Qwen's GPTQ-Int4 "
        "releases; vLLM's CPU build takes no other",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="with --like: where random values are drawn (cuda is much faster; values differ "
        "per device)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.arch and (args.num_layers, args.vision_depth, args.device) != (None, None, "cpu"):
        parser.error("--num-layers, --vision-depth and --device go with --like")
    if args.sym and args.quant != "gptq":
        parser.error("--sym goes with --quant gptq")
    if args.group_size is not None and args.quant not in ("awq", "gptq", "w4a16"):
        parser.error("--group-size goes with --quant awq, gptq or w4a16")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    target = args.out
    try:
        with tempfile.TemporaryDirectory(prefix="iris-tiny-model-") as full_precision:
            if args.quant:  # the full-precision weights first, then their quantized copy
                args.out = full_precision
            if args.like:
                out, what = _like(args), args.like
            else:
                out = generate_checkpoint(
                    args.arch,
                    args.out,
                    size=args.size,
                    seed=args.seed,
                    dtype=args.dtype or "float32",
                    max_shard_size=args.max_shard_size,
                )
                what = f"{args.arch} ({args.size}, {args.dtype or 'float32'})"
            if args.quant:
                write = {
                    "fp8": write_fp8, "awq": write_awq, "gptq": write_gptq, "w4a16": write_w4a16,
                }[args.quant]  # fmt: skip
                options: dict[str, object] = {"symmetric": True} if args.sym else {}
                if args.group_size is not None:
                    options["group_size"] = args.group_size
                out, what = write(out, target, **options), f"{what}, {args.quant}"
    except (OSError, ValueError) as exc:
        print(f"iris tiny-model: error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    print(f"wrote {what} in {elapsed:.1f}s", file=sys.stderr)
    print(out)  # stdout carries only the path, for scripts
    return 0


def _like(args: argparse.Namespace) -> Path:
    from .like import DEFAULT_MAX_SHARD_SIZE, generate_like_checkpoint, resolve_name

    name = resolve_name(args.like)
    if args.num_layers is not None or args.vision_depth is not None:
        print(
            f"iris tiny-model: depth shrunk: {name}'s widths, but not its config "
            f"(layers={args.num_layers or 'as shipped'}, "
            f"vision depth={args.vision_depth or 'as shipped'})",
            file=sys.stderr,
        )
    return generate_like_checkpoint(
        name,
        args.out,
        dtype=args.dtype or "bfloat16",
        seed=args.seed,
        num_layers=args.num_layers,
        vision_depth=args.vision_depth,
        max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        progress=lambda line: print(f"iris tiny-model: {line}", file=sys.stderr),
        device=args.device,
    )
