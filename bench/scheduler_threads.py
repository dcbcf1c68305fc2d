"""How many torch threads the scheduler should take on a CPU: served load per setting.

On a CPU the scheduler's torch (vision tower, prefill, decode) shares the cores with the
tokenizer workers and the HTTP server. `--scheduler-threads` sets its intra-op threads;
GNU OpenMP's threads spin while they wait for each other, so a pool that loses a core to
another process can spin-wait instead of working (`OMP_WAIT_POLICY=PASSIVE` makes them
sleep instead). This benchmark serves the same workloads as `bench.serve_load` (one
1280×720 JPEG + 200 random tokens, and text only; 32 tokens back, greedy) with the
built-in client to one `iris serve` per setting, one server after another on the same
generated checkpoint (`--arch`; Qwen2.5-VL by default), each warmed up first, and compares their throughput and latency.

    python -m bench.scheduler_threads [--size tiny|small] [--arch ARCH] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from transformers import AutoTokenizer

from bench.load_client import Workload, chat_bodies, run_builtin
from bench.results_io import (
    ARCH_TITLES,
    RESULTS_DIR,
    add_arch_argument,
    add_common_arguments,
    checkpoint_label,
    markdown_table,
    write_result,
)
from bench.server_process import IrisServer
from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint
from iris_serve.server.launcher import usable_cores

SEED = 4321  # the same requests for every setting: each server starts with empty caches


def settings(cores: int) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, flags, environment) of each server; the first, Iris's default, is the
    ratios' base."""
    chosen = [(f"{cores} (default: every core)", [], {})]
    if cores > 1:
        fewer = ["--scheduler-threads", str(cores - 1)]
        chosen.append((f"{cores - 1} (all cores but one)", fewer, {}))
    chosen.append((f"{cores}, OMP_WAIT_POLICY=PASSIVE", [], {"OMP_WAIT_POLICY": "PASSIVE"}))
    return chosen


def workloads(size: str, quick: bool) -> list[Workload]:
    if quick:
        return [Workload("image", 32, 4, 2, 2, (448, 252)), Workload("text", 32, 4, 2, 2, None)]
    n = 32 if size == "tiny" else 8  # small: seconds of ViT per image on 2 CPU cores
    return [Workload("image", 200, 32, n, 4, (1280, 720)), Workload("text", 200, 32, n, 4, None)]


def measure(server: IrisServer, tokenizer, load: list[Workload]) -> list[dict[str, Any]]:
    model = server.model_name()
    for w in load:  # warm-up: one request of each workload, images used nowhere else
        warm = Workload(w.name, w.input_len, w.output_len, 1, 1, w.image)
        metrics = run_builtin(server.base_url, chat_bodies(tokenizer, model, warm, SEED + 900), 1)
        if metrics["failed"]:
            raise RuntimeError(f"warm-up failed: {metrics['errors']}")
    rows = []
    for i, w in enumerate(load):
        loadavg = os.getloadavg()[0]
        metrics = run_builtin(
            server.base_url, chat_bodies(tokenizer, model, w, SEED + i), w.concurrency
        )
        rows.append({"workload": w.name, "load": loadavg, **metrics})  # fmt: skip
    return rows


def ratio(measured: dict[str, Any], base: dict[str, Any], key: str) -> float | str:
    """measured / base; "n/a" where the base is 0 (no TPOT when every answer is 1 token)."""
    return measured[key] / base[key] if base[key] else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    add_arch_argument(parser)
    args = parser.parse_args()
    cores = usable_cores()
    model_dir = builtin_checkpoint(arch=args.arch, size=args.size)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    load = workloads(args.size, args.quick)
    flags = ["--tokenizer-workers", "1", "--kv-cache-memory", "64MiB"] if args.quick else []
    results: dict[str, list[dict[str, Any]]] = {}
    chosen = settings(cores)[:2] if args.quick else settings(cores)  # quick: one server less
    for name, variant_flags, env in chosen:
        started = time.monotonic()
        with IrisServer(model_dir, [*flags, *variant_flags], env=env) as server:
            results[name] = measure(server, tokenizer, load)
        print(f"[scheduler_threads] {name}: {time.monotonic() - started:.0f} s", flush=True)

    base = next(iter(results))
    header = [
        "scheduler threads", "workload", "load", "ok", "req/s", f"÷ {base}", "out tok/s",
        "mean TTFT ms", f"÷ {base}", "p99 TTFT ms", "mean TPOT ms", f"÷ {base}", "mean ITL ms",
    ]  # fmt: skip
    rows = []
    for w in load:
        ref = next(r for r in results[base] if r["workload"] == w.name)
        for name, measured in results.items():
            m = next(r for r in measured if r["workload"] == w.name)
            rows.append([
                name, w.name, m["load"], f"{m['completed']}/{w.num_prompts}",
                m["request_throughput"], ratio(m, ref, "request_throughput"),
                m["output_throughput"], m["mean_ttft_ms"], ratio(m, ref, "mean_ttft_ms"),
                m["p99_ttft_ms"], m["mean_tpot_ms"], ratio(m, ref, "mean_tpot_ms"),
                m["mean_itl_ms"],
            ])  # fmt: skip
    w = load[0]
    body = "\n".join(
        [
            f"Generated {ARCH_TITLES[args.arch]} `{args.size}` checkpoint, {cores} cores. Built-in client "
            f"(`bench.load_client`), {w.num_prompts} requests per workload, at most "
            f"{w.concurrency} in flight, {w.input_len} random tokens (+ one "
            f"{w.image[0]}×{w.image[1]} JPEG in `image`), `max_completion_tokens` "
            f"{w.output_len}, greedy, answers may stop at EOS; the same requests for every "
            "server (each starts with empty caches), one server at a time after a warm-up. "
            f"Server flags besides the threads: `{' '.join(flags) or '(defaults)'}`. `load`: "
            "the 1-minute load average as the workload started. Ratios: above 1 on req/s "
            "and below 1 on latencies is better than the first row.",
            "",
            markdown_table(header, rows),
        ]
    )
    name = f"scheduler_threads_{checkpoint_label(args.arch, args.size)}" + (
        "_quick" if args.quick else ""
    )
    out = args.out or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    write_result(
        name,
        f"Scheduler torch threads on a CPU (HTTP, {ARCH_TITLES[args.arch]} {args.size})",
        body,
        out,
    )


if __name__ == "__main__":
    main()
