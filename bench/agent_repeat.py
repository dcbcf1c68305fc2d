"""An agent re-sending its screenshots: 10 images per request, 9 of them seen before.

A computer-use agent sends, at every step, its last 10 screenshots (1280×720 JPEGs,
newest last) and asks for the next action: step 0 brings 10 new screenshots, every later
step drops the oldest and adds one new one. The window slides, so the first image (and
with it the prompt's prefix) changes at every step: the prefix cache cannot help, the
per-image processor and embedding caches can. Two servers on the same checkpoint,
started one after another (or side by side, their requests in turns, with
`--interleave`), get the same steps (greedy, fixed answer length):

- `cache on`: Iris as shipped;
- `caches off`: `--disable-mm-processor-cache --disable-mm-embedding-cache
  --disable-prefix-caching`.

Per request: the tokenizer workers' work (processor-cache misses, images decoded and
processed), the images run through the vision encoder, TTFT (client, streaming) and
end-to-end latency. /metrics has neither the workers' preprocessing time nor the bytes
they send to the scheduler, so both are measured apart, after the servers stopped, by
the same `TokenizerWorker` code in this process on the same messages
(`bench.worker_probe`): its `handle` time, and the size of the `EngineRequest` it
builds, encoded with the tokenizer→scheduler codec, next to the pixel bytes that
request points at in shared memory.

    python -m bench.agent_repeat [--size tiny|small] [--steps 6] [--quick]
                                 [--model DIR] [--interleave] [--out DIR]
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.images import HD, image_part
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

WINDOW = 10  # screenshots per request
VARIANTS: list[tuple[str, list[str]]] = [("cache on", []), ("caches off", CACHES_OFF)]
SYSTEM = "You are a computer-use agent. Reply with the next action only."
SEED = 500  # screenshot i has seed SEED + i


@dataclass(frozen=True)
class Setting:
    steps: int  # after step 0
    size: tuple[int, int]
    max_tokens: int
    max_pixels: int | None
    flags: list[str]  # for every server


def setting(size: str, steps: int | None, quick: bool) -> Setting:
    if quick:  # smoke test: start-up dominates, so the servers start side by side
        return Setting(steps or 2, (320, 180), 2, None, QUICK_FLAGS)
    # tiny: the processor's own cap (1280x720 is 1196 tokens, 12k per request);
    # small: 256 tokens per screenshot keeps a step to seconds on 2 CPU cores.
    max_pixels = None if size == "tiny" else 256 * 28 * 28
    return Setting(steps or 6, HD, 8, max_pixels, [])


def step_messages(step: int, run: Setting) -> list[dict[str, Any]]:
    """Screenshots step .. step+WINDOW-1, newest last, and the question."""
    shots = [image_part(*run.size, seed=SEED + i) for i in range(step, step + WINDOW)]
    text = f"Step {step}: the last {WINDOW} screenshots, newest last. Next action?"
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [*shots, {"type": "text", "text": text}]},
    ]


def requests(run: Setting, name: str, server: IrisServer) -> Iterator[dict[str, Any]]:
    """Warms the server up, then sends the workload's requests one by one, yielding a
    row of measurements after each."""
    with httpx.Client(timeout=600) as client:
        model = server.model_name()

        def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
            return chat_body(model, messages, run.max_tokens, run.max_pixels)

        warm_up(client, server, body([]))
        for step in range(run.steps + 1):
            request = body(step_messages(step, run))
            _, cost = measured_chat(client, server, request)
            yield {
                "variant": name,
                "step": step,
                "new_images": WINDOW if step == 0 else 1,
                "body_bytes": len(json.dumps(request)),
                **cost,
            }


def probe_worker(
    model_dir: Path, rows: list[dict[str, Any]], run: Setting, flags: list[str]
) -> None:
    """Adds the workers' time and wire sizes to one variant's rows (its server's
    requests replayed in process, `replay_through_workers`)."""
    replayed = replay_through_workers(
        model_dir, flags, run.max_pixels, (step_messages(row["step"], run) for row in rows)
    )
    for row, result in zip(rows, replayed, strict=True):
        row["worker"] = result.worker
        row["worker_ms"] = 1e3 * result.seconds
        row["wire_bytes"] = result.wire_bytes
        row["pixel_bytes"] = result.pixel_bytes
        row["probe_processed"] = result.processed


def summary(results: dict[str, list[dict[str, Any]]]) -> list[list[object]]:
    """Means over the steady steps (1..N: 9 seen + 1 new), and each ÷ the cache-on one."""

    def mean(name: str, key: str) -> float:
        return statistics.fmean(r[key] for r in results[name][1:])

    base = next(iter(results))
    table = []
    for name in results:
        table.append(
            [
                name,
                mean(name, "misses"),
                mean(name, "processed"),
                mean(name, "worker_ms"),
                mean(name, "worker_ms") / mean(base, "worker_ms"),
                mean(name, "encoded"),
                mean(name, "vit_ms"),
                mean(name, "vit_ms") / mean(name, "encoded"),
                mean(name, "ttft_ms"),
                mean(name, "ttft_ms") / mean(base, "ttft_ms"),
                mean(name, "e2e_ms"),
                mean(name, "e2e_ms") / mean(base, "e2e_ms"),
                round(mean(name, "wire_bytes")),
                round(mean(name, "pixel_bytes")),
                round(mean(name, "body_bytes")),
            ]
        )
    return table


def plot(results: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, rows in results.items():
        steps = [r["step"] for r in rows]
        (line,) = ax.plot(steps, [r["e2e_ms"] for r in rows], marker="o", label=f"{name}: E2E")
        ax.plot(
            steps,
            [r["ttft_ms"] for r in rows],
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{name}: TTFT",
        )
    ax.set_xlabel("step (0: 10 new screenshots; then 9 seen + 1 new)")
    ax.set_ylabel("ms (client)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.set_xticks([r["step"] for r in next(iter(results.values()))])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COLUMNS = [  # (row key, header) of the per-request table
    ("step", "step"),
    ("variant", "variant"),
    ("new_images", "new images"),
    ("prompt_tokens", "prompt tok"),
    ("cached_tokens", "cached tok"),
    ("worker", "worker"),
    ("misses", "proc. cache misses"),
    ("processed", "images preprocessed"),
    ("worker_ms", "worker ms"),
    ("wire_bytes", "→ scheduler bytes"),
    ("pixel_bytes", "pixel bytes in shm"),
    ("encoded", "images encoded"),
    ("vit_ms", "ViT ms"),
    ("ttft_ms", "TTFT ms"),
    ("e2e_ms", "E2E ms"),
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
    per_step = sorted(
        (row for rows in results.values() for row in rows),
        key=lambda r: (r["step"], order.index(r["variant"])),
    )
    header = [title for _, title in COLUMNS]
    rows = [[r[key] for key, _ in COLUMNS] for r in per_step]
    base = order[0]
    summary_header = [
        "variant", "proc. cache misses", "images preprocessed", "worker ms", f"÷ {base}",
        "images encoded", "ViT ms", "ViT ms / image", "TTFT ms", f"÷ {base}", "E2E ms",
        f"÷ {base}", "→ scheduler bytes", "pixel bytes in shm", "HTTP body bytes",
    ]  # fmt: skip
    notes = probe_warnings(results, "step")
    pixels = "processor default" if run.max_pixels is None else f"max_pixels={run.max_pixels}"
    return "\n".join(
        [
            f"{model[0].upper()}{model[1:]}; {WINDOW} screenshots of "
            f"{run.size[0]}x{run.size[1]} per request ({pixels}), a sliding window: step 0 "
            f"sends {WINDOW} new ones, steps 1-{run.steps} drop the oldest and add one new. "
            f"Answers of {run.max_tokens} tokens (greedy, ignore_eos). {how_run}; "
            + setup_sentences(run.flags, load),
            "",
            f"## Summary (means over steps 1-{run.steps})",
            "",
            markdown_table(summary_header, summary(results)),
            "",
            f"![TTFT and end-to-end latency per step]({png})",
            "",
            "## Per request",
            "",
            markdown_table(header, rows),
            "",
            "Columns: proc. cache misses / images preprocessed = "
            "`iris_mm_processor_cache_misses_total` / `iris_tokenizer_images_total` deltas "
            "(with the cache off nothing is looked up, so misses stay 0 and every image is "
            "preprocessed); images encoded / ViT ms = `iris_mm_images_encoded_total` / "
            "`iris_mm_encoder_seconds_sum` deltas; TTFT = "
            "client, request sent → first content chunk (streaming); E2E = request sent → "
            "end of the stream. Not in /metrics, measured apart after the servers stopped "
            "with `bench/worker_probe.py`: the same requests in the same order, in the "
            "benchmark's process, through the workers that server's flags give, routed as "
            "the server routes (worker = the one picked): worker ms = "
            "`TokenizerWorker.handle` time (messages → `EngineRequest`, without the "
            "request's ZMQ transfer from the server); → scheduler bytes = that "
            "`EngineRequest` encoded with the tokenizer→scheduler codec (token ids as int32 "
            "bytes + per image a key, span, grid and shared-memory pointer); pixel bytes in "
            "shm = the pixel_values those pointers name, which stay in the worker's arena. "
            "HTTP body bytes = the JSON request (base64 JPEGs) the client sends.",
            "",
            "Routing: the server sends a request to the tokenizer worker most of its images "
            "were sent to before (`server/image_router.py`): the first image changes at "
            "every step of this sliding window, but the other nine went to the worker of "
            "the step before, so the window stays on one worker (1 miss per step).",
            *notes,
        ]
    )


def main() -> None:
    scenario_main(
        "agent_repeat", __doc__, "--steps", "default 6 (2 with --quick)", VARIANTS,
        setting=setting, requests=requests, probe_worker=probe_worker, plot=plot,
        report=report, title="Agent re-sending screenshots: 10 images per request, 9 seen",
        plot_title="Agent, 10 screenshots per request, 9 seen",
    )  # fmt: skip


if __name__ == "__main__":
    main()
