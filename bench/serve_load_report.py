"""Tables, plot and result file of `bench.serve_load`."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.compute_bound import Bound
from bench.load_client import Workload
from bench.results_io import (
    RESULTS_DIR,
    Checkpoint,
    checkout_commit,
    markdown_table,
    write_result,
)

PEER = "transformers serve"
INLINE = "iris inline"  # `--inline-baseline`: the encoder inside the steps
BEFORE = "iris before"  # `--before-tree`: another checkout's `iris serve`


@dataclass(frozen=True)
class Plan:
    """What one invocation sends, and the flags Iris gets."""

    workloads: list[Workload]
    iris_flags: list[str]


@dataclass
class Run:
    """One workload sent to one server: `vllm bench serve`'s metrics, or the error."""

    server: str
    workload: str
    seed: int
    metrics: dict[str, Any] | None = None
    command: str = ""
    error: str = ""
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-min, at the start


LATENCIES = [(f"{stat} {metric}", f"{stat}_{metric.lower()}_ms")
             for metric in ("TTFT", "TPOT", "ITL") for stat in ("mean", "median", "p99")]  # fmt: skip


def results_table(runs: Sequence[Run], workloads: Sequence[Workload]) -> str:
    header = ["workload", "server", "load", "ok", "req/s", "out tok/s", "out tok/req"]
    header += ["in tok/req", "server CPU s/req"]
    header += [f"{name} ms" for name, _ in LATENCIES] + ["p99 / median ITL"]
    rows = []
    for run in runs:
        n = next(w.num_prompts for w in workloads if w.name == run.workload)
        if run.metrics is None:
            rows.append([run.workload, run.server, run.load, f"0/{n}", "failed"])
            rows[-1] += [""] * (len(header) - len(rows[-1]))
            continue
        m = run.metrics
        done = max(m["completed"], 1)
        rows.append([
            run.workload, run.server, run.load, f"{m['completed']}/{n}", m["request_throughput"],
            m["output_throughput"], m["total_output_tokens"] / done,
            m["total_input_tokens"] / done, m["server_cpu_s"] / done,
            *[m[key] for _, key in LATENCIES], _ratio(m["p99_itl_ms"], m["median_itl_ms"]),
        ])  # fmt: skip
    return markdown_table(header, rows)


def ratio_table(runs: Sequence[Run], base: str = PEER) -> str | None:
    """Iris's figures over those of the `base` server, per workload."""
    by = {(r.server, r.workload): r.metrics for r in runs if r.metrics}
    keys = [("req/s", "request_throughput"), ("out tok/s", "output_throughput")]
    keys += [(name, key) for name, key in LATENCIES if not name.startswith("median")]
    rows = []
    for workload in dict.fromkeys(r.workload for r in runs):
        iris, peer = by.get(("iris", workload)), by.get((base, workload))
        if iris and peer:
            same = sum(
                _comparable(a) == _comparable(b) and not error
                for a, b, error in zip(
                    iris["generated_texts"], peer["generated_texts"], iris["errors"], strict=True
                )
            )
            ratios = [_ratio(iris[key], peer[key]) for _, key in keys]
            rows.append([workload, *ratios, f"{same}/{len(iris['generated_texts'])}"])
    if not rows:
        return None
    return markdown_table(["workload", *[name for name, _ in keys], "same answers"], rows)


def _comparable(text: str) -> str:
    """The answer without what the two detokenizers print differently: special tokens
    (`transformers serve` keeps e.g. `<|quad_end|>`) and U+FFFD for an incomplete
    UTF-8 sequence at the end (Iris flushes it, the peer holds it back)."""
    return re.sub(r"<\|[a-z_]+\|>", "", text).replace("\ufffd", "")


def _ratio(a: float, b: float) -> float | str:
    return a / b if b else "n/a"


def bound_table(bounds: Sequence[Bound], runs: Sequence[Run]) -> str:
    iris = {r.workload: r.metrics for r in runs if r.server == "iris" and r.metrics}
    header = [
        "workload", "requests", "prompt tok/req", "out tok/req", "preprocess ms/req",
        "engine ms/req", "bound req/s", "bound out tok/s", "Iris req/s", "Iris / bound",
    ]  # fmt: skip
    rows = []
    for b in bounds:
        served = iris.get(b.workload, {}).get("request_throughput")
        rows.append([
            b.workload, b.requests, b.prompt_tokens, b.output_tokens,
            1000 * b.preprocess_s / b.requests, 1000 * b.engine_s / b.requests,
            b.request_throughput, b.output_throughput,
            served if served is not None else "failed",
            served / b.request_throughput if served is not None else "n/a",
        ])  # fmt: skip
    return markdown_table(header, rows)


