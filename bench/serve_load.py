"""Served load: `vllm bench serve` against Iris and against `transformers serve`, and the
compute bound of the same work in process.

    bash bench/install_vllm_client.sh       # once: the vLLM client in its own venv
    python -m bench.serve_load [--size tiny|small] [--quick] [--out DIR]
        [--client vllm|builtin] [--vllm PATH] [--no-peer] [--threads N]   # from the repo root

Two workloads, each sent to every server: `image` (`--dataset-name random-mm`: one
1280×720 random-noise JPEG + 200 random text tokens per request, 32 tokens asked back)
and `text` (`--dataset-name random`: 200 tokens in, 32 asked back); 32 requests at most 4
in flight, greedy (`--temperature 0`). The servers, one after the other on the same
generated Qwen2.5-VL checkpoint, each started fresh and warmed up with one image and one
text request of their own:

- Iris: `iris serve` with its defaults (`bench.server_process.IrisServer`);
- the peer: Hugging Face's `transformers serve` on the same folder, device and dtype,
  through `bench.transformers_serve_launcher` (stock CLI; only the processor is built
  without torchvision, see there). It serves a VLM one request at a time: its
  continuous batching is text-only, so the image workload runs as its users meet it.

`vllm bench serve`'s random datasets always send `ignore_eos`, which `transformers serve`
refuses (422, unknown field), so each server gets the requests through its own
`bench.drop_fields_proxy` that removes that field, and answers may stop at EOS: compare
output tokens/s as well as requests/s. Iris is also measured without the proxy
(`iris direct`, `ignore_eos` honoured, fresh seeds): vLLM's usual settings, and the
proxy's cost. Each workload has its own `--seed` (a repeated
seed resends the same images, which Iris's caches would answer); both servers get the
same seed per workload, so they see the same requests (and, greedy in fp32 with Iris's
reference parity, give the same answers).

The compute bound: the same number of requests with images of the same size and the
same prompt and answer lengths (each answer as long as Iris's was, EOS ignored), through
`scheduler.engine.Engine` in this process at the same concurrency: decode the JPEG and
preprocess with `PromptBuilder`, then ViT, prefill and decode — no HTTP, no IPC. Iris's
requests/s over the bound's is the fraction to push towards 1. It runs after the servers
have stopped, on the same cores.

`--client builtin` replaces `vllm bench serve` (1.5 GB; `bash bench/install_vllm_client.sh`
installs it) by a small httpx load generator with the same metrics and definitions
(TTFT to the first chunk with output, TPOT = (latency - TTFT) / (output tokens - 1), ITL
between output chunks) and images from `bench.images`; it sends no `ignore_eos`, so it
needs no proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from bench.images import jpeg_bytes
from bench.results_io import RESULTS_DIR, markdown_table, write_result
from bench.server_process import REPO, IrisServer

INSTALL_HINT = "bash bench/install_vllm_client.sh"
DEFAULT_CLIENT_VENV = (
    Path(os.environ.get("IRIS_CACHE_DIR", Path.home() / ".cache" / "iris")) / "vllm-client"
)
PEER = "transformers serve"
STARTED = time.monotonic()
ENDPOINT = "/v1/chat/completions"


# --- what is sent ----------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int  # random text tokens per request
    output_len: int  # max_completion_tokens
    num_prompts: int
    concurrency: int
    image: tuple[int, int] | None  # (width, height) of the one image per request

    @property
    def dataset(self) -> str:
        return "random-mm" if self.image else "random"


@dataclass(frozen=True)
class Plan:
    workloads: list[Workload]
    iris_flags: list[str]


def plan(size: str, quick: bool, num_prompts: int | None, concurrency: int | None) -> Plan:
    if quick:  # smoke test: a few small requests, a lean server
        n, c = num_prompts or 4, concurrency or 2
        flags = [
            "--tokenizer-workers", "1", "--kv-cache-memory", "64MiB",
            "--mm-processor-cache-gb", "0.125",
        ]  # fmt: skip
        return Plan(
            [Workload("image", 32, 8, n, c, (448, 252)), Workload("text", 32, 8, n, c, None)],
            flags,
        )
    # small: its ViT takes seconds per 1280×720 image on 2 CPU cores, so fewer requests.
    n, c = num_prompts or (32 if size == "tiny" else 8), concurrency or 4
    return Plan(
        [Workload("image", 200, 32, n, c, (1280, 720)), Workload("text", 200, 32, n, c, None)],
        [],
    )


# --- metrics, as `vllm bench serve` defines them ----------------------------------------


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft: float = 0.0  # seconds to the first chunk with output
    latency: float = 0.0  # seconds to the last chunk with output
    itl: list[float] = field(default_factory=list)  # seconds between output chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""


def _ms(values: Sequence[float], prefix: str) -> dict[str, float]:
    values = list(values) or [0.0]
    return {
        f"mean_{prefix}_ms": float(np.mean(values)) * 1000,
        f"median_{prefix}_ms": float(np.median(values)) * 1000,
        f"p99_{prefix}_ms": float(np.percentile(values, 99)) * 1000,
    }


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """The keys of `vllm bench serve --save-result --save-detailed`, from our own results."""
    done = [r for r in results if r.ok]
    output_lens = [r.output_tokens if r.ok else 0 for r in results]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": sum(output_lens),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(output_lens) / duration,
        **_ms([r.ttft for r in done], "ttft"),
        **_ms(tpots, "tpot"),
        **_ms([gap for r in done for gap in r.itl], "itl"),
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": output_lens,
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }


# --- the built-in client ---------------------------------------------------------------


def random_text(tokenizer, rng: np.random.Generator, num_tokens: int) -> str:
    """`num_tokens` random ordinary tokens, decoded (as vLLM's random datasets do)."""
    special = set(tokenizer.all_special_ids)
    ids = [int(t) for t in rng.integers(0, tokenizer.vocab_size, size=num_tokens * 2)]
    return tokenizer.decode([t for t in ids if t not in special][:num_tokens])


def chat_bodies(
    tokenizer, model_name: str, workload: Workload, seed: int, count: int | None = None
) -> list[bytes]:
    """The requests of one run: random text, then the image (vLLM's default order)."""
    from bench.images import image_part

    rng = np.random.default_rng(seed)
    bodies = []
    for i in range(workload.num_prompts if count is None else count):
        content: list[dict[str, Any]] = [
            {"type": "text", "text": random_text(tokenizer, rng, workload.input_len)}
        ]
        if workload.image:
            content.append(image_part(*workload.image, seed=seed * 10_000 + i))
        body = {
            "model": model_name,
            "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": workload.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        bodies.append(json.dumps(body).encode())
    return bodies


def _has_output(choice: dict[str, Any]) -> bool:
    """vLLM's rule: a delta with text, or an empty text that is not the opening role chunk."""
    delta = choice.get("delta") or {}
    if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"):
        return True
    return delta.get("content") == "" and "role" not in delta


async def _send(client: httpx.AsyncClient, url: str, body: bytes) -> RequestResult:
    result = RequestResult(ok=False)
    started = last = time.perf_counter()
    first = True
    headers = {"content-type": "application/json"}
    try:
        async with client.stream("POST", url, content=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error']}"
                    return result
                now = time.perf_counter()
                choices = chunk.get("choices") or []
                if choices and _has_output(choices[0]):
                    result.text += choices[0]["delta"].get("content") or ""
                    if first:
                        result.ttft, first = now - started, False
                    else:
                        result.itl.append(now - last)
                    last = now
                if usage := chunk.get("usage"):
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
    except (httpx.HTTPError, ValueError) as error:
        result.error = repr(error)
        return result
    result.latency = last - started
    result.ok = not first
    if first:
        result.error = "no chunk with output"
    return result


async def _send_all(base_url: str, bodies: Sequence[bytes], concurrency: int):
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def one(body: bytes) -> RequestResult:
            async with gate:
                return await _send(client, base_url + ENDPOINT, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(body) for body in bodies))
        return list(results), time.perf_counter() - started


def run_builtin(base_url: str, bodies: Sequence[bytes], concurrency: int) -> dict[str, Any]:
    results, duration = asyncio.run(_send_all(base_url, bodies, concurrency))
    return summarize(results, duration)


# --- vllm bench serve ------------------------------------------------------------------


def find_vllm(explicit: str | None) -> Path:
    candidates = [explicit, os.environ.get("IRIS_VLLM_CLIENT"), DEFAULT_CLIENT_VENV / "bin/vllm"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    on_path = shutil.which("vllm")
    if on_path:
        return Path(on_path)
    raise SystemExit(
        f"no `vllm` client found (looked at --vllm, $IRIS_VLLM_CLIENT, "
        f"{DEFAULT_CLIENT_VENV}/bin/vllm, PATH). Install it with `{INSTALL_HINT}` "
        "(its own venv, CPU only, ~1.5 GB), or run with --client builtin."
    )


def vllm_command(
    vllm: Path, base_url: str, model_name: str, model_dir: Path, w: Workload, seed: int,
    result_dir: Path, filename: str,
) -> list[str]:  # fmt: skip
    host, port = base_url.removeprefix("http://").split(":")
    command = [
        str(vllm), "bench", "serve", "--backend", "openai-chat", "--endpoint", ENDPOINT,
        "--host", host, "--port", port, "--model", model_name, "--tokenizer", str(model_dir),
        "--dataset-name", w.dataset,
        "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
        "--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.concurrency),
        "--seed", str(seed), "--temperature", "0",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", filename, "--disable-tqdm",
    ]  # fmt: skip
    if w.image:
        width, height = w.image
        command += [
            "--random-mm-base-items-per-request", "1",
            "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-bucket-config", f"{{({height}, {width}, 1): 1.0}}",  # (h, w, frames)
        ]  # fmt: skip
    return command


def run_vllm(command: list[str], result_dir: Path, filename: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = result_dir / (filename + ".log")
    with log.open("w") as out:
        done = subprocess.run(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600, check=False
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve exited with {done.returncode}:\n{log.read_text()[-3000:]}"
        )
    return json.loads((result_dir / filename).read_text())


def noise_jpeg(width: int, height: int, rng: np.random.Generator) -> bytes:
    """An image like `random-mm`'s: i.i.d. uniform RGB noise, JPEG at Pillow's default."""
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


# --- the servers -----------------------------------------------------------------------


class PeerServer(IrisServer):
    """`transformers serve MODEL_DIR` through `bench.transformers_serve_launcher`, started,
    health-checked and stopped the way `IrisServer` does it."""

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "bench.transformers_serve_launcher", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), *self.flags,
        ]  # fmt: skip


class ProxyServer(IrisServer):
    """`bench.drop_fields_proxy` in front of `upstream`, dropping `ignore_eos`."""

    def __init__(self, upstream: str) -> None:
        super().__init__(REPO, ["--drop", "ignore_eos"], start_timeout=60.0)
        self.upstream = upstream

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "bench.drop_fields_proxy", "--upstream", self.upstream,
            "--port", str(self.port), *self.flags,
        ]  # fmt: skip


def peer_site(vllm: Path | None) -> str | None:
    """Where accelerate (which `transformers serve` needs, from transformers[serving])
    comes from: this venv, or the folder bench/install_vllm_client.sh fills."""
    if importlib.util.find_spec("accelerate") is not None:
        return None
    venvs = [vllm.resolve().parent.parent] if vllm else []
    for venv in [*venvs, DEFAULT_CLIENT_VENV]:
        if (venv / "peer-site" / "accelerate").is_dir():
            return str(venv / "peer-site")
    raise RuntimeError(
        "`transformers serve` needs `accelerate` (transformers[serving]); it is not in this "
        f"venv and no <client venv>/peer-site has it. `{INSTALL_HINT}` puts it there, or "
        "`pip install accelerate==1.15.0 psutil==7.2.2` into this venv."
    )


def peer_flags(device: str) -> list[str]:
    """The peer on Iris's device and dtype (Iris: bf16 on CUDA, fp32 on CPU)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "float32" if device == "cpu" else "bfloat16"
    return ["--device", device, "--dtype", dtype]


@dataclass
class Target:
    label: str
    model_name: str  # what requests put in `model`
    base_url: str  # where the client sends (the proxy, with the vllm client)
    direct_url: str  # the server itself
    group: int  # the server's process group (all its processes; not the proxy's)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server's live processes so far."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.group:  # pgrp; utime and stime follow at 11, 12
                total += int(fields[11]) + int(fields[12])
        return total / tick


@contextlib.contextmanager
def serving(server: IrisServer, model_name: str, label: str, proxy: bool) -> Iterator[Target]:
    with server:
        assert server.process is not None
        group = server.process.pid  # started with start_new_session: it leads its group
        if not proxy:
            yield Target(label, model_name, server.base_url, server.base_url, group)
            return
        with ProxyServer(server.base_url) as front:
            yield Target(label, model_name, front.base_url, server.base_url, group)


# --- one server, every workload --------------------------------------------------------


@dataclass
class Run:
    server: str
    workload: str
    seed: int
    metrics: dict[str, Any] | None = None
    command: str = ""
    error: str = ""
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-min, at the start


def measure_server(
    target: Target, workloads: Sequence[Workload], args, model_dir: Path, tokenizer,
    scratch: Path, direct: bool = False,
) -> list[Run]:  # fmt: skip
    """Every workload through `target.base_url`; with `direct`, again straight to the
    server (the vllm client's `ignore_eos` then honoured), each run with its own seed."""
    log(f"{target.label} is up at {target.direct_url}; warming up")
    for w in workloads:  # warm-up: one request per workload, seeds used nowhere else
        warm = Workload(w.name, w.input_len, w.output_len, 1, 1, w.image)
        bodies = chat_bodies(tokenizer, target.model_name, warm, args.seed + 900)
        metrics = run_builtin(target.base_url, bodies, 1)
        if metrics["failed"]:
            raise RuntimeError(f"{target.label}: warm-up failed: {metrics['errors']}")
    runs = [
        measure_one(target, target.label, target.base_url, w, args.seed + i,
                    args, model_dir, tokenizer, scratch)
        for i, w in enumerate(workloads)
    ]  # fmt: skip
    if direct:
        runs += [
            measure_one(target, f"{target.label} direct", target.direct_url, w,
                        args.seed + 100 + i, args, model_dir, tokenizer, scratch)
            for i, w in enumerate(workloads)
        ]  # fmt: skip
    return runs


def measure_one(
    target: Target, label: str, url: str, w: Workload, seed: int, args, model_dir: Path,
    tokenizer, scratch: Path,
) -> Run:  # fmt: skip
    run = Run(label, w.name, seed)
    model_name = target.model_name
    cpu_before = target.cpu_seconds()
    try:
        if args.client == "builtin":
            bodies = chat_bodies(tokenizer, model_name, w, seed)
            run.metrics = run_builtin(url, bodies, w.concurrency)
            run.command = f"built-in client, seed {seed}"
        else:
            filename = f"{label.replace(' ', '_')}-{w.name}.json"
            command = vllm_command(
                args.vllm_path, url, model_name, model_dir, w, seed, scratch, filename
            )
            run.command = shlex.join(command).replace(str(scratch), "$RESULT_DIR")
            run.metrics = run_vllm(command, scratch, filename)
        run.metrics["server_cpu_s"] = target.cpu_seconds() - cpu_before
        if run.metrics["completed"] == 0:
            run.error = f"every request failed: {run.metrics.get('errors', [])[:2]}"
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        run.error = str(error)
    log(f"{label} / {w.name}: {_brief(run)}")
    return run


def log(message: str) -> None:
    print(f"[serve_load +{time.monotonic() - STARTED:.0f}s] {message}", file=sys.stderr, flush=True)


def _brief(run: Run) -> str:
    if run.metrics is None:
        return "FAILED " + run.error[-500:]
    m = run.metrics
    return (
        f"{m['completed']} ok, {m['request_throughput']:.3g} req/s, "
        f"{m['output_throughput']:.3g} tok/s, TTFT {m['mean_ttft_ms']:.0f} ms, "
        f"TPOT {m['mean_tpot_ms']:.1f} ms"
    )


# --- the compute bound -----------------------------------------------------------------


@dataclass
class Bound:
    workload: str
    requests: int
    prompt_tokens: float  # per request
    output_tokens: float  # per request
    preprocess_s: float  # total: JPEG decode + PromptBuilder
    engine_s: float  # total: ViT + prefill + decode at the workload's concurrency

    @property
    def seconds(self) -> float:
        return self.preprocess_s + self.engine_s

    @property
    def request_throughput(self) -> float:
        return self.requests / self.seconds

    @property
    def output_throughput(self) -> float:
        return self.requests * self.output_tokens / self.seconds


def compute_bound(
    model_dir: Path, w: Workload, output_lens: Sequence[int], seed: int, image_source: str
) -> Bound:
    """The workload through the in-process engine: no HTTP, no IPC, no second process."""
    from scheduler.config import EngineConfig
    from scheduler.engine import Engine
    from scheduler.sampling import SamplingParams
    from tokenizer_worker.prompt import PromptBuilder, load_image

    builder = PromptBuilder(model_dir)
    rng = np.random.default_rng(seed)

    def request(i: int) -> tuple[str, bytes | None]:
        text = random_text(builder.tokenizer, rng, w.input_len)
        if not w.image:
            return text, None
        if image_source == "vllm":
            return text, noise_jpeg(*w.image, rng)
        return text, jpeg_bytes(*w.image, seed * 10_000 + i)

    def prepare(text: str, data: bytes | None):
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        images = []
        if data is not None:
            content.append({"type": "image"})
            images.append(load_image(data))
        return builder.build(builder.render_chat([{"role": "user", "content": content}]), images)

    engine = Engine(EngineConfig(model=str(model_dir)))
    warm = [request(-1 - i) for i in range(2)]  # distinct inputs: no cache hits later
    engine.generate([prepare(*r) for r in warm], SamplingParams(temperature=0.0, max_tokens=4))

    inputs = [request(i) for i in range(w.num_prompts)]  # generated outside the timings
    started = time.perf_counter()
    prompts = [prepare(*r) for r in inputs]
    preprocess_s = time.perf_counter() - started

    params = [
        SamplingParams(temperature=0.0, max_tokens=max(1, n), ignore_eos=True) for n in output_lens
    ]
    pending, in_flight = deque(range(len(prompts))), 0
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < w.concurrency:
            i = pending.popleft()
            engine.add_request(f"bound-{i}", prompts[i], params[i])
            in_flight += 1
        in_flight -= sum(out.finished for out in engine.step())
    engine_s = time.perf_counter() - started
    engine.pop_pixels_done()
    return Bound(
        w.name,
        len(prompts),
        statistics.mean(len(p.token_ids) for p in prompts),
        statistics.mean(p.max_tokens for p in params),
        preprocess_s,
        engine_s,
    )


# --- report ----------------------------------------------------------------------------

LATENCIES = [(f"{stat} {metric}", f"{stat}_{metric.lower()}_ms")
             for metric in ("TTFT", "TPOT", "ITL") for stat in ("mean", "median", "p99")]  # fmt: skip


def results_table(runs: Sequence[Run], workloads: Sequence[Workload]) -> str:
    header = ["workload", "server", "load", "ok", "req/s", "out tok/s", "out tok/req"]
    header += ["in tok/req", "server CPU s/req"]
    header += [f"{name} ms" for name, _ in LATENCIES]
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
            *[m[key] for _, key in LATENCIES],
        ])  # fmt: skip
    return markdown_table(header, rows)


