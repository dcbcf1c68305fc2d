"""`iris serve`: start the tokenizer workers and the scheduler, then serve HTTP
(`docs/design.md`, "Processes", the launcher).

It imports each role's public surface only (the config dataclass and the `run_*` entry
point), which is light; the HTTP side (fastapi, transformers' config, torch) is imported
once the children are started, so every process's imports run at once instead of one
after the other (bench/results/server_startup_tiny.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.logs import configure_logging
from ..ipc.messages import READY, ProcessFailed, ProcessReady, ReadyReport, SchedulerReady
from ..ipc.shm_names import SHM_DIR, instance_prefix, new_instance_id, sweep, sweep_orphans
from ..ipc.sockets import new_run_dir, worker_replica
from ..scheduler import (
    EngineConfig,
    SchedulerProcessConfig,
    run_follower,
    run_scheduler,
)
from ..server import import_http_side, sampling_defaults
from ..tokenizer_worker import WorkerConfig, run_worker
from .args import ServeArgs
from .dynamo import DynamoMissing, check_dynamo_installed, event_endpoints, with_kv_events

if TYPE_CHECKING:
    from ..server import AppSettings

logger = logging.getLogger("iris.launcher")
WATCH_INTERVAL_SECONDS = 0.5
STOP_GRACE_SECONDS = 5.0


def serve(args: ServeArgs) -> int:
    configure_logging(args.log_level, process_name="server")
    try:
        model_path = resolve_model_path(args.model, args.revision)
    except FileNotFoundError as error:
        logger.error("%s", error)
        return 1
    if args.trust_remote_code:
        logger.info("--trust-remote-code has no effect: Iris runs its own model code")
    try:  # before minutes of start-up, not after
        # from here on, args.chat_template is the template's text, not its file
        args = dataclasses.replace(args, chat_template=read_chat_template(args.chat_template))
        defaults = sampling_defaults(args.generation_config, model_path)
        if args.dynamo:
            check_dynamo_installed()
            args = with_kv_events(args)
        engine_config(args, model_path)  # its checks (`EngineConfig.__post_init__`), now
        check_port_free(args.host, args.port)
        check_shared_memory(shared_memory_needed(args))
    except (OSError, ValueError, DynamoMissing) as error:
        logger.error("%s", error)
        return 1
    for name in sweep_orphans():
        logger.info("removed %s, left by a crashed Iris", name)
    instance = new_instance_id()
    run_dir = new_run_dir()
    context = mp.get_context("spawn")
    ready = ReadyChannel(context)
    children = _children(args, model_path, instance, run_dir, context, ready)
    # Our handlers (not the default ones) must be in place when uvicorn re-raises the
    # signal it captured, so that shutdown reaches the cleanup below.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    try:
        for child in children:
            child.start()
            logger.info("started %s (pid %d)", child.name, child.pid)
        import_http_side()  # while the children import theirs
        schedulers = _wait_until_ready(children, ready, args.startup_timeout)
        if schedulers is None:
            return 1
        _LIFECYCLE.http_serving = True  # the HTTP server, or Dynamo's, announces a stop
        return asyncio.run(_serve(args, model_path, run_dir, schedulers, children, defaults))
    finally:
        _stop(children)
        ready.close()
        for name in sweep(instance_prefix(instance)):
            logger.info("removed shared memory %s", name)
        shutil.rmtree(run_dir, ignore_errors=True)


def check_port_free(host: str, port: int) -> None:
    """Raises naming the port when another process listens on it (uvicorn would find out
    only after the workers and the model have started)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise OSError(
                f"cannot listen on {host}:{port}: {error.strerror} (another server?); "
                "pick another --port"
            ) from None


def shared_memory_needed(args: ServeArgs) -> int:
    """Bytes of /dev/shm that `iris serve` with `args` reserves at start-up: every
    tokenizer worker's arena."""
    return tokenizer_workers(args) * worker_config(args, 0, Path(), "", Path()).arena_bytes


def docker_shm_size(needed: int) -> str:
    """The `docker run --shm-size` for `needed` bytes of arenas: whole GiB, plus one for
    /dev/shm's other users (multiprocessing's semaphores, NCCL's buffers between ranks);
    the Dockerfile and the README state it for the defaults (tests/test_dockerfile.py)."""
    return f"{-(-needed // 2**30) + 1}g"


