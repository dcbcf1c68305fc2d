"""Many images in one request: latency and the scheduler's peak memory as N grows.

One chat request with N distinct JPEGs (N = 1, 2, 4 … `--max-images`: 64 on tiny, 8 on
small, whose 64-image sweep takes ~16 min on 2 cores) and `max_tokens=1`, at each
resolution, against real `iris serve`s on the same generated checkpoint (`--arch`;
Qwen2.5-VL by default), each with a step budget of 512 tokens, all started and then
measured in turns
(`run_interleaved`: one point of one server at a time, the others idle, so a burst of
load from elsewhere hits every variant alike):

- `chunk-aware`: Iris's default lazy encoding with `--max-num-encoder-tokens 512`: a
  prefill chunk encodes only the images it overlaps, one vision-tower call of at most
  512 image tokens at a time (a larger image goes alone);
- `whole request`: `--disable-chunked-mm-encoding`, same budgets: every image of the
  request is encoded in its first chunk (still in calls of at most 512 image tokens);
- `whole request, 1 ViT call` (full runs): `--disable-chunked-mm-encoding` with no
  encoder budget to speak of (`--max-num-encoder-tokens 1048576`): all N images in one
  vision-tower call, the naive baseline.

A resolution's sweep stops at the first N that fails (an HTTP error, e.g. the prompt
over the context length) or runs past the timeout. Per N: TTFT on the client (streamed,
to the first content chunk; with one output token it is the whole request), vision-
tower calls (`iris_mm_encoder_seconds_count`), and the scheduler process's memory from
`/proc/<pid>/status` (no restart per point; see `PeakMemory` for how the peak of one
request is isolated). On the first variant's server each image request is followed by
a text-only completion of the same prompt length (`text only, same tokens`): the memory
and time the text side alone takes. On a GPU the scheduler's
`torch.cuda.max_memory_allocated` (`iris_device_memory_peak_bytes`) is a column too: a
maximum since the server started, so it never falls; N ascends, so it shows growth.

On a GPU (`--model`, a real-size checkpoint of `iris tiny-model --like`), the sweep is
1280x720 up to 64 images with the first two variants, each server a share of the GPU
(`gpu_setting`).

`--media video`: the same sweep with one video of 16, 32 … 256 frames per request instead
of N images, the first two variants (`bench.video_probe`).

    python -m bench.image_probe [--size tiny|small | --model DIR] [--max-images N] [--quick]
        [--media image|video] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from bench import video_probe
from bench.images import image_part
from bench.results_io import (
    RESULTS_DIR,
    Checkpoint,
    add_arch_argument,
    add_common_arguments,
    add_model_argument,
    markdown_table,
    write_result,
)
from bench.server_process import IrisServer, chat_body, delta, run_interleaved, stream_chat

STEP_BUDGET = 512
VARIANTS: list[tuple[str, list[str]]] = [
    ("chunk-aware", ["--max-num-encoder-tokens", "512"]),
    ("whole request", ["--max-num-encoder-tokens", "512", "--disable-chunked-mm-encoding"]),
    (
        "whole request, 1 ViT call",
        ["--max-num-encoder-tokens", str(1 << 20), "--disable-chunked-mm-encoding"],
    ),
]
TEXT_ONLY = "text only, same tokens"  # on the first variant's server
MAX_IMAGES = 64
# The default sweep per size: small's vision tower takes ~1.3 s per 640x480 image on
# 2 cores, so its 64-image sweep runs ~16 min; 8 images already show the contrast (7x).
DEFAULT_MAX_IMAGES = {"tiny": MAX_IMAGES, "small": 8}
# The generated checkpoints' max_position_embeddings: the engine caps the context there.
MAX_MODEL_LEN = 32768
MIB = 1 << 20
SAMPLE_SECONDS = 0.002  # how often the sampler reads /proc/<pid>/status
SEED = 1000  # image seeds: distinct per image, per resolution and per N


@dataclass(frozen=True)
class Setting:
    resolutions: list[tuple[int, int]]
    counts: list[int]  # N, ascending
    variants: list[tuple[str, list[str]]]
    timeout: float  # seconds per request before the sweep of a resolution stops
    flags: list[str]  # for every server
    # (model, resolution, N) -> the request; (resolution, N) of the warm-up requests
    body: Callable[[str, tuple[int, int], int], dict[str, Any]] = lambda *a: body(*a)
    warm_up: tuple[tuple[tuple[int, int], int], ...] = (((96, 64), 1), ((128, 96), 2))


# Enough KV for MAX_MODEL_LEN tokens (the engine caps the context at what the pool holds):
# 16 MiB for the tiny model, 512 MiB for small (8 layers x 2 x 2 KV heads x 128 x fp32).
KV_CACHE_MEMORY = {"tiny": "64MiB", "small": "576MiB"}


def gpu_setting(max_images: int) -> Setting:
    """On a GPU (the campaign's real-size checkpoints): 1280x720 only, up to 64 images
    (76k tokens: the context is the model's own), the two encoding modes, each server a
    share of the GPU (they run at once)."""
    variants = VARIANTS[:2]
    flags = [
        "--max-num-batched-tokens", str(STEP_BUDGET),
        "--limit-mm-per-prompt", str(MAX_IMAGES),
        "--gpu-memory-utilization", f"{0.85 / len(variants):.2f}",
        "--tokenizer-workers", "1",
        "--mm-processor-cache-gb", "1",  # 64 x 2.8 MB of uint8 pixels in flight
    ]  # fmt: skip
    counts = [2**i for i in range(7) if 2**i <= max_images]
    return Setting([(1280, 720)], counts, variants, 240.0, flags)


def setting(quick: bool, size: str, max_images: int) -> Setting:
    flags = [
        "--max-num-batched-tokens", str(STEP_BUDGET),
        "--limit-mm-per-prompt", str(MAX_IMAGES),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory", KV_CACHE_MEMORY[size],
        "--tokenizer-workers", "1",  # one request goes to one worker anyway
    ]  # fmt: skip
    if quick:  # smoke test
        flags += ["--mm-processor-cache-gb", "0.125"]
        return Setting([(224, 224)], [1, 2, 4], VARIANTS[:2], 60.0, flags)
    # 64 images of 640x480 (391 tokens each) fill 25k of the 32k context; 1280x720 (1196
    # tokens each) stops at 32 images (38k tokens > 32768). The arena holds one request's
    # pixels: 64 x 7.3 MiB at 640x480, 16 x 22 MiB at 1280x720.
    flags += ["--mm-processor-cache-gb", "1"]
    counts = [2**i for i in range(7) if 2**i <= max_images]
    return Setting([(640, 480), (1280, 720)], counts, VARIANTS, 240.0, flags)


def video_setting(quick: bool, size: str) -> Setting:
    """`--media video`: one video of N frames per request (`bench.video_probe`)."""
    resolution = video_probe.QUICK_SIZE if quick else video_probe.SIZE
    flags = [
        "--max-num-batched-tokens", str(STEP_BUDGET),
        "--limit-mm-per-prompt", '{"video": 1}',
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory", KV_CACHE_MEMORY[size],
        "--tokenizer-workers", "1",
        "--mm-processor-cache-gb", "0.125" if quick else "1",
    ]  # fmt: skip
    counts = video_probe.QUICK_COUNTS if quick else video_probe.COUNTS
    warm_up = ((resolution, video_probe.WARM_UP_FRAMES),)
    timeout = 60.0 if quick else 240.0
    return Setting([resolution], counts, VARIANTS[:2], timeout, flags, video_probe.body, warm_up)


# -- the scheduler's memory ---------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """`/proc/<pid>/status` memory fields in bytes (VmRSS, VmHWM, RssAnon, RssShmem, ...)."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if rest.endswith("kB") and (key.startswith("Vm") or key.startswith("Rss")):
            values[key] = int(rest.split()[0]) * 1024
    return values


@dataclass
class PeakMemory:
    """The scheduler's memory over one request, from `/proc/<pid>/status`.

    The scheduler maps each tokenizer worker's shared-memory arena and reads pixels from
    it in place, so the pages it reads count in its RSS (`RssShmem`) although they were
    allocated by the worker at start-up: no new memory. The figure that matters is the
    private part, RSS − RssShmem. Before the request `VmHWM` is reset to the current RSS
    (`echo 5 > /proc/<pid>/clear_refs`), so after it `VmHWM` is this request's peak;
    the servers run with `MALLOC_MMAP_THRESHOLD_=65536` so that freed tensors go back to
    the kernel and each request starts from the same baseline. The private peak is
    bounded from below twice: `VmHWM` growth minus the arena pages read during the
    request (exact when they were all read before the peak), and the largest private
    growth seen by a sampler reading the status every 2 ms (exact unless a spike is
    shorter than that); `private_peak` is the larger of the two.
    """

    pid: int
    before: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    sampled_private: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.before = proc_status(self.pid)
        self.sampled_private = private(self.before)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.after = proc_status(self.pid)
        self.sampled_private = max(self.sampled_private, private(self.after))

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            try:
                self.sampled_private = max(self.sampled_private, private(proc_status(self.pid)))
            except (OSError, ValueError):
                return

    @property
    def rss_peak(self) -> int:
        """Peak RSS growth over the request, arena pages included."""
        return self.after.get("VmHWM", 0) - self.before.get("VmRSS", 0)

    @property
    def arena_read(self) -> int:
        """Arena pages that became resident in the scheduler during the request."""
        return self.after.get("RssShmem", 0) - self.before.get("RssShmem", 0)

    @property
    def private_peak(self) -> int:
        return max(self.rss_peak - self.arena_read, self.sampled_private - private(self.before))


def private(status: dict[str, int]) -> int:
    """Resident memory that is not shared. A process on its way out has no memory
    fields in its status (seen once in CI); it then counts as 0, never as a crash."""
    return status.get("VmRSS", 0) - status.get("RssShmem", 0)


def child_pids(server: IrisServer) -> dict[str, int]:
    """The launcher's children by name (`scheduler`, `tokenizer-0`, ...), from its
    "started NAME (pid N)" log lines."""
    pids = {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", server.log)}
    if "scheduler" not in pids:
        raise RuntimeError(f"no scheduler pid in the server log:\n{server.log[-2000:]}")
    return pids


# -- the sweep ----------------------------------------------------------------------------


def body(model: str, size: tuple[int, int], n: int) -> dict[str, Any]:
    width, height = size
    seeds = range(SEED + 1000 * width + 100 * n, SEED + 1000 * width + 100 * n + n)
    content = [image_part(width, height, seed=s) for s in seeds]
    content.append({"type": "text", "text": f"Describe these {n} pictures."})
    return chat_body(model, [{"role": "user", "content": content}], 1, max_pixels=None)


def wait_idle(server: IrisServer, timeout: float) -> bool:
    """Whether the scheduler runs nothing within `timeout` (after a timed-out request)."""
    try:
        server.wait_for_metrics(
            lambda m: (
                m.get("iris_num_requests_running", 0) == 0
                and m.get("iris_num_requests_waiting", 0) == 0
            ),
            timeout=timeout,
        )
    except TimeoutError:
        return False
    return True


def text_body(model: str, tokens: int, n: int) -> dict[str, Any]:
    """A completion whose prompt is `tokens` plain token ids (a pattern per `n`, so the
    prefix cache finds nothing of an earlier one)."""
    prompt = [(7 * i + 13 * n) % 1000 + 10 for i in range(tokens)]
    return {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}


def complete(client: httpx.Client, base_url: str, request: dict[str, Any]) -> tuple[int, float]:
    """(prompt tokens, seconds) of one non-streamed completion."""
    started = time.perf_counter()
    response = client.post(f"{base_url}/v1/completions", json=request)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:2000]}")
    return response.json()["usage"]["prompt_tokens"], seconds


def probe(server: IrisServer, pid: int, row: dict[str, Any], send, device_idle: float) -> bool:
    """Runs `send()` (→ prompt tokens, TTFT) under `PeakMemory`; fills `row`; whether ok.
    `device_idle`: the scheduler's allocated device bytes before the sweep (0 on CPU)."""
    row["load"] = os.getloadavg()[0]
    before = server.metrics()
    try:
        with PeakMemory(pid) as memory:
            prompt_tokens, ttft = send()
    except httpx.TimeoutException:
        row["status"] = "timeout"
        return False
    except RuntimeError as error:  # an HTTP error or an error in the stream
        row["status"] = _short(str(error))
        return False
    after = server.metrics_after(before, generated_tokens=1)
    row.update(
        status="ok",
        prompt_tokens=prompt_tokens,
        ttft=ttft,
        vit_calls=int(delta(after, before, "iris_mm_encoder_seconds_count")),
        rss_peak=memory.rss_peak / MIB,
        arena_read=memory.arena_read / MIB,
        private_peak=memory.private_peak / MIB,
        # CUDA only: torch.cuda.max_memory_allocated since the server started, over idle
        device_peak=(peak - device_idle) / MIB
        if (peak := after.get("iris_device_memory_peak_bytes", 0.0))
        else None,
    )
    return True


def sweep(run: Setting, name: str, server: IrisServer) -> Iterator[list[dict[str, Any]]]:
    """`run_interleaved`'s steps for one server: the rows of one point (N images at one
    resolution) per step. On the first variant's server each image request is followed
    by a text-only completion of the same length (what the text side alone costs)."""
    pid = child_pids(server)["scheduler"]
    text_reference = name == run.variants[0][0]
    limits = httpx.Timeout(run.timeout, connect=10.0)
    with httpx.Client(timeout=limits) as client:
        model = server.model_name()
        # First-call costs out of the measurement: requests the sweep never sends.
        for size, n in run.warm_up:
            stream_chat(client, server.base_url, run.body(model, size, n))
        if text_reference:
            complete(client, server.base_url, text_body(model, 600, 0))
        device_idle = server.metrics().get("iris_device_memory_allocated_bytes", 0.0)
        for size in run.resolutions:
            for n in run.counts:
                row: dict[str, Any] = {"variant": name, "size": size, "n": n}
                request = run.body(model, size, n)

                def chat(request: dict[str, Any] = request) -> tuple[int, float]:
                    answer = stream_chat(client, server.base_url, request)
                    return answer.prompt_tokens, answer.ttft

                if not probe(server, pid, row, chat, device_idle):
                    yield [row]
                    if row["status"] == "timeout" and not wait_idle(server, run.timeout):
                        return  # still busy: the rest would measure it, not itself
                    break
                if not text_reference:
                    yield [row]
                    continue
                text = text_body(model, row["prompt_tokens"], n)
                same = {"variant": TEXT_ONLY, "size": size, "n": n}
                send_text = lambda text=text: complete(client, server.base_url, text)  # noqa: E731
                probe(server, pid, same, send_text, device_idle)
                yield [row, same]


def _short(error: str) -> str:
    match = re.search(r'"message":\s*"([^"]*)"', error)
    text = match.group(1) if match else error
    text = text.replace("|", "/").replace("\n", " ")
    return text[:90] + ("…" if len(text) > 90 else "")


# -- the report ---------------------------------------------------------------------------


def table(run: Setting, results: dict[str, list[dict[str, Any]]]) -> list[list[object]]:
    rows = []
    for size in run.resolutions:
        for name, rows_of in results.items():
            for r in rows_of:
                if r["size"] != size:
                    continue
                row: list[object] = [f"{size[0]}x{size[1]}", name, r["n"]]
                if r["status"] == "ok":
                    row += [r["prompt_tokens"], "ok", round(r["ttft"], 2), r["vit_calls"]]
                    row += [round(r[k], 1) for k in ("rss_peak", "arena_read", "private_peak")]
                    row.append("–" if r["device_peak"] is None else round(r["device_peak"], 1))
                else:
                    row += ["", r["status"], "", "", "", "", "", ""]
                row.append(round(r["load"], 1))
                rows.append(row)
    return rows


HEADER = [
    "resolution", "variant", "images", "prompt tok", "status", "TTFT s", "ViT calls",
    "peak RSS +MiB", "arena read MiB", "peak private +MiB", "device peak +MiB", "load avg",
]  # fmt: skip


def plot(
    run: Setting,
    results: dict[str, list[dict[str, Any]]],
    path: Path,
    title: str,
    unit: str = "images",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = len(run.resolutions)
    fig, axes = plt.subplots(2, columns, figsize=(5.5 * columns, 7), squeeze=False)
    for col, size in enumerate(run.resolutions):
        memory_ax, ttft_ax = axes[0][col], axes[1][col]
        for name, rows_of in results.items():
            ok = [r for r in rows_of if r["size"] == size and r["status"] == "ok"]
            counts = [r["n"] for r in ok]
            style = {"color": "grey", "linestyle": ":"} if name == TEXT_ONLY else {}
            for ax, key in ((memory_ax, "private_peak"), (ttft_ax, "ttft")):
                ax.plot(counts, [r[key] for r in ok], marker="o", label=name, **style)
        memory_ax.set_title(f"{size[0]}x{size[1]}: scheduler peak private memory", fontsize=10)
        memory_ax.set_ylabel("MiB over idle")
        ttft_ax.set_title(f"{size[0]}x{size[1]}: TTFT (max_tokens=1)", fontsize=10)
        ttft_ax.set_ylabel("s (client)")
        for ax in (memory_ax, ttft_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(run.counts, [str(n) for n in run.counts])
            ax.set_xlabel(f"{unit} in the request")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SUMMARY_HEADER = [
    "resolution", "variant", "images (ok)", "peak private +MiB, fewest", "at most",
    "MiB per added image", "TTFT s at most",
]  # fmt: skip


def summary(run: Setting, results: dict[str, list[dict[str, Any]]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for size in run.resolutions:
        for name, rows_of in results.items():
            ok = [r for r in rows_of if r["size"] == size and r["status"] == "ok"]
            if not ok:
                rows.append([f"{size[0]}x{size[1]}", name, "none", "", "", "", ""])
                continue
            first, last = ok[0], ok[-1]
            growth = (last["private_peak"] - first["private_peak"]) / max(last["n"] - first["n"], 1)
            peaks = [round(first["private_peak"], 1), round(last["private_peak"], 1)]
            counts = f"{first['n']}-{last['n']}"
            rows.append(
                [f"{size[0]}x{size[1]}", name, counts, *peaks, round(growth, 2), last["ttft"]]
            )
    return rows


def embedding_note(model_dir: Path, run: Setting, results: dict[str, list[dict[str, Any]]]) -> str:
    """How much holding every embedding of a request at once costs on this checkpoint."""
    config = json.loads((model_dir / "config.json").read_text())
    # Qwen3-VL's entry holds its DeepStack levels beside the main embedding
    levels = len(config["vision_config"].get("deepstack_visual_indexes") or ())
    width = config["vision_config"]["out_hidden_size"] * (1 + levels)
    size = run.resolutions[0]
    tokens = [
        (r["n"], r["prompt_tokens"])
        for rows in results.values()
        for r in rows
        if r["size"] == size and r["status"] == "ok"
    ]
    n, prompt_tokens = max(tokens)
    per_image = prompt_tokens / n * width * 4 / MIB  # fp32 on CPU; text tokens included
    return (
        "By design (`scheduler/encoder/embedding_cache.py`) a request holds each image's embedding "
        "from its first use to the request's end, so at the end of the prefill all N "
        "embeddings are held whichever the variant: tokens x "
        f"{width} (`out_hidden_size`, times 1 + DeepStack levels) x 4 bytes, about {per_image:.2f} MiB per "
        f"{size[0]}x{size[1]} image here, {per_image * n:.1f} MiB for {n}. On Qwen2.5-VL-7B "
        f"(3584 wide, bf16) it would be about {prompt_tokens / n * 3584 * 2 / MIB:.1f} MiB "
        "per image. What chunk-aware encoding bounds is the vision tower's working memory "
        "(pixels copied out of the arena, activations); `--max-num-encoder-tokens` bounds "
        "it as well in `whole request`, which is why the two match. The growth they share "
        "is the text side's: the `text only` rows, plain token ids of the same length on "
        "the chunk-aware server, grow the same way (attention over a longer context per "
        "512-token chunk)."
    )


def report(
    checkpoint: Checkpoint,
    run: Setting,
    results: dict[str, list[dict[str, Any]]],
    png: str,
) -> str:
    flags = " ".join(run.flags)
    variants = "; ".join(f"`{name}`: `{' '.join(f)}`" for name, f in run.variants)
    return "\n".join(
        [
            f"{checkpoint.sentence} One request at a time with N "
            "distinct JPEGs (never seen before by the server) and a short question, "
            f"`max_tokens=1`; N doubles up to {run.counts[-1]} or until a request fails or "
            f"takes longer than {run.timeout:.0f} s (the status then reads `timeout`). After "
            f"each, on the `{run.variants[0][0]}` server, a completion of as many plain "
            "token ids and no image (`text only, same tokens`). Each variant on its own `iris serve`; the "
            "servers are started together, then take turns point by point (one request at "
            "a time, the others idle), after a warm-up of two small-image requests each. "
            "Server flags for all: "
            f"`{flags}`; per variant: {variants}. Servers run with "
            "`MALLOC_MMAP_THRESHOLD_=65536` (see below).",
            "",
            f"![scheduler peak private memory and TTFT vs images per request]({png})",
            "",
            "## Summary",
            "",
            markdown_table(SUMMARY_HEADER, summary(run, results)),
            "",
            "MiB per added image = (peak private at the most images − at the fewest) / "
            "(difference in images). " + embedding_note(checkpoint.model_dir, run, results),
            "",
            "## Per request",
            "",
            markdown_table(HEADER, table(run, results)),
            "",
            "Columns: TTFT = client, request sent → first content chunk (streaming; with "
            "one output token, the whole request; text only: the whole non-streamed "
            "completion); ViT calls = `iris_mm_encoder_seconds` "
            "count delta; memory of the scheduler process from `/proc/<pid>/status`, one "
            "server for the whole sweep, its `VmHWM` reset before each request "
            "(`echo 5 > /proc/<pid>/clear_refs`): peak RSS + = `VmHWM` after the request − "
            "`VmRSS` before; arena read = `RssShmem` growth, pages of the tokenizer "
            "worker's shared-memory arena that the scheduler read pixels from (the worker "
            "allocated them at start-up, so they are not new memory); peak private + = the "
            "peak of RSS − RssShmem over idle, the larger of two lower bounds (peak RSS + − "
            "arena read, and a 2 ms sampler of the status). `MALLOC_MMAP_THRESHOLD_=65536` "
            "makes glibc return freed tensors to the kernel at once, so a request does not "
            "reuse heap that an earlier, larger one left behind (which would hide its "
            "growth). Device peak + = `iris_device_memory_peak_bytes` (the scheduler's "
            "`torch.cuda.max_memory_allocated`, since the server started, so it never "
            "falls; N ascends, so it shows growth) − `iris_device_memory_allocated_bytes` "
            "before the sweep; – on a CPU, where the RSS columns are the measure. Load "
            "avg = the 1-minute load average when the request was sent "
            "(this benchmark's own processes count too): well above the core count, other "
            "processes competed for the cores and TTFT is mostly waiting (the scheduler's "
            "torch runs one intra-op thread per core, and those threads wait on each other "
            "when a core is taken away). The variants take "
            "turns so that such load falls on all of them alike, but one point's TTFT can "
            "still swing several-fold; the memory figures do not depend on the load.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    add_arch_argument(parser)
    add_model_argument(parser)
    parser.add_argument(
        "--max-images",
        type=int,
        choices=[2**i for i in range(7)],
        default=None,
        help=f"largest N (default: {DEFAULT_MAX_IMAGES}); results get a _maxN suffix",
    )
    parser.add_argument(
        "--media",
        choices=("image", "video"),
        default="image",
        help="video: one video of 16 … 256 frames per request (`bench.video_probe`)",
    )
    args = parser.parse_args()
    if args.media == "video":
        video_main(args)
        return
    gpu = torch.cuda.is_available() and not args.quick
    default_max = MAX_IMAGES if gpu else DEFAULT_MAX_IMAGES[args.size]
    max_images = default_max if args.max_images is None else args.max_images
    run = gpu_setting(max_images) if gpu else setting(args.quick, args.size, max_images)
    checkpoint = Checkpoint.of(args)
    model_dir = checkpoint.model_dir
    results = measure(run, model_dir)
    name = f"image_probe_{checkpoint.label}"
    name += f"_max{max_images}" if max_images != default_max else ""
    name += "_quick" if args.quick else ""
    out_dir = args.out or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    png = f"{name}.png"
    title = checkpoint.title
    plot(run, results, out_dir / png, f"N images in one request ({title})")
    write_result(
        name,
        f"N images in one request: TTFT and scheduler peak memory (HTTP, {title})",
        report(checkpoint, run, results, png),
        out_dir,
    )


def measure(run: Setting, model_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every variant's rows, by variant, text-only last."""
    # Read by glibc in the servers' processes (IrisServer copies this environment).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    servers = [(name, IrisServer(model_dir, [*run.flags, *flags])) for name, flags in run.variants]
    by_server = run_interleaved(servers, lambda name, server: sweep(run, name, server))
    every = [row for points in by_server.values() for point in points for row in point]
    results: dict[str, list[dict[str, Any]]] = {}
    for name in [*(name for name, _ in run.variants), TEXT_ONLY]:
        rows = [r for r in every if r["variant"] == name]
        if rows:
            results[name] = rows
    return results


def video_main(args: argparse.Namespace) -> None:
    run = video_setting(args.quick, args.size)
    checkpoint = Checkpoint.of(args)
    results = measure(run, checkpoint.model_dir)
    name = f"image_probe_video_{checkpoint.label}" + ("_quick" if args.quick else "")
    out_dir = args.out or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    png = f"{name}.png"
    plot(run, results, out_dir / png, f"one video of N frames ({checkpoint.title})", "frames")
    summary_table = (video_probe.header(SUMMARY_HEADER), summary(run, results))
    rows = (video_probe.header(HEADER), table(run, results))
    text = video_probe.report(checkpoint, run.flags, run.variants, summary_table, rows, png)
    title = f"One video of N frames: TTFT and scheduler peak memory (HTTP, {checkpoint.title})"
    write_result(name, title, text, out_dir)


if __name__ == "__main__":
    main()
