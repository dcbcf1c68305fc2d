"""Tables and result file of `bench.serve_load` (and `bench.peers`): the means over rounds
with the first server's lead over each other one, every run, the agent and video
workloads' requests, the compute bound, a worker's video decoding, and how each server
was started."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.compute_bound import Bound
from bench.encode_gaps import GapsWorkload
from bench.results_io import RESULTS_DIR, Checkpoint, markdown_table, write_result
from bench.video_decoding import DecodeRate
from bench.video_scenario import VideoWorkload

if TYPE_CHECKING:
    from bench.serve_load import Plan, Server

HIGHER, LOWER = "higher", "lower"  # which way is better
MISSING = "–"
RANDOM = [
    ("req/s", "request_throughput", HIGHER),
    ("out tok/s", "output_throughput", HIGHER),
    ("mean TTFT ms", "mean_ttft_ms", LOWER),
    ("mean TPOT ms", "mean_tpot_ms", LOWER),
    ("p99 ITL ms", "p99_itl_ms", LOWER),
]
AGENT = [
    ("mean TTFT ms", "mean_ttft_ms", LOWER),
    ("mean E2E ms", "mean_e2e_ms", LOWER),
    ("mean TPOT ms", "mean_tpot_ms", LOWER),
]
VIDEO = [  # the first request (the cold video), the later ones, the whole conversation
    ("cold TTFT ms", "cold_ttft_ms", LOWER),
    ("cold E2E ms", "cold_e2e_ms", LOWER),
    *AGENT,
    ("all requests E2E ms", "total_e2e_ms", LOWER),
]
GAPS = [  # the `gaps` workload (bench.encode_gaps): a stream while new images encode
    ("largest gap while images encode ms", "max_gap_ms", LOWER),
    ("median gap while images encode ms", "median_gap_ms", LOWER),
    ("median gap before them ms", "quiet_gap_ms", LOWER),
    ("images' mean TTFT ms", "mean_ttft_ms", LOWER),
]
DECODE = [
    ("median ITL ms", "median_itl_ms", LOWER),
    ("mean TPOT ms", "mean_tpot_ms", LOWER),
    ("mean TTFT ms", "mean_ttft_ms", LOWER),
]
RUN_COLUMNS = [  # (header, metrics key) of the every-run table
    ("req/s", "request_throughput"), ("out tok/s", "output_throughput"),
    ("mean TTFT ms", "mean_ttft_ms"), ("p99 TTFT ms", "p99_ttft_ms"),
    ("mean TPOT ms", "mean_tpot_ms"), ("median ITL ms", "median_itl_ms"),
    ("p99 ITL ms", "p99_itl_ms"), ("mean E2E ms", "mean_e2e_ms"),
    ("images encoded / req", "images_encoded"),
]  # fmt: skip
DETAIL = [  # (row key, header) of an agent or video workload's requests; Iris's /metrics last
    ("prompt_tokens", "prompt tok"), ("cached_tokens", "cached tok"),
    ("host_cached_tokens", "Iris: from host tier tok"),
    ("completion_tokens", "out tok"), ("ttft_ms", "TTFT ms"), ("e2e_ms", "E2E ms"),
    ("encoded", "Iris: images encoded"), ("vit_ms", "Iris: ViT ms"),
    ("server_ttft_ms", "Iris: server TTFT ms"),
]  # fmt: skip
TURN = {
    "append": "round", "window": "step", "agents": "round (agent)", "video": "question",
    "clips": "clip",
}  # fmt: skip
AGENTS = [  # the `agents` workload: AGENT, and where its prompt tokens came from
    *AGENT,
    ("prefix cache hit rate", "prefix_hit_rate", HIGHER),
    ("of it, host tier", "host_hit_rate", HIGHER),
    ("host tier copy µs / KV page", "host_copy_us_per_page", LOWER),
    ("Iris: server RSS growth MiB", "server_rss_growth_mib", LOWER),
]


@dataclass
class Run:
    """One workload sent to one server once: its summary metrics, or the error."""

    server: str
    workload: str
    round: int
    seed: int
    metrics: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)  # an agent workload's requests
    command: str = ""
    error: str = ""
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-min, at the start


def metrics_of(workload: str) -> list[tuple[str, str, str]]:
    if workload == "video":
        return VIDEO
    if workload == "agents":
        return AGENTS
    if workload in ("append", "window", "clips"):
        return AGENT
    if workload == "gaps":
        return GAPS
    return DECODE if workload.startswith("decode") else RANDOM


def means(runs: Sequence[Run], server: str, workload: str) -> dict[str, float]:
    """Each metric's mean over the rounds `server` completed of `workload`."""
    done = [r.metrics for r in runs if (r.server, r.workload) == (server, workload) and r.metrics]
    keys = {k for m in done for k, v in m.items() if isinstance(v, int | float)}
    return {k: statistics.fmean(m[k] for m in done if k in m) for k in keys}