def check_shared_memory(needed: int, shm_dir: Path = SHM_DIR) -> None:
    """Raises when /dev/shm cannot hold the tokenizer workers' arenas (Docker's default is
    64 MiB), with the two ways out, instead of ENOSPC from a worker mid start-up."""
    free = shutil.disk_usage(shm_dir).free
    if needed > free:
        raise OSError(
            f"{shm_dir} has {free / 2**30:.2f} GiB free but the tokenizer workers' arenas need "
            f"{needed / 2**30:.2f} GiB: give the container more (docker run --shm-size "
            f"{docker_shm_size(needed)}) or lower --mm-processor-cache-gb / "
            "--tokenizer-workers"
        )


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the template itself (vLLM's rule: a value
    without a `{` that names no file is a mistyped path, refused)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise FileNotFoundError(f"--chat-template {value}: no such file")
    return value


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """A local folder as is; None → the built-in tiny checkpoint; else a hub id (at
    `revision`), from the local Hugging Face cache or downloaded. FileNotFoundError, in
    one line, when it is none of these (not a traceback from the hub client)."""
    if model is None:
        from ..tiny_checkpoint import builtin_checkpoint

        return builtin_checkpoint(progress=logger.info)
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model {model!r}: no such checkpoint folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=patterns))
    except (HFValidationError, OSError) as error:  # the hub client's errors are OSErrors
        raise FileNotFoundError(
            f"model {model!r}: not a checkpoint folder, and the hub could not provide it "
            f"({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from None


def _children(
    args: ServeArgs, model_path: Path, instance: str, run_dir: Path, context: Any, ready: Any
) -> list[BaseProcess]:
    num_workers = tokenizer_workers(args)
    workers = [
        context.Process(
            target=run_worker,
            name=f"tokenizer-{i}",
            args=(worker_config(args, i, model_path, instance, run_dir), ready),
        )
        for i in range(num_workers)
    ]
    engine = engine_config(args, model_path)
    replicas, ranks = args.data_parallel_size, engine.tensor_parallel_size
    # Every rank of every replica shares the scheduler's cores on a CPU.
    threads = max(1, scheduler_threads(args) // (replicas * ranks))
    schedulers = []
    for replica in range(replicas):
        name = scheduler_name(replica, replicas)
        config = SchedulerProcessConfig(
            engine,
            str(run_dir),
            num_workers,
            threads,
            replica=replica,
            name=name,
            log_level=args.log_level,
        )
        schedulers.append(context.Process(target=run_scheduler, name=name, args=(config, ready)))
        schedulers += [
            context.Process(
                target=run_follower,
                name=config.follower_name(rank),
                args=(config, rank, ready),
            )
            for rank in range(1, ranks)
        ]
    return [*workers, *schedulers]


def scheduler_name(replica: int, replicas: int) -> str:
    """`scheduler` alone; `scheduler-dp0`, `scheduler-dp1`, ... for data-parallel replicas."""
    return "scheduler" if replicas == 1 else f"scheduler-dp{replica}"


def tokenizer_workers(args: ServeArgs) -> int:
    """`--tokenizer-workers`, raised to one per data-parallel replica at least."""
    return max(args.tokenizer_workers, args.data_parallel_size)


def worker_config(
    args: ServeArgs, worker_id: int, model_path: Path, instance: str, run_dir: Path
) -> WorkerConfig:
    """Worker `worker_id`'s settings: the flags given (`args.worker`; the arena bounds
    the processor cache), the rest `WorkerConfig`'s defaults."""
    return WorkerConfig(
        worker_id=worker_id,
        model_path=str(model_path),
        run_dir=str(run_dir),
        instance_id=instance,
        log_level=args.log_level,
        replica=worker_replica(worker_id, args.data_parallel_size),
        chat_template=args.chat_template,
        **args.worker,
    )


def engine_config(args: ServeArgs, model_path: Path) -> EngineConfig:
    """The scheduler's settings: the flags given (`args.engine`), the rest
    `EngineConfig`'s defaults (the dataclass owns the defaults)."""
    return EngineConfig(model=str(model_path), **args.engine)


class ReadyChannel:
    """Children report a `ReadyReport` once started, msgpack-encoded as every message
    (`ipc.messages.READY`); a pipe, so that nothing (unlike a `multiprocessing.Queue`'s
    named semaphores) can be left in /dev/shm by a crash."""

    def __init__(self, context: Any) -> None:
        self._reader, self._writer = context.Pipe(duplex=False)

    def put(self, report: ReadyReport) -> None:  # called in the child
        self._writer.send_bytes(READY.encode(report))

    def get(self, timeout: float) -> ReadyReport | None:
        return READY.decode(self._reader.recv_bytes()) if self._reader.poll(timeout) else None

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


def scheduler_threads(args: ServeArgs) -> int:
    """`--scheduler-threads`, or every core this process may run on: the server and the
    workers are mostly idle while the scheduler computes (bench/results/scheduler_threads_*.md)."""
    if args.scheduler_threads:
        return args.scheduler_threads
    return usable_cores()


def usable_cores() -> int:
    """The CPUs this process may run on (a container's cpuset, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _wait_until_ready(
    children: list[BaseProcess], ready: ReadyChannel, timeout: float
) -> dict[str, SchedulerReady] | None:
    """Once every child is ready, the schedulers' reports by name; None (logged) if one
    failed or died."""
    deadline = time.monotonic() + timeout
    reports: dict[str, SchedulerReady | ProcessReady] = {}
    while len(reports) < len(children):
        if time.monotonic() > deadline:
            missing = sorted({c.name for c in children} - set(reports))
            logger.error("not ready after %.0f s: %s", timeout, ", ".join(missing))
            return None
        report = ready.get(timeout=WATCH_INTERVAL_SECONDS)
        if report is None:
            dead = _dead(children)
            if dead:
                logger.error("%s before it was ready", dead)
                return None
            continue
        if isinstance(report, ProcessFailed):
            logger.error("%s failed to start: %s", report.name, report.error)
            return None
        reports[report.name] = report
    return {name: r for name, r in reports.items() if isinstance(r, SchedulerReady)}


async def _serve(
    args: ServeArgs,
    model_path: Path,
    run_dir: Path,
    ready: dict[str, SchedulerReady],
    children: list[BaseProcess],
    defaults: dict[str, Any],
) -> int:
    """The server role, over HTTP or (`--dynamo`) as a Dynamo worker, until it stops."""
    from ..server import DynamoWorkerConfig, HttpServerConfig, serve_dynamo, serve_http

    replicas = args.data_parallel_size
    schedulers = [ready[scheduler_name(r, replicas)] for r in range(replicas)]
    first_worker = worker_config(args, 0, model_path, "", Path())
    settings = _app_settings(args, model_path, schedulers, defaults)
    if args.dynamo:
        dynamo = DynamoWorkerConfig(
            endpoint=args.dynamo_endpoint,
            host=args.host,
            port=args.port,
            event_endpoints=event_endpoints(engine_config(args, model_path), replicas),
            shutdown_timeout=args.shutdown_timeout,
            run_dir=run_dir,
            num_workers=tokenizer_workers(args),
            image_uuids_per_worker=first_worker.max_image_uuids,
            arena_bytes=first_worker.arena_bytes,
        )
        return await serve_dynamo(dynamo, settings, schedulers, lambda: _dead(children))
    http = HttpServerConfig(
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        run_dir=run_dir,
        num_workers=tokenizer_workers(args),
        num_replicas=replicas,
        image_uuids_per_worker=first_worker.max_image_uuids,
        arena_bytes=first_worker.arena_bytes,
    )
    return await serve_http(http, settings, schedulers, lambda: _dead(children))


def _app_settings(
    args: ServeArgs, model_path: Path, schedulers: list[SchedulerReady], defaults: dict[str, Any]
) -> AppSettings:
    from ..server import AppSettings

    return AppSettings(
        model_path=str(model_path),
        served_model_names=tuple(args.served_model_name or [args.model or model_path.name]),
        max_model_len=min(scheduler.max_model_len for scheduler in schedulers),
        quantization=schedulers[0].quantization,
        sampling_defaults=defaults,
        max_logprobs=args.max_logprobs,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        api_key=args.api_key,
    )


def _dead(children: list[BaseProcess]) -> str | None:
    for child in children:
        if child.exitcode is not None:
            code = child.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return f"{child.name} (pid {child.pid}) died: {how}"
    return None


def _stop(children: list[BaseProcess]) -> None:
    for child in children:
        if child.is_alive():
            child.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in children:
        if child.pid is None:
            continue
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            logger.warning("%s did not stop in %.0f s; killing it", child.name, STOP_GRACE_SECONDS)
            child.kill()
            child.join()


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM outside uvicorn (or re-raised by it after its graceful shutdown,
    which said so first): leave through `serve`'s cleanup with status 0; further signals
    are ignored so that the cleanup itself is not interrupted."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not _LIFECYCLE.http_serving:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
    raise SystemExit(0)


@dataclasses.dataclass
class _Lifecycle:
    http_serving: bool = False  # the HTTP server runs, and announces a shutdown itself


_LIFECYCLE = _Lifecycle()
