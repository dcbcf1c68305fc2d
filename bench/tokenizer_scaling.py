"""Image preprocessing throughput with 1, 2 and 4 tokenizer workers, under concurrent load.

The same workload against real `iris serve`s on the same generated checkpoint (`--arch`;
Qwen2.5-VL by default), differing only in `--tokenizer-workers`: R chat requests of K
images each, every image a distinct JPEG the server has never seen (processor cache on, all misses),
at most C requests in flight, `max_tokens=1`. The servers are all started, then loaded
in turn (`run_interleaved`), one at a time while the others sit idle, for a few rounds
with new images each round (the best round counts): on a shared machine a burst of
someone else's work then hits every server alike instead of whichever ran at that
moment. The
images are downscaled by `mm_processor_kwargs.max_pixels` to a few tokens each, so the
work per image is mostly the tokenizer worker's (base64 and JPEG decode, xxh3_128, HF
image processor, copy into the arena) and the scheduler's prefill stays small.

Per load, from the first request sent:

- `workers img/s`: images / time until the workers' `iris_tokenizer_images_total` reaches
  the workload's count (`/metrics` polled every 50 ms; a worker pushes its totals after
  every request it serves, so this end is late by at most a poll);
- `answered img/s`: images / time until the last response (includes the scheduler).

A request whose images are all new goes to the worker picked by a hash of its first
image URL (`server.image_router`); the split this gives is computed here with the
server's own hash and shown as requests per worker. On a machine with P cores, expect
the worker rate to stop growing at about P workers (fewer, as the server and the
scheduler share them).

    python -m bench.tokenizer_scaling [--size tiny|small] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.image_probe import child_pids
from bench.images import HD, image_part
from bench.results_io import (
    ARCH_TITLES,
    RESULTS_DIR,
    add_arch_argument,
    add_common_arguments,
    checkpoint_label,
    markdown_table,
    write_result,
)
from bench.server_process import IrisServer, chat_body, delta, run_interleaved, stream_chat
from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint
from iris_serve.server.image_router import affinity_hash, image_urls

SEED = 5000  # workload image seeds: SEED + i
WARM_SEED = 90000  # warm-up image seeds (never in the workload)


@dataclass(frozen=True)
class Setting:
    workers: list[int]
    size: tuple[int, int]  # JPEG size sent
    max_pixels: int  # mm_processor_kwargs.max_pixels: what the processor resizes to
    requests: int
    images_per_request: int
    concurrency: int  # requests in flight at most
    repeats: int  # loads per server, interleaved across the servers; the best one counts
    flags: list[str]  # for every server

    @property
    def images(self) -> int:
        return self.requests * self.images_per_request


def setting(quick: bool) -> Setting:
    flags = ["--kv-cache-memory", "64MiB", "--mm-shm-arena-bytes", "256MiB"]
    if quick:  # smoke test
        return Setting([1, 2], (640, 480), 16 * 28 * 28, 8, 2, 8, 1, flags)
    return Setting([1, 2, 4], HD, 16 * 28 * 28, 64, 2, 32, 3, flags)


def body(model: str, run: Setting, seeds: range) -> dict[str, Any]:
    content = [image_part(*run.size, seed=s) for s in seeds]
    content.append({"type": "text", "text": "What is in these pictures?"})
    return chat_body(model, [{"role": "user", "content": content}], 1, run.max_pixels)


def worker_of(request: dict[str, Any], workers: int) -> int:
    """The tokenizer worker the server routes `request` to: all its images are new, so
    the one its first image's hash picks (`server.image_router`)."""
    urls = image_urls(request["messages"])
    assert urls, "every request of this benchmark has images"
    return affinity_hash(urls[0]) % workers


def workload(model: str, run: Setting, repeat: int) -> list[dict[str, Any]]:
    """The requests of one load: new images for every repeat, the same for every server."""
    k = run.images_per_request
    first = SEED + repeat * run.images
    return [
        body(model, run, range(first + i * k, first + (i + 1) * k)) for i in range(run.requests)
    ]


