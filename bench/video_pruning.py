"""How far `--video-pruning-rate` moves the answer: the same video questions served at
q = 0 and at each rate asked for, greedy, on generated checkpoints.

    python -m bench.video_pruning [--size tiny] [--archs qwen2_5_vl,qwen3_vl]
        [--rates 0.5,0.75] [--prompts 8] [--max-tokens 16] [--quick]

Each prompt is a question about a clip of its own synthetic screen recording
(`bench.videos`: windows that move over a still desktop, so some temporal patches change
little and some much), sent once to a fresh `iris serve` per (checkpoint, rate), one
server after another. Per rate: the video's prompt tokens, the fraction of output tokens
equal to q = 0's at the same place, the fraction of prompts whose first token is q = 0's,
and how many tokens the answers share before they part. The answers of random-weight
checkpoints are noise, so this measures how much the pruned inputs move the model's
output, not what they do to the quality of a trained model's answers. Speed:
`bench.serve_load --workloads video,clips --variant 'q50=--video-pruning-rate 0.5'`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import httpx

from bench.results_io import ARCH_TITLES, add_common_arguments, markdown_table, write_result
from bench.server_process import IrisServer, chat_body
from bench.videos import Recording, clip_bytes, video_part

SIZE, QUICK_SIZE = (640, 360), (160, 96)
FPS = 4.0  # the recording's rate; the checkpoints sample it at 2 fps
SECONDS = 4.0  # a clip: 8 sampled frames, 4 temporal patches
SEED = 8200
QUESTIONS = ("What changes on the screen?", "Which window moves?", "Describe the clip.")


def answer(client: httpx.Client, server: IrisServer, seed: int, size: tuple[int, int],
           max_tokens: int) -> tuple[list[str], int]:  # fmt: skip
    """The output tokens (as text pieces) and prompt tokens of one question about the
    clip of recording `seed`."""
    data = clip_bytes(Recording(*size, FPS, seed), 0.0, SECONDS)
    text = {"type": "text", "text": QUESTIONS[seed % len(QUESTIONS)]}
    body = chat_body(server.model_name(), [{"role": "user", "content": [video_part(data), text]}],
                     max_tokens, None)  # fmt: skip
    body["logprobs"] = True
    response = client.post(f"{server.base_url}/v1/chat/completions", json=body)
    response.raise_for_status()
    reply = response.json()
    tokens = [item["token"] for item in reply["choices"][0]["logprobs"]["content"]]
    return tokens, reply["usage"]["prompt_tokens"]


def served(model_dir: Any, rate: float, args: argparse.Namespace) -> list[tuple[list[str], int]]:
    """Every prompt's answer from a fresh server at `rate`."""
    size = QUICK_SIZE if args.quick else SIZE
    flags = ["--video-pruning-rate", str(rate)]
    with IrisServer(model_dir, flags) as server, httpx.Client(timeout=600) as client:
        return [
            answer(client, server, SEED + i, size, args.max_tokens) for i in range(args.prompts)
        ]


def compare(
    base: Sequence[tuple[list[str], int]], other: Sequence[tuple[list[str], int]]
) -> list[float]:
    """Mean prompt tokens, output tokens equal to `base`'s at the same place, first tokens
    equal, tokens shared before the answers part."""
    same = shared = first = 0
    total = 0
    for (want, _), (got, _) in zip(base, other, strict=True):
        pairs = list(zip(want, got, strict=True))
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
        first += pairs[0][0] == pairs[0][1]
        shared += next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    n = len(base)
    return [sum(p for _, p in other) / n, same / total, first / n, shared / n]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, "two short prompts, one rate, one checkpoint")
    parser.add_argument("--archs", default="qwen2_5_vl,qwen3_vl")
    parser.add_argument("--rates", default="0.5,0.75")
    parser.add_argument("--prompts", type=int, default=None, help="(default 8; quick 2)")
    parser.add_argument("--max-tokens", type=int, default=None, help="(default 16; quick 4)")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (2 if args.quick else 8)
    args.max_tokens = args.max_tokens or (4 if args.quick else 16)
    archs = args.archs.split(",")[: 1 if args.quick else None]
    rates = [float(r) for r in args.rates.split(",")][: 1 if args.quick else None]
    from iris_serve.tiny_checkpoint import builtin_checkpoint

    rows: list[list[object]] = []
    for arch in archs:
        model_dir = builtin_checkpoint(arch=arch, size=args.size)
        base = served(model_dir, 0.0, args)
        for rate in [0.0, *rates]:
            answers = base if rate == 0.0 else served(model_dir, rate, args)
            rows.append([f"{ARCH_TITLES[arch]} {args.size}", rate, *compare(base, answers)])
    header = ["checkpoint", "q", "prompt tok (mean)", "output tok = q 0's", "first tok = q 0's",
              "tok before they part (mean)"]  # fmt: skip
    size = QUICK_SIZE if args.quick else SIZE
    body = (
        f"{args.prompts} prompts per checkpoint, each a question about a {SECONDS:g} s clip "
        f"({size[0]}×{size[1]}, {FPS:g} fps) of its own synthetic screen recording, "
        f"{args.max_tokens} greedy tokens back (`ignore_eos`); a fresh `iris serve` per "
        "checkpoint and rate. Random-weight checkpoints: how far pruning moves the output, "
        "not the quality of a trained model's answer.\n\n" + markdown_table(header, rows)
    )
    name = "video_pruning_" + args.size + ("_quick" if args.quick else "")
    write_result(name, "Video pruning: how far the answer moves", body, args.out)


if __name__ == "__main__":
    main()