def ratio_table(runs: Sequence[Run]) -> str | None:
    by = {(r.server, r.workload): r.metrics for r in runs if r.metrics}
    keys = [("req/s", "request_throughput"), ("out tok/s", "output_throughput")]
    keys += [(name, key) for name, key in LATENCIES if not name.startswith("median")]
    rows = []
    for workload in dict.fromkeys(r.workload for r in runs):
        iris, peer = by.get(("iris", workload)), by.get((PEER, workload))
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


def setup_text(args, plan_: Plan, runs: Sequence[Run], load: tuple[float, float]) -> str:
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
    if args.threads:
        parts.append(f"`OMP_NUM_THREADS={args.threads}` for both servers and the bound.")
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
    args, name: str, plan_: Plan, runs: list[Run], bounds: list[Bound], peer_note: str,
    load: tuple[float, float],
) -> Path:  # fmt: skip
    out = args.out or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, bounds, out / f"{name}.png")
    lines = [setup_text(args, plan_, runs, load), "", "## Served", ""]
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
        name, f"Served load: Iris vs {PEER}, and the compute bound ({args.size})",
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
    "hub). One swap: its `AutoProcessor` would also build the Qwen2-VL video processor, "
    "which needs torchvision, absent with the CPU torch; the launcher hands it transformers' "
    "own Qwen2.5-VL processor built from the folder's tokenizer and PIL image processor "
    "(`scheduler.tiny_checkpoint.reference_processor`). It needs `accelerate` (its "
    "`[serving]` extra; `device_map` requires it), put by `bench/install_vllm_client.sh` in "
    "`<client venv>/peer-site` and added to its PYTHONPATH only. It generates one request "
    "at a time with `model.generate` (its `--continuous-batching` is for text-only models; "
    "VLMs fall back to sequential), and builds each prompt (image decode, resize, chat "
    "template) on its event loop: requests queue, which is how its users meet it."
)


