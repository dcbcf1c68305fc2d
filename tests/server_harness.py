"""Start a real `iris serve` (all its processes) for end-to-end tests, and check that it
leaves nothing behind: no process and no /dev/shm segment."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.server_process import without_label

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_SECONDS = 180.0
STOP_TIMEOUT_SECONDS = 30.0


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    marker: str
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """`{name or name{labels}: value}` less the `model_name` label (one model)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
            if match:
                key = match.group(1)
                values[without_label(key, "model_name") or key] = float(match.group(2))
        return values

    def wait_for_metrics(self, expected: dict[str, float], timeout: float = 30.0) -> None:
        """Polls /metrics until every named value equals `expected` (bounded)."""
        deadline = time.monotonic() + timeout
        seen: dict[str, float] = {}
        while time.monotonic() < deadline:
            seen = self.metrics()
            if all(seen.get(name) == value for name, value in expected.items()):
                return
            time.sleep(0.05)  # polling an external process; not synchronisation by sleep
        got = {name: seen.get(name) for name in expected}
        raise AssertionError(f"metrics did not settle in {timeout} s: want {expected}, got {got}")

    def children_pids(self) -> list[int]:
        return [pid for pid in processes_with_marker(self.marker) if pid != self.process.pid]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with_marker(marker: str) -> list[int]:
    """Live processes whose environment carries `marker` (the server and its children)."""
    found = []
    needle = f"IRIS_TEST_MARKER={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "State:\tZ" not in status:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def shm_segments(launcher_pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"iris-{launcher_pid}-*")]


@contextlib.contextmanager
def iris_server(model_dir: Path, *args: str, tmp_path: Path) -> Iterator[RunningServer]:
    """`iris serve model_dir *args` on a free port, healthy; stopped on exit. One tokenizer
    worker unless `args` say otherwise (each more costs a start ~2 s on 2 cores): a test of
    what two workers do asks for them."""
    if "--tokenizer-workers" not in args:
        args = ("--tokenizer-workers", "1", *args)
    port = free_port()
    marker = uuid.uuid4().hex
    log_path = tmp_path / f"iris-serve-{port}.log"
    command = [
        sys.executable, "-m", "iris_serve.launch.cli", "serve", str(model_dir),
        "--port", str(port), "--kv-cache-memory", "64MiB", "--mm-shm-arena-bytes", "128MiB",
        *args,
    ]  # fmt: skip
    env = {**os.environ, "IRIS_TEST_MARKER": marker, "HF_HUB_OFFLINE": "1"}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = RunningServer(process, f"http://127.0.0.1:{port}", marker, log_path)
    try:
        _wait_healthy(server)
        yield server
    finally:
        stop(server)


def _wait_healthy(server: RunningServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(
                f"iris serve exited with {server.process.returncode}:\n{server.log}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)  # polling an external process's start-up, bounded above
    raise AssertionError(f"iris serve not healthy in {START_TIMEOUT_SECONDS} s:\n{server.log}")


def stop(server: RunningServer) -> int:
    """SIGTERM the launcher; returns its exit status. Kills everything if it hangs."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        for pid in processes_with_marker(server.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        raise AssertionError(f"iris serve ignored SIGTERM for {STOP_TIMEOUT_SECONDS} s") from None


def wait_until_gone(server: RunningServer, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
    """Asserts that no process of this server and no shared-memory segment remains."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = processes_with_marker(server.marker)
        segments = shm_segments(server.process.pid)
        if not left and not segments:
            return
        time.sleep(0.05)  # polling for process exit, bounded above
    raise AssertionError(f"left behind: processes {left}, /dev/shm {segments}\n{server.log}")
