"""Tables and result file of `bench.peers`: the summary with Iris's lead over each peer
(vLLM's column first), each workload's details, each peer's version and command line."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.results_io import (
    RESULTS_DIR,
    Checkpoint,
    markdown_table,
    write_result,
)
from bench.scenario import WARM_UP
from bench.serve_load_report import _summary_only, results_table

if TYPE_CHECKING:
    from bench.peers import Peer, PeerResult, Plan

HIGHER, LOWER = "higher", "lower"  # which way is better
COLD_METRICS = [
    ("req/s", "request_throughput", HIGHER),
    ("out tok/s", "output_throughput", HIGHER),
    ("mean TTFT ms", "mean_ttft_ms", LOWER),
    ("mean TPOT ms", "mean_tpot_ms", LOWER),
]
ROW_METRICS = [("mean TTFT ms", "ttft_ms"), ("mean E2E ms", "e2e_ms"), ("mean TPOT ms", "tpot")]
MISSING = "–"


def tpot_ms(row: dict[str, Any]) -> float | None:
    """Time per output token after the first, as `vllm bench serve` defines it."""
    tokens = row["completion_tokens"]
    return (row["e2e_ms"] - row["ttft_ms"]) / (tokens - 1) if tokens > 1 else None


def row_means(rows: Sequence[dict[str, Any]], first: int, key: str) -> dict[str, float]:
    """{metric: mean over the rows whose `key` (round or step) is at least `first`}."""
    kept = [r for r in rows if r[key] >= first]
    if not kept:
        return {}
    tpots = [t for t in map(tpot_ms, kept) if t is not None]
    return {
        "ttft_ms": statistics.fmean(r["ttft_ms"] for r in kept),
        "e2e_ms": statistics.fmean(r["e2e_ms"] for r in kept),
        "tpot": statistics.fmean(tpots) if tpots else float("nan"),
    }


def ahead(iris: float | None, peer: float | None, better: str) -> float | str:
    """How many times better Iris is (above 1: Iris ahead), whichever way is better."""
    if iris is None or peer is None or not iris or not peer:
        return MISSING
    return iris / peer if better == HIGHER else peer / iris


def workload_figures(plan: Plan, result: PeerResult) -> dict[str, dict[str, float]]:
    """One peer's summary figures: {workload title: {metric key: value}}."""
    cold = next((run.metrics for run in result.runs if run.metrics), None) or {}
    return {
        _cold_name(plan): cold,
        _history_name(plan): row_means(result.history, plan.history_from, "round"),
        _window_name(plan): row_means(result.window, 1, "step"),
    }


def summary_table(
    plan: Plan, peers: Sequence[Peer], results: dict[str, PeerResult]
) -> tuple[list[str], list[list[object]]]:
    """A row per workload and metric: each peer's figure, then Iris's lead over each
    other peer (in `peers`' order: vLLM's first)."""
    others = [p for p in peers if p.key != "iris"]
    has_iris = len(others) < len(peers)
    header = ["workload", "metric", *(f"{p.label} {p.version}" for p in peers)]
    header += [f"Iris ahead of {p.label}" for p in others] if has_iris else []
    figures = {p.label: workload_figures(plan, results[p.label]) for p in peers}
    agent_metrics = [(name, key, LOWER) for name, key in ROW_METRICS]
    metrics = [COLD_METRICS, agent_metrics, agent_metrics]
    rows: list[list[object]] = []
    for workload, shown in zip(
        workload_figures(plan, results[peers[0].label]), metrics, strict=True
    ):
        for name, key, better in shown:
            values = {label: figures[label][workload].get(key) for label in figures}
            row: list[object] = [workload, name]
            row += [MISSING if values[p.label] is None else values[p.label] for p in peers]
            if has_iris:
                row += [ahead(values["Iris"], values[p.label], better) for p in others]
            rows.append(row)
    return header, rows


def _cold_name(plan: Plan) -> str:
    w = plan.cold
    assert w.image is not None
    return (
        f"cold: {w.num_prompts} × (one new {w.image[0]}×{w.image[1]} image + {w.input_len} "
        f"tok), {w.concurrency} in flight"
    )


def _history_name(plan: Plan) -> str:
    sizes = "/".join(f"{w}×{h}" for w, h in plan.history.sizes)
    return (
        f"agent, growing history: rounds {plan.history_from}-{plan.history.rounds} "
        f"({sizes}, 1 new per round)"
    )


def _window_name(plan: Plan) -> str:
    from bench.agent_repeat import WINDOW

    size = plan.window.size
    return (
        f"agent, sliding window of {WINDOW}: steps 1-{plan.window.steps} "
        f"({size[0]}×{size[1]}, 1 new per step)"
    )


