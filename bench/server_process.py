"""Start and stop a real `iris serve` (all its processes) for a benchmark.

    with IrisServer(model_dir, flags=["--disable-prefix-caching"]) as server:
        httpx.post(f"{server.base_url}/v1/chat/completions", json=...)
        server.metrics()["iris_mm_images_encoded_total"]

`stream_chat` sends one streaming chat completion and times it on the client.

The server runs on a free port of 127.0.0.1 with its output in a log file (`server.log`
reads it; a temporary one is removed after a clean stop). Entering waits, bounded, until
`/health` answers 200; leaving sends SIGTERM and waits for the launcher (which stops its
workers and scheduler and sweeps its /dev/shm segments), killing the whole process group
if it hangs.

`metrics()` scrapes `/metrics` into `{sample name with its labels: value}`; counters
appear under their `_total` names, histograms as `_bucket{le="..."}`, `_sum`, `_count`.
The tokenizer workers and the scheduler push their totals to the server a little after
they change, so read a counter after a request with `metrics_after` (or `wait_for_metrics`, which
polls until a condition holds), not at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.gpu.prepare import SOURCE_DIRS

REPO = Path(__file__).resolve().parents[1]
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Metrics = dict[str, float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> Metrics:
    """Prometheus text format → `{name or name{labels}: value}` (comments skipped), less
    the `model_name` label every sample carries (a server serves one model).

    A data-parallel server (`--data-parallel-size N`, N > 1) labels every engine sample
    `replica="r"`; a sample seen only so labelled also gets the sum over replicas under
    its name without that label (other labels, a histogram's `le`, kept), so the
    benchmarks read `iris_generation_tokens_total` alike whatever the replica count.
    """
    values: Metrics = {}
    summed: Metrics = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        key, value = match.group(1), float(match.group(2))
        key = without_label(key, "model_name") or key
        values[key] = value
        unlabelled = without_label(key, "replica")
        if unlabelled is not None:
            summed[unlabelled] = summed.get(unlabelled, 0.0) + value
    for key, value in summed.items():
        values.setdefault(key, value)  # a sample the server wrote unlabelled wins
    return values


def without_label(key: str, drop: str) -> str | None:
    """`name{...,drop="v",...}` → `name{...}` (`name` when nothing is left); None when
    the sample has no label `drop`."""
    name, brace, labels = key.partition("{")
    if not brace:
        return None
    pairs = _LABEL.findall(labels.removesuffix("}"))
    rest = [f'{label}="{value}"' for label, value in pairs if label != drop]
    if len(rest) == len(pairs):
        return None
    return f"{name}{{{','.join(rest)}}}" if rest else name


PACKAGES = ("ipc", "server", "tokenizer_worker", "scheduler")  # in every Iris tree


def namespace_shim(tree: Path) -> tempfile.TemporaryDirectory:
    """A temporary directory whose `iris_serve/<folder>` links to `tree/<folder>`: on
    PYTHONPATH, `iris_serve.*` imports that tree's code (a path entry is searched before
    the editable install's finder)."""
    missing = [name for name in PACKAGES if not (tree / name / "__init__.py").is_file()]
    if missing:
        raise FileNotFoundError(f"{tree} is not an Iris source tree: no {', '.join(missing)}")
    shim = tempfile.TemporaryDirectory(prefix="iris-tree-")
    package = Path(shim.name) / "iris_serve"
    package.mkdir()
    for name in SOURCE_DIRS:  # this tree's packages; an older tree has fewer
        if (tree / name / "__init__.py").is_file():
            (package / name).symlink_to(tree.resolve() / name, target_is_directory=True)
    return shim


def cli_module(tree: Path | None) -> str:
    """The `iris` command's module in `tree` (this checkout's when None): trees from
    before the composition root keep it in the server package."""
    if tree is not None and not (tree / "launch" / "cli.py").is_file():
        return "iris_serve.server.cli"
    return "iris_serve.launch.cli"


def group_processes(group: int) -> list[tuple[int, list[str]]]:
    """(pid, `/proc/PID/stat` fields after the command name) of every process in process
    group `group`, zombies included: fields[0] is the state, [2] the group, [11] and
    [12] user and system time in clock ticks."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            found.append((int(entry.name), fields))
    return found


def group_rss_bytes(group: int) -> int:
    """The resident set sizes of the live processes of process group `group`, summed
    (shared pages count once per process: a figure to watch grow, not a total)."""
    pages = sum(int(fields[21]) for _, fields in group_processes(group) if fields[0] != "Z")
    return pages * os.sysconf("SC_PAGE_SIZE")


def delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> float:
    """How much one sample grew between two scrapes (a missing sample reads 0)."""
    return after.get(name, 0.0) - before.get(name, 0.0)


class IrisServer:
    """One `iris serve MODEL_DIR *flags` process tree, as a context manager.

    `flags` are passed as they are, after the model and `--port`. `log_path` defaults to
    a temporary file, removed when the server stops with exit status 0 and kept
    otherwise (its path is in the error, and in `log_path`).

    `source_tree`: serve the code of another checkout instead of this one (e.g. `git
    worktree add /tmp/before COMMIT`), through the same venv: its four folders are linked
    as `iris_serve.*` in a temporary directory put first on the server's PYTHONPATH (every
    process of the tree inherits it). Its dependencies must be this venv's.

    Subclasses start other servers the same way (`command`); `label` names the server in
    messages, and `iris_metrics` says whether `/metrics` has Iris's counters.
    """

    label = "iris serve"
    iris_metrics = True

    def __init__(
        self,
        model_dir: str | Path,
        flags: Sequence[str] = (),
        *,
        start_timeout: float = 300.0,
        stop_timeout: float = 30.0,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        source_tree: str | Path | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.flags = list(flags)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._temporary_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"iris-serve-{self.port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self._shim: tempfile.TemporaryDirectory | None = None
        self._cli = cli_module(None if source_tree is None else Path(source_tree))
        if source_tree is not None:
            self._shim = namespace_shim(Path(source_tree))
            self.env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [self._shim.name, self.env.get("PYTHONPATH")])
            )
        self.process: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", self._cli, "serve", str(self.model_dir),
            "--port", str(self.port), *self.flags,
        ]  # fmt: skip

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> IrisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server and wait until `/health` answers 200 (bounded)."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (see `wait_ready`)."""
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killable as one
            )

    def wait_ready(self) -> None:
        """Wait (bounded) until `/health` answers 200; stops the server on failure."""
        try:
            self._wait_healthy()
        except BaseException:
            self._temporary_log = False  # keep it: the error names it
            self.stop()
            raise

    def stop(self) -> int | None:
        """SIGTERM the launcher and wait; SIGKILL its process group if it hangs.
        Returns the launcher's exit status (None if it was never started)."""
        process = self.process
        try:
            if process is None:
                return None
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                status = process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                status = process.wait(timeout=self.stop_timeout)
        finally:
            if self._shim is not None:
                self._shim.cleanup()
        if status == 0 and self._temporary_log:
            self.log_path.unlink(missing_ok=True)
        return status

    def metrics(self) -> Metrics:
        response = httpx.get(f"{self.base_url}/metrics", timeout=10)
        response.raise_for_status()
        return parse_metrics(response.text)

    def wait_for_metrics(
        self, condition: Callable[[Metrics], bool], timeout: float = 30.0
    ) -> Metrics:
        """Polls `/metrics` until `condition(metrics)` holds; returns that scrape."""
        deadline = time.monotonic() + timeout
        while True:
            seen = self.metrics()
            if condition(seen):
                return seen
            if time.monotonic() > deadline:
                raise TimeoutError(f"/metrics did not reach the expected state in {timeout} s")
            time.sleep(0.05)  # polling another process, bounded above

    def metrics_after(
        self, before: Metrics, *, requests: int = 1, generated_tokens: int = 0
    ) -> Metrics:
        """The first scrape in which the workers count `requests` more tokenized requests
        and the scheduler `generated_tokens` more generated tokens than in `before`:
        once a request has finished, its own counts in every process's totals."""
        return self.wait_for_metrics(
            lambda m: (
                delta(m, before, "iris_tokenizer_requests_total") >= requests
                and delta(m, before, "iris_generation_tokens_total") >= generated_tokens
            )
        )

    def model_name(self) -> str:
        """The first served model name (what requests put in `model`)."""
        response = httpx.get(f"{self.base_url}/v1/models", timeout=10)
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.label} exited with {self.process.returncode} (log: {self.log_path}):"
                    f"\n{self.log[-4000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)  # polling another process's start-up, bounded above
        raise TimeoutError(
            f"{self.label} not healthy in {self.start_timeout} s (log: {self.log_path}):\n"
            f"{self.log[-4000:]}"
        )


