"""How far a step with decodes may stretch (`--max-itl-stretch`): served load per setting.

The step pacer (scheduler/step_pacer.py) caps the prefill a step carries beside decodes
so that the step takes at most about `stretch` decode steps. Smaller stretches shorten
the longest inter-token gaps and cut long prompts into more, smaller chunks. This
benchmark serves the workloads of `bench.serve_load` (one new 1280×720 JPEG + 200 random
tokens, and text only; 32 tokens back, greedy, at most 4 in flight) with the built-in
client to one `iris serve` per setting, plus the engine before issue 12
(`--mm-encoder-inline --max-itl-stretch 0`). All servers are up at once and measured in
turns (`bench.server_process.run_interleaved`), each workload `--rounds` times, so a burst
of other work on the machine hits every setting alike. Each round sends new requests
(its own seed), the same to every server.

    python -m bench.itl_stretch [--size small] [--rounds 2] [--stretches 2,2.5,3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from typing import Any

from transformers import AutoTokenizer

from bench.load_client import Workload, chat_bodies, run_builtin
from bench.results_io import (
    ARCH_TITLES,
    add_arch_argument,
    add_common_arguments,
    checkpoint_label,
    markdown_table,
    write_result,
)
from bench.server_process import IrisServer, run_interleaved
from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint

SEED = 5600  # round r of workload w: SEED + 10 * r + w; warm-ups SEED + 900
OLD_ENGINE = "inline, unpaced (before issue 12)"
SUMMARY_HEADER = [
    "server", "workload", "req/s ÷ old", "mean TTFT ÷ old", "mean TPOT ÷ old",
    "p99 / median ITL",
]  # fmt: skip
ROUND_HEADER = [
    "server", "workload", "round", "ok", "req/s", "mean TTFT ms", "mean TPOT ms",
    "median ITL ms", "p99 ITL ms", "p99 / median ITL",
]  # fmt: skip


def variants(stretches: list[str]) -> list[tuple[str, list[str]]]:
    chosen = [(f"stretch {s}", ["--max-itl-stretch", s]) for s in stretches]
    return [*chosen, (OLD_ENGINE, ["--mm-encoder-inline", "--max-itl-stretch", "0"])]


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [Workload("image", 32, 4, 2, 2, (448, 252)), Workload("text", 32, 4, 2, 2, None)]
    return [Workload("image", 200, 32, 8, 4, (1280, 720)), Workload("text", 200, 32, 16, 4, None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    add_arch_argument(parser)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each workload per server")
    parser.add_argument("--stretches", default="2,2.5,3", help="comma-separated settings")
    args = parser.parse_args()
    model_dir = builtin_checkpoint(arch=args.arch, size=args.size)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    load = workloads(args.quick)
    rounds = 1 if args.quick else args.rounds
    common = ["--served-model-name", "iris"]
    if args.quick:
        common += ["--tokenizer-workers", "1", "--kv-cache-memory", "64MiB"]

    def steps(name: str, server: IrisServer) -> Iterator[dict[str, Any]]:
        for w in load:  # warm-up: one request of each workload, images used nowhere else
            warm = Workload(w.name, w.input_len, w.output_len, 1, 1, w.image)
            run_builtin(server.base_url, chat_bodies(tokenizer, "iris", warm, SEED + 900), 1)
        for r in range(rounds):
            for i, w in enumerate(load):
                bodies = chat_bodies(tokenizer, "iris", w, SEED + 10 * r + i)
                metrics = run_builtin(server.base_url, bodies, w.concurrency)
                print(f"[itl_stretch] {name} / {w.name} round {r}: "
                      f"{metrics['request_throughput']:.3f} req/s", flush=True)  # fmt: skip
                yield {"workload": w.name, "round": r, **metrics}

    chosen = variants(args.stretches.split(","))
    results = run_interleaved(model_dir, chosen, steps, common_flags=common)

    base = OLD_ENGINE
    rows, summary = [], []
    for w in load:
        for name, _ in chosen:
            runs = [m for m in results[name] if m["workload"] == w.name]
            ref = [m for m in results[base] if m["workload"] == w.name]
            for m in runs:
                rows.append([
                    name, w.name, m["round"], f"{m['completed']}/{w.num_prompts}",
                    m["request_throughput"], m["mean_ttft_ms"], m["mean_tpot_ms"],
                    m["median_itl_ms"], m["p99_itl_ms"], _itl_spread(m),
                ])  # fmt: skip
            summary.append([
                name, w.name,
                _mean_ratio(runs, ref, "request_throughput"),
                _mean_ratio(runs, ref, "mean_ttft_ms"),
                _mean_ratio(runs, ref, "mean_tpot_ms"),
                _mean([_itl_spread(m) for m in runs]),
            ])  # fmt: skip
    w = load[0]
    body = "\n".join(
        [
            f"Generated {ARCH_TITLES[args.arch]} `{args.size}` checkpoint. Built-in client, at "
            f"most {w.concurrency} in flight, {w.input_len} random tokens (+ one "
            f"{w.image[0]}×{w.image[1]} JPEG in `image`), `max_completion_tokens` "
            f"{w.output_len}, greedy; {load[0].num_prompts} image and {load[1].num_prompts} "
            f"text requests per round, {rounds} round(s), servers up at once and measured in "
            f"turns. Flags for all: `{' '.join(common)}`.",
            "",
            f"## Mean over rounds, as ratios to `{OLD_ENGINE}` of the same round",
            "",
            "req/s above 1 and latencies below 1 are better; p99 / median ITL is the setting's "
            "own (issue 12's goal: ≤ 3 on the image workload).",
            "",
            markdown_table(SUMMARY_HEADER, summary),
            "",
            "## Every round",
            "",
            markdown_table(ROUND_HEADER, rows),
        ]
    )
    suffix = "_quick" if args.quick else ""
    arch = ARCH_TITLES[args.arch]
    title = f"Prefill paced beside decodes: --max-itl-stretch (HTTP, {arch} {args.size})"
    write_result(
        f"itl_stretch_{checkpoint_label(args.arch, args.size)}{suffix}", title, body, args.out
    )


def _mean_ratio(runs: list[dict[str, Any]], ref: list[dict[str, Any]], key: str) -> float | str:
    """Mean over rounds of this setting's value ÷ the old engine's in the same round."""
    return _mean([m[key] / r[key] if r[key] else "n/a" for m, r in zip(runs, ref, strict=True)])


def _itl_spread(metrics: dict[str, Any]) -> float | str:
    """p99 ÷ median ITL; "n/a" without ITLs (every answer stopped at EOS after one token)."""
    median = metrics["median_itl_ms"]
    return metrics["p99_itl_ms"] / median if median else "n/a"


def _mean(values: list[float | str]) -> float | str:
    numbers = [v for v in values if not isinstance(v, str)]
    return statistics.mean(numbers) if numbers else "n/a"


if __name__ == "__main__":
    main()