def ahead(first: float | None, other: float | None, better: str) -> float | str:
    """How many times better `first` is than `other` (above 1: `first` ahead)."""
    if not first or not other:
        return MISSING
    return first / other if better == HIGHER else other / first


def summary_table(servers: Sequence[str], runs: Sequence[Run]) -> str:
    base, others = servers[0], servers[1:]
    header = ["workload", "metric", *servers, *(f"{base} ahead of {o}" for o in others)]
    rows = []
    for workload in dict.fromkeys(r.workload for r in runs):
        figures = {s: means(runs, s, workload) for s in servers}
        for label, key, better in metrics_of(workload):
            values = [figures[s].get(key) for s in servers]
            row: list[object] = [workload, label, *(MISSING if v is None else v for v in values)]
            row += [ahead(values[0], figures[o].get(key), better) for o in others]
            rows.append(row)
    return markdown_table(header, rows)


def runs_table(runs: Sequence[Run], plan: Plan) -> str:
    sizes = {w.name: getattr(w, "num_prompts", None) or w.turns for w in plan.workloads}
    header = ["workload", "server", "round", "load", "ok", *(h for h, _ in RUN_COLUMNS)]
    header += ["out tok/req", "in tok/req", "server CPU s/req"]
    rows = []
    for run in runs:
        n = sizes.get(run.workload, "?")
        if run.metrics is None:
            rows.append([run.workload, run.server, run.round, run.load, f"0/{n}", "failed"])
            rows[-1] += [""] * (len(header) - len(rows[-1]))
            continue
        m = run.metrics
        done = max(m["completed"], 1)
        rows.append([
            run.workload, run.server, run.round, run.load, f"{m['completed']}/{n}",
            *(m.get(key, MISSING) for _, key in RUN_COLUMNS), m["total_output_tokens"] / done,
            m["total_input_tokens"] / done, m["server_cpu_s"] / done,
        ])  # fmt: skip
    return markdown_table(header, rows)


def detail_table(runs: Sequence[Run], workload: str) -> str:
    """Every request of an agent or video workload, by round, then turn, then server;
    `clips` names each request's clip beside its number."""
    entries = sorted(
        (((run.round, row["turn"]), [
            _turn(row, workload),
            run.server, run.round, *(row.get(k, MISSING) for k, _ in DETAIL),
        ]) for run in runs if run.workload == workload for row in run.rows),
        key=lambda entry: entry[0],
    )  # fmt: skip
    header = [TURN[workload], "server", "run", *(h for _, h in DETAIL)]
    return markdown_table(header, [row for _, row in entries])


def _turn(row: dict[str, Any], workload: str) -> object:
    if workload == "clips":
        return f"{row['turn']} ({row['clip']})"
    return f"{row['turn']} ({row['agent']})" if "agent" in row else row["turn"]


def gaps_table(servers: Sequence[str], runs: Sequence[Run]) -> str:
    """Per server: each round's largest gap in order, their median and their maximum."""
    rows = []
    for server in servers:
        largest = [
            r.metrics["max_gap_ms"]
            for r in runs
            if (r.server, r.workload) == (server, "gaps") and r.metrics
        ]
        if largest:
            rounds = ", ".join(f"{x:.0f}" for x in largest)
            rows.append([server, rounds, statistics.median(largest), max(largest)])
    return markdown_table(["server", "largest gap per round ms", "median ms", "max ms"], rows)


