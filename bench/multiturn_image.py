"""Multi-turn chat with one new image per round, over HTTP against real `iris serve`s.

One conversation of 8 rounds: each round adds a user message with one new image
(cycling 1280×720, 1920×1080, 2560×1440 JPEGs) and a question; the assistant's answer
of each round stays in the history, so round k sends k images. Three servers on the
same checkpoint, started one after another (or side by side, their requests in turns,
with `--interleave`), get the same conversation (greedy, fixed answer length):

- `default`: Iris as shipped (per-image processor, embedding and prefix caches);
- `request-granularity`: `--mm-cache-granularity request`, one key over all of a
  request's images, so a new image invalidates the embeddings and KV of all of them
  (the tokenizer workers' processor cache stays per image);
- `caches off`: `--disable-mm-processor-cache --disable-mm-embedding-cache
  --disable-prefix-caching`.

Per round and variant: TTFT on the client (streaming, to the first content chunk) and
on the server (`iris_time_to_first_token_seconds`), images through the vision encoder
and its time (`iris_mm_images_encoded_total`, `iris_mm_encoder_seconds`), the tokenizer
workers' processor-cache hits / misses and images decoded + processed
(`iris_tokenizer_images_total`), and the prompt tokens whose KV came from the prefix
cache (`usage.prompt_tokens_details.cached_tokens`). /metrics has no preprocessing
time, so the workers' time is measured apart, after the servers stopped, by replaying
each server's requests through the same worker code in this process
(`bench.worker_probe`).

    python -m bench.multiturn_image [--size tiny|small] [--rounds 8] [--quick]
                                    [--model DIR] [--interleave] [--out DIR]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.images import FULL_HD, HD, QHD, image_part
from bench.results_io import markdown_table
from bench.scenario import (
    CACHES_OFF,
    QUICK_FLAGS,
    measured_chat,
    probe_warnings,
    replay_through_workers,
    scenario_main,
    setup_sentences,
    warm_up,
)
from bench.server_process import IrisServer, chat_body

VARIANTS: list[tuple[str, list[str]]] = [
    ("default", []),
    ("request-granularity", ["--mm-cache-granularity", "request"]),
    ("caches off", CACHES_OFF),
]
SYSTEM = "You are a careful assistant. Compare each new picture with the earlier ones."
SEED = 100  # image seeds: SEED + round


@dataclass(frozen=True)
class Setting:
    rounds: int
    sizes: list[tuple[int, int]]  # image sizes, cycled
    max_tokens: int  # answer length (ignore_eos: every answer has exactly this many)
    max_pixels: int | None  # mm_processor_kwargs.max_pixels; None: the processor's own
    flags: list[str]  # for every server


def setting(size: str, rounds: int | None, quick: bool) -> Setting:
    if quick:  # smoke test: start-up dominates, so the servers start side by side
        small = [(w // 4, h // 4) for w, h in (HD, FULL_HD, QHD)]
        return Setting(rounds or 2, small, 2, None, QUICK_FLAGS)
    # tiny: the checkpoint's processor caps an image at 1280 tokens (1003520 px);
    # small: 400 tokens per image keeps 8 rounds x 3 servers to minutes on 2 CPU cores.
    max_pixels = None if size == "tiny" else 400 * 28 * 28
    return Setting(rounds or 8, [HD, FULL_HD, QHD], 8, max_pixels, [])


def conversation_round(
    messages: list[dict[str, Any]], round_: int, size: tuple[int, int]
) -> list[dict[str, Any]]:
    question = f"Round {round_}: what is new in this picture?"
    content = [image_part(*size, seed=SEED + round_), {"type": "text", "text": question}]
    return [*messages, {"role": "user", "content": content}]


def requests(run: Setting, name: str, server: IrisServer) -> Iterator[dict[str, Any]]:
    """Warms the server up, then sends the workload's requests one by one, yielding a
    row of measurements after each."""
    with httpx.Client(timeout=600) as client:
        model = server.model_name()

        def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
            return chat_body(model, messages, run.max_tokens, run.max_pixels)

        warm_up(client, server, body([]))
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for round_ in range(1, run.rounds + 1):
            size = run.sizes[(round_ - 1) % len(run.sizes)]
            messages = conversation_round(messages, round_, size)
            text, cost = measured_chat(client, server, body(messages))
            yield {
                "variant": name,
                "round": round_,
                "image": f"{size[0]}x{size[1]}",
                "messages": messages,
                **cost,
            }
            messages = [*messages, {"role": "assistant", "content": text}]


def probe_worker(
    model_dir: Path, rows: list[dict[str, Any]], run: Setting, flags: list[str]
) -> None:
    """Adds `worker_ms` (and `probe_processed`) to one variant's rows (its server's
    requests replayed in process, `replay_through_workers`)."""
    replayed = replay_through_workers(
        model_dir, flags, run.max_pixels, (row["messages"] for row in rows)
    )
    for row, result in zip(rows, replayed, strict=True):
        row["worker_ms"] = 1e3 * result.seconds
        row["probe_processed"] = result.processed


def summary(results: dict[str, list[dict[str, Any]]]) -> list[list[object]]:
    base = sum(r["ttft_ms"] for r in results["default"][1:])
    table = []
    for name, rows in results.items():
        later = rows[1:]  # rounds 2..N: what the caches can save
        ttft = sum(r["ttft_ms"] for r in later)
        prompt = sum(r["prompt_tokens"] for r in later)
        cached = sum(r["cached_tokens"] for r in later)
        table.append(
            [
                name,
                sum(r["ttft_ms"] for r in rows) / 1e3,
                ttft / 1e3,
                ttft / base if base else float("nan"),
                sum(r["encoded"] for r in rows),
                sum(r["vit_ms"] for r in rows) / 1e3,
                sum(r["vit_ms"] for r in rows) / max(1, sum(r["encoded"] for r in rows)),
                sum(r["processed"] for r in rows),
                sum(r["worker_ms"] for r in rows) / 1e3,
                f"{cached}/{prompt} ({cached / prompt:.0%})" if prompt else "0/0",
            ]
        )
    return table


def plot(results: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, rows in results.items():
        ax.plot([r["round"] for r in rows], [r["ttft_ms"] for r in rows], marker="o", label=name)
    ax.set_xlabel("round (images in the request)")
    ax.set_ylabel("TTFT (ms, client)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.set_xticks([r["round"] for r in next(iter(results.values()))])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COLUMNS = [  # (row key, header) of the per-round table
    ("round", "round"),
    ("image", "image"),
    ("variant", "variant"),
    ("prompt_tokens", "prompt tok"),
    ("cached_tokens", "cached tok"),
    ("encoded", "images encoded"),
    ("vit_ms", "ViT ms"),
    ("hits", "proc. cache hits"),
    ("misses", "proc. cache misses"),
    ("processed", "images preprocessed"),
    ("worker_ms", "worker ms"),
    ("ttft_ms", "TTFT ms"),
    ("server_ttft_ms", "server TTFT ms"),
]


def report(
    run: Setting,
    model: str,
    results: dict[str, list[dict[str, Any]]],
    png: str,
    load: tuple[float, float],
    how_run: str,
) -> str:
    order = [name for name, _ in VARIANTS]
    per_round = sorted(
        (row for rows in results.values() for row in rows),
        key=lambda r: (r["round"], order.index(r["variant"])),
    )
    summary_header = [
        "variant", "TTFT all rounds s", f"TTFT rounds 2-{run.rounds} s", "÷ default",
        "images encoded", "ViT s", "ViT ms / image", "images preprocessed", "worker s",
        "cached / prompt tok (2+)",
    ]  # fmt: skip
    notes = []
    prompts = {name: [r["prompt_tokens"] for r in rows] for name, rows in results.items()}
    if len({tuple(p) for p in prompts.values()}) > 1:
        notes.append(f"- WARNING: the variants' prompt lengths differ: {prompts}")
    notes += probe_warnings(results, "round")
    pixels = "processor default" if run.max_pixels is None else f"max_pixels={run.max_pixels}"
    return "\n".join(
        [
            f"{model[0].upper()}{model[1:]}; {run.rounds} rounds, one new JPEG per round "
            f"(cycling {', '.join(f'{w}x{h}' for w, h in run.sizes)}; {pixels}); answers of "
            f"{run.max_tokens} tokens (greedy, ignore_eos) kept in the history. {how_run}; "
            + setup_sentences(run.flags, load),
            "",
            "## Summary",
            "",
            markdown_table(summary_header, summary(results)),
            "",
            f"![TTFT per round]({png})",
            "",
            "## Per round",
            "",
            markdown_table(
                [title for _, title in COLUMNS], [[r[k] for k, _ in COLUMNS] for r in per_round]
            ),
            "",
            "Columns: TTFT ms = client, request sent → first content chunk (streaming); "
            "server TTFT ms = `iris_time_to_first_token_seconds` (arrival → first token); "
            "images encoded / ViT ms = `iris_mm_images_encoded_total` / "
            "`iris_mm_encoder_seconds_sum` deltas; proc. cache hits / misses = "
            "`iris_mm_processor_cache_{hits,misses}_total` deltas (both 0 when the cache is "
            "off: nothing is looked up); images preprocessed = `iris_tokenizer_images_total` "
            "delta (decoded + HF-processed); cached tok = `usage.prompt_tokens_details."
            "cached_tokens`. worker ms: /metrics has no preprocessing time, so this is "
            "`TokenizerWorker.handle` timed in the benchmark's process, after the servers "
            "stopped: the same requests in the same order through the workers that server's "
            "flags give, routed as the server routes (`bench/worker_probe.py`; it excludes "
            "the request's ZMQ transfer from the server).",
            *notes,
        ]
    )


def main() -> None:
    scenario_main(
        "multiturn_image", __doc__, "--rounds", "default 8 (2 with --quick)", VARIANTS,
        setting=setting, requests=requests, probe_worker=probe_worker, plot=plot,
        report=report, title="Multi-turn chat, one new image per round",
        plot_title="Multi-turn, one new image per round",
    )  # fmt: skip


if __name__ == "__main__":
    main()