# --- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--quick", action="store_true", help="a few small requests (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--client", choices=["vllm", "builtin"], default="vllm")
    parser.add_argument("--vllm", default=None, help="the `vllm` executable of the client venv")
    parser.add_argument("--no-peer", action="store_true", help=f"skip {PEER}")
    parser.add_argument("--device", default="auto", help="for both servers")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1234, help="workload i uses seed + i")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for both servers and torch threads for the bound "
        "(default: the servers' own choice; the bound uses every core)",
    )
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoTokenizer

    from scheduler.tiny_checkpoint import builtin_checkpoint

    # With the built-in client, --vllm only says where the client venv (and peer-site) is.
    args.vllm_path = (
        find_vllm(args.vllm) if args.client == "vllm" else args.vllm and Path(args.vllm)
    )
    plan_ = plan(args.size, args.quick, args.num_prompts, args.concurrency)
    model_dir = builtin_checkpoint(arch="qwen2_5_vl", size=args.size)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    proxy = args.client == "vllm"
    threads_env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    peer_note = "Not measured (`--no-peer`)."
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
        scratch = Path(tmp)
        iris = IrisServer(
            model_dir,
            ["--served-model-name", "iris", "--device", args.device, *plan_.iris_flags],
            log_path=scratch / "iris.log",
            env=threads_env,
        )
        direct = proxy and not args.quick  # the proxy's cost, and vLLM's own settings
        with serving(iris, "iris", "iris", proxy) as target:
            runs += measure_server(
                target, plan_.workloads, args, model_dir, tokenizer, scratch, direct
            )
        if not args.no_peer:
            flags = peer_flags(args.device)
            peer_note = PEER_NOTE.format(version=transformers.__version__, flags=shlex.join(flags))
            try:
                site = peer_site(args.vllm_path)
                env = {**threads_env, **({"PYTHONPATH": site} if site else {})}
                peer = PeerServer(model_dir, flags, log_path=scratch / "peer.log", env=env)
                with serving(peer, str(model_dir), PEER, proxy) as target:
                    runs += measure_server(
                        target, plan_.workloads, args, model_dir, tokenizer, scratch
                    )
            except (RuntimeError, TimeoutError) as error:
                message = f"{PEER} could not be measured: {error}"
                log(message)
                peer_note += f"\n\n**{message}**"
                runs += [Run(PEER, w.name, args.seed + i, error=str(error)[-2000:])
                         for i, w in enumerate(plan_.workloads)]  # fmt: skip

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    bounds = []
    served = {r.workload: r.metrics for r in runs if r.server == "iris" and r.metrics}
    for i, w in enumerate(plan_.workloads):
        if w.name not in served:
            continue
        lens = served[w.name].get("output_lens") or [w.output_len] * w.num_prompts
        source = "vllm" if args.client == "vllm" else "bench.images"
        log(f"compute bound / {w.name}")
        bounds.append(compute_bound(model_dir, w, lens, args.seed + 500 + i, source))
    name = f"serve_load_{args.size}" + ("_builtin" if args.client == "builtin" else "")
    name += f"_threads{args.threads}" if args.threads else ""
    name += "_quick" if args.quick else ""
    report(args, name, plan_, runs, bounds, peer_note, (load_before, os.getloadavg()[0]))
    if not served:
        raise SystemExit("Iris served no workload; see the failures above")


if __name__ == "__main__":
    main()
