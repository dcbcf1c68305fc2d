"""A Dynamo fleet on one machine, for tests and benchmarks: NVIDIA Dynamo's frontend
(its KV router or round-robin) and N `iris serve --dynamo` workers on 127.0.0.1, with
file discovery, the TCP request plane and the ZMQ event plane (no etcd, no NATS).

Needs `ai-dynamo` (the frontend) beside `ai-dynamo-runtime`: `pip install 'iris-serve[dynamo]'`
then `pip install --no-deps ai-dynamo==1.6.1` (docs/scale-out.md says why `--no-deps`).
Every process gets a marker in its environment, so that `stop` finds them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_SECONDS = 240.0
STOP_TIMEOUT_SECONDS = 30.0


@dataclass
class FleetProcess:
    name: str
    process: subprocess.Popen
    url: str  # the frontend's API, or an Iris worker's /health and /metrics
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        """One unlabelled figure of an Iris worker's /metrics (summed over its labels)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@dataclass
class DynamoFleet:
    frontend: FleetProcess
    workers: list[FleetProcess]
    marker: str
    env: dict[str, str] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)  # processes a test killed on purpose

    def kill(self, worker: FleetProcess) -> None:
        """SIGKILL a worker's whole process group (launcher and children at once)."""
        self.killed.add(worker.name)
        os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait(timeout=STOP_TIMEOUT_SECONDS)

    @property
    def base_url(self) -> str:
        return self.frontend.url

    def live_instances(self) -> int:
        """Workers the frontend can route to now (its /health's `generate` instances)."""
        try:
            health = httpx.get(f"{self.base_url}/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(1 for i in health.get("instances", ()) if i.get("endpoint") == "generate")

    def wait_for_instances(self, count: int, timeout: float = START_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for process in (self.frontend, *self.workers):
                if process.name not in self.killed and process.process.poll() is not None:
                    code = process.process.returncode
                    raise AssertionError(f"{process.name} exited ({code}):\n{process.log[-5000:]}")
            if self.live_instances() == count:
                return
            time.sleep(0.1)  # polling other processes' start-up, bounded above
        logs = "\n".join(f"--- {p.name}\n{p.log[-3000:]}" for p in (self.frontend, *self.workers))
        raise AssertionError(f"the frontend did not see {count} worker(s) in {timeout} s\n{logs}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fleet_env(run_dir: Path, marker: str) -> dict[str, str]:
    """Dynamo's settings for a one-machine fleet (file discovery under `run_dir`)."""
    return {
        **os.environ,
        "DYN_FILE_KV": str(run_dir / "discovery"),
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_LOG": os.environ.get("DYN_LOG", "warn,dynamo_llm::kv_router=info"),
        "DYN_SELF_HOST_METADATA": "0",
        "HOME": str(run_dir),  # the frontend copies model cards under ~/.cache/dynamo
        # ... but Iris's cache (built-in checkpoints, compiled CPU kernels) stays the user's
        "IRIS_CACHE_DIR": os.environ.get("IRIS_CACHE_DIR") or str(Path.home() / ".cache/iris"),
        "HF_HUB_OFFLINE": "1",
        "IRIS_TEST_MARKER": marker,
    }


@contextlib.contextmanager
def dynamo_fleet(
    model_dir: Path,
    run_dir: Path,
    *,
    workers: int = 2,
    router_mode: str = "kv",
    worker_args: Sequence[str] = (),
) -> Iterator[DynamoFleet]:
    """The frontend and `workers` Iris workers, all serving `model_dir`; stopped on exit."""
    run_dir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    env = fleet_env(run_dir, marker)
    frontend = start_frontend(router_mode, run_dir, env)
    fleet = DynamoFleet(frontend, [], marker, env)
    try:
        for index in range(workers):
            fleet.workers.append(
                start_worker(f"iris-{index}", model_dir, worker_args, run_dir, env)
            )
        fleet.wait_for_instances(workers)
        yield fleet
    finally:
        stop(fleet)


def stop(fleet: DynamoFleet) -> None:
    """SIGTERM every process (workers first: they leave discovery), then what is left."""
    for process in (*fleet.workers, fleet.frontend):
        if process.process.poll() is None:
            process.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    for process in (*fleet.workers, fleet.frontend):
        try:
            process.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.process.kill()
            process.process.wait(timeout=STOP_TIMEOUT_SECONDS)


def start_frontend(
    router_mode: str, run_dir: Path, env: dict, name: str = "frontend"
) -> FleetProcess:
    """Dynamo's frontend on a free loopback port (`--router-mode kv|round-robin|random`)."""
    port = free_port()
    command = [sys.executable, "-m", "dynamo.frontend", "--router-mode", router_mode,
               "--discovery-backend", "file", "--event-plane", "zmq",
               "--http-host", "127.0.0.1", "--http-port", str(port)]  # fmt: skip
    return start_process(name, command, f"http://127.0.0.1:{port}", run_dir, env)


def start_worker(
    name: str, model_dir: Path, args: Sequence[str], run_dir: Path, env: dict
) -> FleetProcess:
    """One `iris serve --dynamo` node, its /health and /metrics on a free port."""
    status = free_port()
    command = [sys.executable, "-m", "iris_serve.launch.cli", "serve", str(model_dir),
               "--dynamo", "--port", str(status), "--tokenizer-workers", "1",
               "--kv-cache-memory", "64MiB", "--mm-shm-arena-bytes", "128MiB", *args]  # fmt: skip
    return start_process(name, command, f"http://127.0.0.1:{status}", run_dir, env)


def start_process(
    name: str, command: list[str], url: str, run_dir: Path, env: dict
) -> FleetProcess:
    log_path = run_dir / f"{name}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # a test may kill a worker's whole process group
        )  # fmt: skip
    return FleetProcess(name, process, url, log_path)
