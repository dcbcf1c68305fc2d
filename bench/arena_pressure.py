"""Arena pressure: an agent burst of new full-HD screenshots, 8 requests in flight.

Issue 12's goal: "an agent workload of 10 new 1920×1080 screenshots per request at 8 in
flight, with the default arena, finishes every request (no 503)". Each request carries
`--images` NEW distinct 1920×1080 JPEGs (data URLs; no image is shared between requests,
so every one is a processor-cache miss and takes arena room until the scheduler releases
it) and asks for `--max-tokens` tokens (greedy, ignore_eos). All `--requests` are sent
at once (`--concurrency` in flight). The same workload goes to one fresh `iris serve`
per variant, one server after another, default arena (`--mm-processor-cache-gb 1` per
tokenizer worker, 2 workers):

- `wait 0`: `--mm-arena-wait-timeout 0`, the behaviour before arena backpressure (a
  request that finds its worker's arena full of pinned entries gets an immediate 503);
- `wait 30 (default)`: no flag, a request waits up to 30 s for pins to be released.

Per request: HTTP status, error message, client latency, prompt tokens. While the burst
runs, /metrics is polled (every 0.1 s) for the peaks of `iris_shm_arena_waiting_requests`,
`iris_shm_arena_usage_bytes` and `iris_shm_arena_pinned_entries`
(`iris_shm_arena_capacity_bytes` too). /dev/shm is listed before and after.

    python -m bench.arena_pressure [--size tiny] [--requests 8] [--concurrency 8]
                                   [--images 10] [--max-tokens 4] [--flags ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import base64
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.images import FULL_HD, jpeg_bytes
from bench.results_io import add_common_arguments, markdown_table, write_result
from bench.server_process import IrisServer, chat_body
from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint

VARIANTS: list[tuple[str, list[str]]] = [
    ("wait 0 (old: 503 at once)", ["--mm-arena-wait-timeout", "0"]),
    ("wait 30 s (default)", []),
]
SEED = 7000  # request r's image i has seed SEED + r * images + i
GAUGES = {
    "iris_shm_arena_waiting_requests": "waiting",
    "iris_shm_arena_usage_bytes": "usage",
    "iris_shm_arena_pinned_entries": "pinned",
    "iris_shm_arena_capacity_bytes": "capacity",
    "iris_num_requests_running": "running",
}


def shm_entries() -> list[str]:
    try:
        return sorted(os.listdir("/dev/shm"))
    except OSError:
        return []


def request_body(model: str, r: int, images: int, max_tokens: int) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    for i in range(images):
        data = base64.b64encode(jpeg_bytes(*FULL_HD, seed=SEED + r * images + i)).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}})
    text = f"Request {r}: the last {images} screenshots, newest last. Next action?"
    messages = [
        {"role": "system", "content": "You are a computer-use agent. Reply with the next action."},
        {"role": "user", "content": [*parts, {"type": "text", "text": text}]},
    ]
    return chat_body(model, messages, max_tokens, None)


class MetricsPoller:
    """Polls /metrics in a thread, keeping each gauge's peak (and last value)."""

    def __init__(self, server: IrisServer, period: float = 0.1) -> None:
        self.server, self.period = server, period
        self.peak: dict[str, float] = {}
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                seen = self.server.metrics()
            except httpx.HTTPError:
                seen = {}
            self.scrapes += bool(seen)
            for name, key in GAUGES.items():
                if name in seen:
                    self.peak[key] = max(self.peak.get(key, 0.0), seen[name])
            self._stop.wait(self.period)

    def __enter__(self) -> MetricsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def send(client: httpx.Client, url: str, r: int, body: dict[str, Any], t0: float) -> dict:
    started = time.perf_counter()
    row: dict[str, Any] = {"request": r, "start_s": started - t0}
    try:
        response = client.post(url, json=body)
        row["status"] = response.status_code
        payload = response.json() if response.content else {}
        if response.status_code == 200:
            row["prompt_tokens"] = payload.get("usage", {}).get("prompt_tokens")
            row["error"] = ""
        else:
            error = payload.get("error", payload)
            row["error"] = str(error.get("message", error) if isinstance(error, dict) else error)
    except (httpx.HTTPError, ValueError) as error:
        row["status"] = "client error"
        row["error"] = f"{type(error).__name__}: {error}"
    row["latency_s"] = time.perf_counter() - started
    return row


def burst(
    server: IrisServer, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[dict[str, Any]], float, dict[str, float]]:
    url = f"{server.base_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency + 2)
    with httpx.Client(timeout=900, limits=limits) as client:
        # warm-up: one small-image request, so first-call costs stay out of the burst
        warm = {**bodies[0], "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(
                jpeg_bytes(96, 64, seed=9000)).decode()}},
            {"type": "text", "text": "hi"}]}]}  # fmt: skip
        client.post(url, json=warm).raise_for_status()
        with MetricsPoller(server) as poller, ThreadPoolExecutor(concurrency) as pool:
            t0 = time.perf_counter()
            futures = [pool.submit(send, client, url, r, b, t0) for r, b in enumerate(bodies)]
            rows = [f.result() for f in futures]
            wall = time.perf_counter() - t0
        return rows, wall, {**poller.peak, "scrapes": poller.scrapes}