@dataclass(frozen=True)
class StreamedChat:
    ttft: float  # seconds from sending the request to its first content chunk
    latency: float  # seconds from sending the request to the end of the stream
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    host_cached_tokens: int | None = None  # Iris with a host tier: reloaded from it


def chat_body(
    model: str, messages: list[dict[str, Any]], max_tokens: int, max_pixels: int | None
) -> dict[str, Any]:
    """A greedy chat request whose answer has exactly `max_tokens` tokens."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if max_pixels is not None:
        body["mm_processor_kwargs"] = {"max_pixels": max_pixels}
    return body


def stream_chat(client: httpx.Client, base_url: str, body: dict[str, Any]) -> StreamedChat:
    """POSTs `body` to /v1/chat/completions as a stream (with usage) and times it.

    The body is serialised before the clock starts. TTFT is read at the first chunk
    whose delta has `content`: Iris sends it with the first generated token, whether or
    not that token has printable text yet.
    """
    payload = json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}
    ).encode()
    headers = {"content-type": "application/json"}
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    started = time.perf_counter()
    with client.stream(
        "POST", f"{base_url}/v1/chat/completions", content=payload, headers=headers
    ) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:2000]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"the stream ended in an error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                content = choice.get("delta", {}).get("content")
                if content is not None:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    parts.append(content)
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - started
    if ttft is None or usage is None:
        raise RuntimeError("the stream had no content chunk or no usage")
    details = usage.get("prompt_tokens_details") or {}
    return StreamedChat(
        ttft=ttft,
        latency=latency,
        text="".join(parts),
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=details.get("cached_tokens", 0),
        completion_tokens=usage["completion_tokens"],
        host_cached_tokens=details.get("host_cached_tokens"),
    )


def measure_each(
    servers: Sequence[tuple[str, IrisServer]],
    measure: Callable[[str, IrisServer], Any],
    *,
    overlap_start: bool = False,
    keep_going: bool = False,
) -> dict[str, Any]:
    """`measure(name, server)` for each named server (not started yet: an `IrisServer`
    or a peer's), one at a time, each stopped before the next is measured; returns the
    results by name.

    By default each server starts only after the previous one stopped, so nothing else
    of ours runs while one is measured. `overlap_start=True` launches them all at once
    (their start-ups then share the cores) and still measures one after another, the
    others idle: for smoke tests, where start-up dominates and timings do not matter.
    `keep_going=True`: a server that fails to start or to be measured (RuntimeError,
    TimeoutError) gets that exception as its result, and the next one is measured.
    """
    results: dict[str, Any] = {}
    try:
        if overlap_start:
            for _, server in servers:
                server.launch()
        for name, server in servers:
            try:
                started = time.monotonic()
                if server.process is None:
                    server.launch()
                server.wait_ready()
                _progress(f"{name}: {server.label} ready in {time.monotonic() - started:.1f} s")
                started = time.monotonic()
                results[name] = measure(name, server)
                _progress(f"{name}: measured in {time.monotonic() - started:.1f} s")
            except (RuntimeError, TimeoutError) as error:
                if not keep_going:
                    raise
                _progress(f"{name}: failed: {str(error)[-2000:]}")
                results[name] = error
            finally:
                status = server.stop()
                if status not in (0, None):
                    _progress(f"{name}: {server.label} exited with {status}, log {server.log_path}")
    finally:
        for _, server in servers:
            server.stop()
    return results


def run_interleaved(
    servers: Sequence[tuple[str, IrisServer]],
    steps: Callable[[str, IrisServer], Iterator[Any]],
) -> dict[str, list[Any]]:
    """All the named servers (not started yet) up at once, their measurements taken in
    turns: one item of `steps(name, server)` from each, then the next round, until every
    iterator is exhausted; returns each server's items in order.

    Requests never overlap (one at a time, the other servers idle), and a burst of load
    from outside hits every server alike instead of whichever one ran during it: on a
    shared machine, interleaving keeps the comparison fair where `measure_each` cannot.
    """
    names = [name for name, _ in servers]
    servers = [server for _, server in servers]
    results: dict[str, list[Any]] = {name: [] for name in names}
    try:
        started = time.monotonic()
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
        _progress(f"{len(servers)} servers ready in {time.monotonic() - started:.1f} s")
        started = time.monotonic()
        pending = {name: steps(name, server) for name, server in zip(names, servers, strict=True)}
        while pending:
            for name in [n for n in names if n in pending]:
                try:
                    results[name].append(next(pending[name]))
                except StopIteration:
                    del pending[name]
        _progress(f"measured in turns in {time.monotonic() - started:.1f} s")
    finally:
        for name, server in zip(names, servers, strict=True):
            status = server.stop()
            if status not in (0, None):
                _progress(f"{name}: {server.label} exited with {status}, log {server.log_path}")
    return results


def _progress(line: str) -> None:
    print(f"[bench] {line}", file=sys.stderr, flush=True)