def plot(runs: Sequence[Run], bounds: Sequence[Bound], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in runs))
    servers = list(dict.fromkeys(r.server for r in runs))
    by = {(r.server, r.workload): r.metrics for r in runs if r.metrics}
    bound = {b.workload: b for b in bounds}
    shown = [(n, k) for n, k in LATENCIES if not n.startswith("median")]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4 * len(workloads)), squeeze=False)
    colors = {
        "iris": "tab:blue",
        "iris direct": "tab:cyan",
        INLINE: "tab:purple",
        BEFORE: "tab:gray",
        PEER: "tab:orange",
        "compute bound": "tab:green",
    }
    for row, workload in enumerate(workloads):
        lat, thr = axes[row]
        width = 0.8 / max(len(servers), 1)
        for j, server in enumerate(servers):
            m = by.get((server, workload))
            values = [m[k] if m else 0.0 for _, k in shown]
            xs = [i + (j - (len(servers) - 1) / 2) * width for i in range(len(shown))]
            lat.bar(xs, values, width, label=server, color=colors.get(server))
        lat.set_xticks(range(len(shown)), [n for n, _ in shown], rotation=30)
        lat.set_yscale("log")
        lat.set_ylabel("ms (log)")
        lat.set_title(f"{workload}: latency (lower is better)")
        lat.legend()
        names, req, tok = [], [], []
        for server in servers:
            m = by.get((server, workload))
            names.append(server)
            req.append(m["request_throughput"] if m else 0.0)
            tok.append(m["output_throughput"] if m else 0.0)
        if workload in bound:
            names.append("compute bound")
            req.append(bound[workload].request_throughput)
            tok.append(bound[workload].output_throughput)
        xs = np.arange(len(names))
        thr.bar(xs - 0.2, req, 0.4, label="requests/s", color=[colors.get(n) for n in names])
        twin = thr.twinx()
        twin.bar(xs + 0.2, tok, 0.4, label="output tokens/s", color="lightgray", hatch="//")
        thr.set_xticks(xs, names)
        thr.set_ylabel("requests/s (coloured)")
        twin.set_ylabel("output tokens/s (grey)")
        thr.set_title(f"{workload}: throughput (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def setup_text(
    args, checkpoint: Checkpoint, plan_: Plan, runs: Sequence[Run], load: tuple[float, float]
) -> str:
    """One paragraph: client, workloads, seeds, proxy, Iris flags, machine load."""
    w = plan_.workloads[0]
    if args.client == "vllm":
        client = "`vllm bench serve` (vllm 0.33.0, CPU-only venv of `bench/install_vllm_client.sh`)"
        eos = (
            "Each server behind its own `bench.drop_fields_proxy`, which drops `ignore_eos`, "
            "so answers may stop at EOS."
        )
    else:
        client = "the built-in httpx client (`--client builtin`)"
        eos = "No `ignore_eos` is sent, so answers may stop at EOS."
    image = next((x.image for x in plan_.workloads if x.image), None)
    parts = [
        checkpoint.sentence,
        f"Client: {client}. {w.num_prompts} requests per run, at most {w.concurrency} in "
        f"flight, greedy, `max_completion_tokens` {w.output_len}, {w.input_len} random text "
        "tokens"
        + (f" (+ one {image[0]}×{image[1]} JPEG in the image workload)." if image else "."),
        "Seeds: "
        + ", ".join(f"{r.workload} {r.seed}" for r in runs if r.server == "iris")
        + f" (the same for both servers, so they get the same requests). {eos}",
    ]
    if any(r.server == "iris direct" for r in runs):
        parts.append(
            "`iris direct`: the same workloads (seeds + 100) straight to Iris, `ignore_eos` "
            "honoured, as `vllm bench serve` is usually run (and without the proxy's hop)."
        )
    parts.append(f"Iris flags: `{shlex.join(plan_.iris_flags) or '(defaults)'}`.")
    if getattr(args, "iris_flags", ""):
        parts.append(f"`iris` alone also: `{args.iris_flags}` (`--iris-flags`).")
    if args.threads:
        parts.append(
            f"`OMP_NUM_THREADS={args.threads}` for both servers (and Iris's "
            f"`--scheduler-threads {args.threads}`) and the bound."
        )
    parts.append(
        "`server CPU s/req`: user + system CPU time of the server's processes during the "
        "run (not the proxy's, not the client's) per completed request: less sensitive than "
        "wall-clock figures to other work on the machine (OpenMP threads that spin while "
        "descheduled still inflate it)."
    )
    parts.append(
        f"`load`: the machine's 1-minute load average as the run started ({os.cpu_count()} "
        f"cores; other work shares them); {load[0]:.2f} at the start, {load[1]:.2f} at the end."
    )
    return " ".join(parts)