def bound_table(bounds: Sequence[Bound], runs: Sequence[Run], base: str) -> str:
    header = [
        "workload", "requests", "prompt tok/req", "out tok/req", "preprocess ms/req",
        "engine ms/req", "bound req/s", "bound out tok/s", f"{base} req/s", f"{base} / bound",
    ]  # fmt: skip
    rows = []
    for b in bounds:
        served = means(runs, base, b.workload).get("request_throughput")
        rows.append([
            b.workload, b.requests, b.prompt_tokens, b.output_tokens,
            1000 * b.preprocess_s / b.requests, 1000 * b.engine_s / b.requests,
            b.request_throughput, b.output_throughput,
            MISSING if served is None else served,
            MISSING if served is None else served / b.request_throughput,
        ])  # fmt: skip
    return markdown_table(header, rows)


def setup_text(
    args: argparse.Namespace, checkpoint: Checkpoint, plan: Plan, load: tuple[float, float]
) -> str:
    client = (
        f"`vllm bench serve` (`{args.vllm_path}`; it sends `ignore_eos`)"
        if args.client == "vllm"
        else "the built-in httpx client (no `ignore_eos`: answers may stop at EOS)"
    )
    parts = [checkpoint.sentence]
    for w in plan.workloads:
        if isinstance(w, VideoWorkload | GapsWorkload):
            parts.append(w.describe())
        elif getattr(w, "agents", 1) > 1:
            parts.append(f"`{w.name}`: {w.agents} agents taking turns, {w.turns} rounds each "
                         f"(one request at a time, one new {w.size[0]}×{w.size[1]} screenshot "
                         f"per round, the history kept), {w.max_tokens} tokens back "
                         f"(`ignore_eos`), summary over rounds {w.summary_from} on (agents "
                         "coming back).")  # fmt: skip
        elif getattr(w, "turns", None):
            parts.append(f"`{w.name}`: {w.turns} requests one at a time, "
                         f"{w.size[0]}×{w.size[1]} screenshots, {w.max_tokens} tokens back "
                         f"(`ignore_eos`), summary over turns {w.summary_from} on.")  # fmt: skip
        elif w.name.startswith("decode"):
            parts.append(f"`{w.name}`: {w.num_prompts} distinct prompts of {w.input_len} "
                         f"random tokens at once, {w.output_len} tokens each (`ignore_eos`), "
                         "built-in client.")  # fmt: skip
        else:
            image = f" + one new {w.image[0]}×{w.image[1]} JPEG" if w.image else ""
            parts.append(f"`{w.name}`: {w.num_prompts} requests of {w.input_len} random "
                         f"tokens{image}, at most {w.concurrency} in flight, {w.output_len} "
                         f"tokens back, {client}.")  # fmt: skip
    order = "all up at once, measured in turns" if getattr(args, "interleave", False) else (
        "one after another, each stopped before the next starts")  # fmt: skip
    parts.append(
        f"Greedy; servers warmed up, {order}; {plan.rounds} round(s), new requests each, "
        "the same for every server. `server CPU s/req`: user + system CPU seconds of the "
        "server's processes per completed request. `load`: the 1-minute load average as a "
        f"run started ({os.cpu_count()} cores), {load[0]:.2f} before, {load[1]:.2f} after."
    )
    return " ".join(parts)


def decoding_table(rates: Sequence[DecodeRate]) -> str:
    header = [
        "video workload", "clip", "MP4 KiB", "frames", "size", "decoded", "sampled", "resized to",
        "decode ms", "resize ms", "decoded frames/s", "resized frames/s", "× real time",
    ]  # fmt: skip
    rows = [
        [r.workload, r.span, r.mp4_bytes / 1024, r.frames, "×".join(map(str, r.size)), r.decoded,
         r.sampled, "×".join(map(str, r.resized)), 1e3 * r.decode_s, 1e3 * r.resize_s,
         r.decoded / r.decode_s, r.sampled / r.resize_s, r.seconds / r.total_s]
        for r in rates
    ]  # fmt: skip
    return markdown_table(header, rows)


