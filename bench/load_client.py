"""The two load generators of `bench.serve_load`, with `vllm bench serve`'s metrics.

- `vllm bench serve` itself (`find_vllm`, `vllm_command`, `run_vllm`), installed in its
  own venv by `bench/install_vllm_client.sh`;
- a small httpx client (`run_builtin`) for where that 1.5 GB venv is absent (CI's smoke
  test): the same metric names and definitions — TTFT to the first chunk with output,
  TPOT = (latency - TTFT) / (output tokens - 1), ITL between output chunks — and
  `summarize` returns the keys of `vllm bench serve --save-result --save-detailed`.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

INSTALL_HINT = "bash bench/install_vllm_client.sh"
DEFAULT_CLIENT_VENV = (
    Path(os.environ.get("IRIS_CACHE_DIR", Path.home() / ".cache" / "iris")) / "vllm-client"
)
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