def report(
    args, checkpoint: Checkpoint, name: str, plan_: Plan, runs: list[Run], bounds: list[Bound], peer_note: str,
    load: tuple[float, float],
) -> Path:  # fmt: skip
    out = args.out or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, bounds, out / f"{name}.png")
    lines = [setup_text(args, checkpoint, plan_, runs, load), "", "## Served", ""]
    lines.append(results_table(runs, plan_.workloads))
    ratios = ratio_table(runs)
    if ratios:
        lines += [
            "",
            f"## Iris / {PEER}",
            "",
            "Throughput: above 1 is Iris faster. Latencies: below 1 is Iris faster. "
            "Same answers: requests whose answers are equal on both servers (compared "
            "without special-token markers and U+FFFD, which the two detokenizers print "
            "differently).",
            "",
            ratios,
        ]
    inline = ratio_table(runs, INLINE)
    if inline:
        lines += [
            "",
            f"## Iris / {INLINE} (`--mm-encoder-inline --max-itl-stretch 0`)",
            "",
            "The default (the vision encoder beside the steps, prefill beside decodes paced "
            "by `--max-itl-stretch`) over the placement before issue 12 (the encoder inside "
            "the steps, prefill chunks as large as the token budget), same run. "
            "Throughput: above 1 is the default faster. Latencies: below 1 is the default "
            "faster.",
            "",
            inline,
        ]
    before = ratio_table(runs, BEFORE)
    if before:
        lines += [
            "",
            f"## Iris / {BEFORE} (`--before-tree`: commit {checkout_commit(args.before_tree)})",
            "",
            "This tree's defaults over those of the other checkout, same run, same venv. "
            "Throughput: above 1 is this tree faster. Latencies: below 1 is this tree "
            "faster.",
            "",
            before,
        ]
    lines += [
        "",
        "## Compute bound (in-process engine, same cores, no HTTP / IPC)",
        "",
        "Same request count, image size, prompt and answer lengths (each answer as long as "
        "Iris's, EOS ignored) and concurrency; time = JPEG decode + `PromptBuilder` for every "
        "request, then the engine (ViT, prefill, decode). `Iris / bound` is the served "
        "fraction of it.",
        "",
        bound_table(bounds, runs) if bounds else "(not measured: Iris failed)",
        "",
        f"## The peer: {PEER}",
        "",
        peer_note,
        "",
        f"![latency and throughput]({name}.png)",
    ]
    failures = [r for r in runs if r.error]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {r.server} / {r.workload}: `{r.error[-800:]}`" for r in failures]
    commands = [f"- {r.server} / {r.workload}: `{r.command}`" for r in runs if r.command]
    lines += ["", "## Client commands", "", *commands]
    raw = {
        "runs": [
            {k: v for k, v in vars(r).items() if k != "metrics"}
            | {"metrics": _summary_only(r.metrics)}
            for r in runs
        ],
        "bounds": [vars(b) | {"request_throughput": b.request_throughput} for b in bounds],
    }
    (out / f"{name}.json").write_text(json.dumps(raw, indent=1))
    return write_result(
        name,
        f"Served load: Iris vs {PEER}, and the compute bound "
        f"({checkpoint.title})",
        "\n".join(lines), out,
    )  # fmt: skip


def _summary_only(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    if metrics is None:
        return None
    keep = ("input_lens", "output_lens", "errors", "generated_texts")
    return {k: v for k, v in metrics.items() if not isinstance(v, list) or k in keep}


PEER_NOTE = (
    "Hugging Face transformers {version}, `transformers serve` (module "
    "`transformers/cli/serve.py`, handlers in `transformers/cli/serving/`), started as "
    "`python -m bench.transformers_serve_launcher MODEL_DIR --host 127.0.0.1 --port PORT "
    "{flags}`: the stock CLI with the model folder preloaded (`force_model`; requests name "
    "that folder as `model`), offline (`HF_HUB_OFFLINE=1`, a local folder loads without the "
    "hub). One swap: its `AutoProcessor` would also build the model's video processor, "
    "which needs torchvision, absent with the CPU torch; the launcher hands it transformers' "
    "own processor of the folder's architecture, built from its tokenizer and PIL image "
    "processor (`scheduler.tiny_checkpoint.reference_processor`). It needs `accelerate` (its "
    "`[serving]` extra; `device_map` requires it), put by `bench/install_vllm_client.sh` in "
    "`<client venv>/peer-site` and added to its PYTHONPATH only. It generates one request "
    "at a time with `model.generate` (its `--continuous-batching` is for text-only models; "
    "VLMs fall back to sequential), and builds each prompt (image decode, resize, chat "
    "template) on its event loop: requests queue, which is how its users meet it."
)