DETAIL = [  # (row key, header); Iris's /metrics counters last
    ("prompt_tokens", "prompt tok"),
    ("cached_tokens", "cached tok"),
    ("completion_tokens", "out tok"),
    ("ttft_ms", "TTFT ms"),
    ("e2e_ms", "E2E ms"),
    ("encoded", "Iris: images encoded"),
    ("vit_ms", "Iris: ViT ms"),
    ("server_ttft_ms", "Iris: server TTFT ms"),
]


def detail_table(peers: Sequence[Peer], results: dict[str, PeerResult], part: str, key: str) -> str:
    rows = sorted(
        (
            (row[key], order, [row[key], peer.label, *(row.get(k, MISSING) for k, _ in DETAIL)])
            for order, peer in enumerate(peers)
            for row in getattr(results[peer.label], part)
        ),
        key=lambda item: item[:2],
    )
    return markdown_table([key, "peer", *(h for _, h in DETAIL)], [r for *_, r in rows])


def setup_text(
    args: argparse.Namespace, plan: Plan, model_dir: Path, load: tuple[float, float]
) -> str:
    client = (
        f"`vllm bench serve` (`{args.vllm_path}`)" if args.vllm_path
        else "the built-in httpx client (`--client builtin`, no `ignore_eos`)"
    )  # fmt: skip
    return (
        f"{Checkpoint.of(args).sentence[:-1]} (`{model_dir.name}`), float32 on every server "
        "on a CPU, bfloat16 on a "
        "GPU. One server at a time, each started fresh with its "
        f"defaults, warmed up ({len(WARM_UP)} small-image requests, and one request of the "
        "cold workload), "
        "measured on the three workloads in the order below, then stopped. Greedy, "
        f"{plan.history.max_tokens} tokens asked back ({plan.cold.output_len} in the cold "
        "workload; `ignore_eos` for Iris and vLLM; `transformers serve` refuses that "
        "field, so its requests go through `bench.drop_fields_proxy`, which turns it into "
        "`generation_config` `min_new_tokens`: see `out tok`). "
        f"Cold workload: {client}, seed {args.seed}, same requests for every server. Agent "
        "workloads one request at a time. Load average (1 min) before / after: "
        f"{load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores."
    )


def report(
    args: argparse.Namespace, plan: Plan, peers: Sequence[Peer], model_dir: Path,
    results: dict[str, PeerResult], load: tuple[float, float],
) -> Path:  # fmt: skip
    out = args.out or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    name = f"peers_{Checkpoint.of(args).label}" + ("_quick" if args.quick else "")
    header, rows = summary_table(plan, peers, results)
    lines = [
        setup_text(args, plan, model_dir, load), "", "## Summary", "",
        "`Iris ahead of X`: how many times better Iris's figure is than X's (X's latency "
        "÷ Iris's, Iris's throughput ÷ X's): above 1, Iris is ahead. Agent rows are means "
        "over the rounds / steps named; TPOT = (E2E - TTFT) / (output tokens - 1).", "",
        markdown_table(header, rows), "",
        "## Peers", "",
        markdown_table(
            ["peer", "version", "started as"],
            [[p.label, p.version, p.how(model_dir)] for p in peers],
        ), "",
        f"## {_cold_name(plan)}", "",
        results_table([run for p in peers for run in results[p.label].runs], [plan.cold]), "",
        f"## Agent, growing history (rounds 1-{plan.history.rounds})", "",
        detail_table(peers, results, "history", "round"), "",
        f"## Agent, sliding window (steps 0-{plan.window.steps})", "",
        detail_table(peers, results, "window", "step"), "",
        "Columns: TTFT = client, request sent → first content chunk (streaming); E2E = "
        "request sent → end of the stream; cached tok = `usage.prompt_tokens_details."
        "cached_tokens` where the server reports it (vLLM only with "
        "`--enable-prompt-tokens-details`, off by default; `transformers serve` never): 0 "
        "otherwise. `Iris: ...` columns are Iris's /metrics deltas per request "
        "(`iris_mm_images_encoded_total`, `iris_mm_encoder_seconds_sum`, "
        "`iris_time_to_first_token_seconds_sum`); the peers have no such counters.",
    ]  # fmt: skip
    failures = [(p.label, e) for p in peers for e in results[p.label].errors]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {label}: `{error[-800:]}`" for label, error in failures]
    commands = [f"- {r.server}: `{r.command}`" for p in peers for r in results[p.label].runs]
    lines += ["", "## Cold workload's client commands", "", *commands]
    raw = {
        p.label: {
            "version": p.version,
            "cold": [
                vars(r) | {"metrics": _summary_only(r.metrics)} for r in results[p.label].runs
            ],
            "history": results[p.label].history,
            "window": results[p.label].window,
            "errors": results[p.label].errors,
        }
        for p in peers
    }
    (out / f"{name}.json").write_text(json.dumps(raw, indent=1))
    labels = ", ".join(p.label for p in peers)
    title = f"Iris and its peers ({labels}), {Checkpoint.of(args).title}"
    return write_result(name, title, "\n".join(lines), out)