def report(
    args: argparse.Namespace, checkpoint: Checkpoint, name: str, plan: Plan,
    servers: Sequence[Server], runs: list[Run], bounds: list[Bound], load: tuple[float, float],
    rates: Sequence[DecodeRate] = (),
) -> Path:  # fmt: skip
    out = args.out or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    names = [s.name for s in servers]
    lines = [
        setup_text(args, checkpoint, plan, load), "",
        "## Summary (means over rounds)", "",
        f"`{names[0]} ahead of X`: X's latency ÷ {names[0]}'s, {names[0]}'s throughput ÷ "
        f"X's: above 1, {names[0]} is better. Agent and video rows: means over the turns "
        "named above; `cold`: a video workload's first request; `all requests E2E`: the sum "
        "over its requests; TPOT = (E2E - TTFT) / (output tokens - 1).", "",
        summary_table(names, runs), "",
        "## Servers", "",
        markdown_table(
            ["server", "started as", "RSS MiB, warmed up",
             "linear weights per rank (÷ dense, its dtype)"],
            [[s.name, s.how, "–" if s.rss_mib is None else s.rss_mib, s.weights or "–"]
             for s in servers],
        ), "",
        "## Every run", "", runs_table(runs, plan),
    ]  # fmt: skip
    for workload in TURN:
        if any(r.rows for r in runs if r.workload == workload):
            lines += ["", f"## `{workload}`, each request", "", detail_table(runs, workload)]
            if workload in ("video", "clips"):
                lines += ["", "`Iris: images encoded`: temporal patches (two frames each)."]
    if rates:
        lines += [
            "", "## Video decoding, one tokenizer worker (in process)", "",
            "Each video workload's first clip (round 0) through Iris's own decoding and "
            "resizing (`bench.video_decoding`), one torch and one FFmpeg thread as in a "
            f"worker, the servers stopped; median of {rates[0].repeats} run(s). `decoded`: "
            "frames decoded, every one up to the last sampled; `× real time`: seconds of "
            "video per second of decoding and resizing.", "",
            decoding_table(rates),
        ]  # fmt: skip
    if any(r.metrics for r in runs if r.workload == "gaps"):
        lines += [
            "", "## `gaps`, the largest gap of each round", "",
            "A round's largest gap takes the machine's hiccups too: the median over rounds "
            "is the figure to compare.", "", gaps_table(names, runs),
        ]  # fmt: skip
    hybrid = hybrid_state_table(checkpoint.model_dir)
    if hybrid:
        lines += ["", "## Hybrid model: state beside the KV (Iris, float32)", "", hybrid]
    if bounds:
        lines += [
            "", "## Compute bound (in-process engine, same cores, no HTTP / IPC)", "",
            "Same request count, image size, prompt and answer lengths and concurrency; time "
            "= JPEG decode + `PromptBuilder` for every request, then the engine.", "",
            bound_table(bounds, runs, names[0]),
        ]  # fmt: skip
    failures = [f"- {r.server} / {r.workload}: `{r.error[-800:]}`" for r in runs if r.error]
    if failures:
        lines += ["", "## Failures", "", *failures]
    commands = {r.command for r in runs if r.command.startswith("vllm") or "/vllm " in r.command}
    if commands:
        lines += ["", "## Client commands", "", *(f"- `{c}`" for c in sorted(commands))]
    raw = {
        "runs": [vars(r) | {"metrics": _summary_only(r.metrics)} for r in runs],
        "bounds": [vars(b) | {"request_throughput": b.request_throughput} for b in bounds],
        "video_decoding": [vars(r) for r in rates],
    }
    (out / f"{name}.json").write_text(json.dumps(raw, indent=1))
    title = f"Served load: {', '.join(names)} ({checkpoint.title})"
    return write_result(name, title, "\n".join(lines), out)


def hybrid_state_table(model_dir: Path) -> str | None:
    """A hybrid checkpoint's linear-attention state per request and per snapshot (one
    slot each) beside its KV per token, at Iris's CPU dtype; None for another model."""
    import torch

    from iris_serve.scheduler import hybrid_footprint

    footprint = hybrid_footprint(model_dir, torch.float32)
    if footprint is None:
        return None
    slot, kv = footprint.state_bytes_per_slot, footprint.kv_bytes_per_token
    rows = [
        ["linear-attention state per request (its working slot)", f"{slot / 1024:.1f} KiB"],
        ["per snapshot (the prefix cache's)", f"{slot / 1024:.1f} KiB"],
        [f"KV per token ({footprint.num_kv_layers} full-attention layers of "
         f"{footprint.num_layers})", f"{kv / 1024:.2f} KiB"],
        ["one state in tokens of KV", f"{slot / kv:.0f}"],
    ]  # fmt: skip
    return markdown_table(["what", "bytes"], rows)


def _summary_only(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    if metrics is None:
        return None
    keep = ("input_lens", "output_lens", "errors")
    return {k: v for k, v in metrics.items() if not isinstance(v, list) or k in keep}