def summary_row(name: str, rows: list[dict], wall: float, peak: dict[str, float]) -> list:
    ok = sum(r["status"] == 200 for r in rows)
    busy = sum(r["status"] == 503 for r in rows)
    gib = 2**30
    return [
        name, len(rows), ok, busy, len(rows) - ok - busy, wall,
        max(r["latency_s"] for r in rows),
        max((r["latency_s"] for r in rows if r["status"] == 200), default=float("nan")),
        int(peak.get("waiting", 0)), int(peak.get("pinned", 0)),
        peak.get("usage", 0) / gib, peak.get("capacity", 0) / gib,
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--images", type=int, default=10, help="new 1920x1080 JPEGs per request")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--flags", nargs=argparse.REMAINDER, default=[], help="extra `iris serve` flags, last"
    )
    args = parser.parse_args()
    if args.quick:  # smoke test: the plumbing, not the pressure
        args.requests, args.concurrency, args.images = 2, 2, 1
    model_dir: Path = builtin_checkpoint(size=args.size)
    shm_before = shm_entries()
    print(f"/dev/shm before: {shm_before}", flush=True)
    bodies = [request_body("", r, args.images, args.max_tokens) for r in range(args.requests)]
    results: dict[str, tuple[list[dict], float, dict[str, float]]] = {}
    for name, flags in VARIANTS:
        server = IrisServer(model_dir, [*flags, *args.flags])
        with server:
            model = server.model_name()
            named = [{**b, "model": model} for b in bodies]
            print(f"{name}: server up, sending {args.requests} requests", flush=True)
            results[name] = burst(server, named, args.concurrency)
        rows, wall, _ = results[name]
        print(f"{name}: {wall:.1f} s, statuses {[r['status'] for r in rows]}", flush=True)
    time.sleep(1.0)  # the launcher sweeps its segments on exit; give the listing a moment
    shm_after = shm_entries()
    print(f"/dev/shm after: {shm_after}", flush=True)

    header = [
        "variant", "requests", "ok (200)", "503", "other", "wall s", "max latency s",
        "max latency of ok s", "peak waiting requests", "peak pinned entries",
        "peak arena used GiB", "arena capacity GiB (all workers)",
    ]  # fmt: skip
    table = [summary_row(name, *results[name]) for name in results]
    per_request = [
        [name, r["request"], r["status"], r.get("prompt_tokens") or "", r["latency_s"],
         (r["error"] or "")[:160].replace("|", "/").replace("\n", " ")]
        for name, (rows, _, _) in results.items() for r in rows
    ]  # fmt: skip
    extra = " ".join(args.flags) or "(none)"
    ok_default = all(r["status"] == 200 for r in results[VARIANTS[1][0]][0])
    body = "\n".join(
        [
            f"Generated Qwen2.5-VL `{args.size}` checkpoint. {args.requests} chat requests "
            f"sent at once ({args.concurrency} in flight), each with {args.images} new "
            f"distinct {FULL_HD[0]}x{FULL_HD[1]} JPEGs (data URLs, processor default "
            f"max_pixels; no image repeats across requests) and max_tokens="
            f"{args.max_tokens} (greedy, ignore_eos). One fresh `iris serve` per variant, "
            f"one after another, default arena (`--mm-processor-cache-gb 1` per tokenizer "
            f"worker, 2 workers unless the extra flags say otherwise); one small warm-up request before each burst. Extra server "
            f"flags for both: `{extra}`. Peaks from /metrics polled every 0.1 s during the "
            f"burst (gauges summed over the workers).",
            "",
            markdown_table(header, table),
            "",
            f"Goal (issue 12: every request finishes with the default arena): "
            f"**{'holds' if ok_default else 'does not hold'}** with the default wait.",
            "",
            "## Per request",
            "",
            markdown_table(
                ["variant", "request", "status", "prompt tok", "latency s", "error"],
                per_request,
            ),
            "",
            f"/dev/shm before the run: `{shm_before}`; after: `{shm_after}`.",
        ]
    )
    name = f"arena_pressure_{args.size}" + ("_quick" if args.quick else "")
    if not args.quick and (args.requests, args.concurrency, args.images) != (8, 8, 10):
        name += f"_{args.requests}req_{args.concurrency}inflight_{args.images}img"
    if args.flags:
        name += "_" + "".join(c if c.isalnum() else "_" for c in " ".join(args.flags)).strip("_")
    write_result(name, f"Arena pressure: {args.images} new full-HD screenshots per "
                 f"request, {args.concurrency} in flight (HTTP, {args.size})", body, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