def warm_up(client: httpx.Client, server: IrisServer, model: str, run: Setting, workers: int):
    """First-call costs out of the measurement: one small-image request routed to each
    worker (its seed picked with the server's routing hash), none in the workload."""
    todo = set(range(workers))
    seed = WARM_SEED
    while todo:
        request = {**body(model, run, range(seed, seed + 1)), "mm_processor_kwargs": {}}
        request["messages"][0]["content"][0] = image_part(96, 64, seed=seed)
        seed += 1
        worker = worker_of(request, workers)
        if worker in todo:
            stream_chat(client, server.base_url, request)
            todo.discard(worker)


async def send_all(base_url: str, payloads: list[bytes], concurrency: int) -> list[dict]:
    limit = asyncio.Semaphore(concurrency)
    headers = {"content-type": "application/json"}
    connections = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=connections) as client:

        async def one(payload: bytes) -> dict:
            async with limit:
                response = await client.post(
                    f"{base_url}/v1/chat/completions", content=payload, headers=headers
                )
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
            return response.json()

        return await asyncio.gather(*(one(p) for p in payloads))


def watch_workers(server: IrisServer, target: float, started: float) -> float:
    """Seconds from `started` until `iris_tokenizer_images_total` reaches `target`."""
    server.wait_for_metrics(
        lambda m: m.get("iris_tokenizer_images_total", 0.0) >= target,
        timeout=600,
    )
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (`/proc/<pid>/stat`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(server: IrisServer) -> dict[str, float]:
    """CPU seconds so far of the HTTP server (the launcher), the scheduler and the
    tokenizer workers together."""
    assert server.process is not None
    children = child_pids(server)
    workers = [pid for name, pid in children.items() if name.startswith("tokenizer-")]
    return {
        "server": cpu_seconds(server.process.pid),
        "scheduler": cpu_seconds(children["scheduler"]),
        "workers": sum(cpu_seconds(pid) for pid in workers),
    }


def load_once(run: Setting, server: IrisServer, repeat: int) -> dict[str, Any]:
    """One load (the whole workload) against `server`, timed; its counters and CPU."""
    workers = int(server.flags[server.flags.index("--tokenizer-workers") + 1])
    requests = workload(server.model_name(), run, repeat)
    payloads = [json.dumps(r).encode() for r in requests]  # serialised before the clock
    split = Counter(worker_of(r, workers) for r in requests)
    before = server.metrics()
    target = before.get("iris_tokenizer_images_total", 0.0) + run.images
    load = os.getloadavg()[0]
    cpu_before = cpu_by_role(server)
    client_before = time.process_time()

    async def timed() -> tuple[list[dict], float, float]:
        started = time.perf_counter()
        watcher = asyncio.create_task(asyncio.to_thread(watch_workers, server, target, started))
        answers = await send_all(server.base_url, payloads, run.concurrency)
        answered = time.perf_counter() - started
        # Every answer implies its images were preprocessed: a total pushed late reads as
        # the end of the load at the latest.
        return answers, answered, min(await watcher, answered)

    answers, answered, preprocessed = asyncio.run(timed())
    after = server.metrics_after(before, requests=run.requests, generated_tokens=run.requests)
    cpu = {role: t - cpu_before[role] for role, t in cpu_by_role(server).items()}
    cpu["client"] = time.process_time() - client_before
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    return {
        "workers": workers,
        "preprocessed_s": preprocessed,
        "answered_s": answered,
        "worker_rate": run.images / preprocessed,
        "answered_rate": run.images / answered,
        "processed": int(delta(after, before, "iris_tokenizer_images_total")),
        "misses": int(delta(after, before, "iris_mm_processor_cache_misses_total")),
        "hits": int(delta(after, before, "iris_mm_processor_cache_hits_total")),
        "tokens_per_request": prompt_tokens / len(answers),
        "split": [split.get(i, 0) for i in range(workers)],
        "cpu": cpu,
        "load": load,
    }


def loads(run: Setting, name: str, server: IrisServer) -> Iterator[dict[str, Any]]:
    """`run_interleaved`'s steps for one server: a warm-up, then `run.repeats` loads."""
    workers = int(server.flags[server.flags.index("--tokenizer-workers") + 1])
    with httpx.Client(timeout=600) as client:
        warm_up(client, server, server.model_name(), run, workers)
    for repeat in range(run.repeats):
        result = load_once(run, server, repeat)
        _progress(f"{name}: load {repeat + 1}/{run.repeats}: {result['worker_rate']:.1f} img/s")
        yield result


def best_loads(by_server: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per server its best load (highest workers img/s), with every load's rates."""
    results = {}
    for name, runs in by_server.items():
        best = max(runs, key=lambda r: r["worker_rate"])
        results[name] = {
            **best,
            "all_worker_rates": [r["worker_rate"] for r in runs],
            "all_answered_rates": [r["answered_rate"] for r in runs],
            "all_loads": [r["load"] for r in runs],
        }
    return results


def _progress(line: str) -> None:
    print(f"[bench] {line}", file=sys.stderr, flush=True)


def table(results: dict[str, dict[str, Any]]) -> list[list[object]]:
    base = next(iter(results.values()))
    rows = []
    for r in results.values():
        rows.append(
            [
                r["workers"],
                round(r["preprocessed_s"], 2),
                round(r["worker_rate"], 1),
                round(r["worker_rate"] / base["worker_rate"], 2),
                " / ".join(f"{rate:.1f}" for rate in r["all_worker_rates"]),
                round(cores_busy(r), 2),
                round(r["answered_s"], 2),
                round(r["answered_rate"], 1),
                round(r["answered_rate"] / base["answered_rate"], 2),
                r["processed"],
                f"{r['misses']} / {r['hits']}",
                " / ".join(str(n) for n in r["split"]),
                round(1e3 * r["cpu"]["workers"] / r["processed"], 1),
                round(r["cpu"]["workers"], 1),
                round(r["cpu"]["scheduler"], 1),
                round(r["cpu"]["server"], 1),
                round(r["cpu"]["client"], 1),
                " / ".join(f"{load:.1f}" for load in r["all_loads"]),
            ]
        )
    return rows


HEADER = [
    "tokenizer workers", "workers done s", "workers img/s", "÷ 1 worker",
    "workers img/s, each load", "cores busy", "answered s",
    "answered img/s", "÷ 1 worker", "images preprocessed", "proc. cache misses / hits",
    "requests per worker", "worker CPU ms/img", "CPU s: workers", "scheduler", "server",
    "client", "load avg, each load",
]  # fmt: skip


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [r["workers"] for r in results.values()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(workers, [r["worker_rate"] for r in results.values()], marker="o",
            label="workers done (preprocessing), best load")  # fmt: skip
    ax.plot(workers, [r["answered_rate"] for r in results.values()], marker="x",
            linestyle="--", label="answered (incl. scheduler), that load")  # fmt: skip
    every = [(r["workers"], rate) for r in results.values() for rate in r["all_worker_rates"]]
    ax.scatter(*zip(*every, strict=True), s=12, color="grey", label="workers done, each load")
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.set_xlabel("tokenizer workers")
    ax.set_ylabel("images / s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cores_busy(r: dict[str, Any]) -> float:
    """CPU seconds of all this benchmark's processes over the load's wall time."""
    return sum(r["cpu"].values()) / r["answered_s"]


def reading(results: dict[str, dict[str, Any]]) -> str:
    """What bounds the rate: the workers' CPU per image against the cores and the load."""
    rows = list(results.values())
    cores = os.cpu_count() or 1
    images = sum(r["processed"] for r in rows)
    per_image = sum(r["cpu"]["workers"] for r in rows) / images
    costs = [1e3 * r["cpu"]["workers"] / r["processed"] for r in rows]
    others = {role: 1e3 * sum(r["cpu"][role] for r in rows) / images
              for role in ("scheduler", "server", "client")}  # fmt: skip
    single = rows[0]["cpu"]["workers"] / rows[0]["preprocessed_s"]
    busy = ", ".join(f"{cores_busy(r):.1f} with {r['workers']}" for r in rows[1:])
    loads = [load for r in rows for load in r["all_loads"]]
    return (
        f"Reading: a worker spends {min(costs):.0f}-{max(costs):.0f} ms of CPU per image "
        f"({1e3 * per_image:.0f} on average), so {cores} cores would bound the workers "
        f"alone at about {cores / per_image:.0f} images/s; per image the scheduler spends "
        f"{others['scheduler']:.0f} ms, the HTTP server {others['server']:.0f} ms and "
        f"this load generator (on the same cores) {others['client']:.0f} ms. The single "
        f"worker was busy {100 * single:.0f}% of the time. This benchmark's processes kept "
        f"{cores_busy(rows[0]):.1f} of the {cores} cores busy with {rows[0]['workers']} "
        f"worker(s), {busy}: once that reaches {cores}, more workers cannot help, so expect "
        f"the rate to flatten at about {cores} workers on {cores} idle cores. The 1-minute "
        f"load average was {min(loads):.1f}-{max(loads):.1f}, this benchmark's own "
        "processes included; well above the cores-busy figure, other jobs competed, and "
        "more worker processes then take a larger share of the contended cores: a gain "
        f"past {cores} workers would come from that, not from the work scaling."
    )


def report(
    title: str, size: str, run: Setting, results: dict[str, dict[str, Any]], png: str
) -> str:
    tokens = round(next(iter(results.values()))["tokens_per_request"])
    return "\n".join(
        [
            f"Generated {title} `{size}` checkpoint. {run.requests} chat requests of "
            f"{run.images_per_request} images each ({run.images} distinct {run.size[0]}x"
            f"{run.size[1]} JPEGs, none seen before, processor cache on), at most "
            f"{run.concurrency} in flight, `max_tokens=1`, `mm_processor_kwargs.max_pixels="
            f"{run.max_pixels}` ({tokens} prompt tokens per request). Each worker count on "
            "its own `iris serve`: the servers are started together, then each warmed up "
            "(one small-image request per worker) and loaded in turn, one at a time (the "
            f"others idle), {run.repeats} round(s) with new images each round, so that the "
            "machine's background load falls on every server alike; the table shows each "
            "server's best load (highest workers img/s) and every load's rate. Server flags "
            f"for all: `{' '.join(run.flags)}`; this machine has {os.cpu_count()} cores.",
            "",
            f"![images/s vs tokenizer workers]({png})",
            "",
            markdown_table(HEADER, table(results)),
            "",
            "Columns: workers done = first request sent → the workers' "
            "`iris_tokenizer_images_total` reaches the workload's count (`/metrics` polled "
            "every 50 ms; late by up to ~0.15 s); answered = first request "
            "sent → last response; ÷ 1 worker = rate over the 1-worker server's; images "
            "preprocessed and processor-cache misses / hits = /metrics deltas; requests per "
            "worker = the server's routing (hash of the first image URL) on this workload; CPU "
            "s = user + system time (`/proc/<pid>/stat`) of the tokenizer workers together, "
            "the scheduler, the HTTP server (the launcher process) and this client (its "
            "requests and its `/metrics` polling) from the first request sent to the last "
            "counter read, cores busy = all of that CPU over the load's wall time (answered s), "
            "and worker CPU ms/img = the workers' "
            "CPU over the images they processed: the cost of one image, far less "
            "sensitive to the load than the rates; load avg = the 1-minute load average "
            "when each load began (this benchmark's own processes count too; well above the "
            "core count, other processes competed for the cores).",
            "",
            reading(results),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    add_arch_argument(parser)
    args = parser.parse_args()
    run = setting(args.quick)
    model_dir = builtin_checkpoint(arch=args.arch, size=args.size)
    variants = [
        (f"{w} worker{'s' * (w > 1)}", ["--tokenizer-workers", str(w)]) for w in run.workers
    ]
    by_server = run_interleaved(
        model_dir,
        variants,
        lambda name, server: loads(run, name, server),
        common_flags=run.flags,
    )
    results = best_loads(by_server)
    name = f"tokenizer_scaling_{checkpoint_label(args.arch, args.size)}" + (
        "_quick" if args.quick else ""
    )
    out_dir = args.out or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    png = f"{name}.png"
    plot(results, out_dir / png, f"Preprocessing throughput vs tokenizer workers ({args.size})")
    write_result(
        name,
        f"Image preprocessing throughput vs tokenizer workers (HTTP, {ARCH_TITLES[args.arch]} "
        f"{args.size})",
        report(ARCH_TITLES[args.arch], args.size, run, results, png),
        out_dir,
    )


if __name__ == "__main__":
    main()
