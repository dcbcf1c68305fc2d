"""The HTTP role's process body: connect to the tokenizer workers, serve the OpenAI API
with uvicorn until told to stop, drain what still runs, and log throughput meanwhile.
The launcher runs it (`serve_http`) once every child is ready and hands in `dead_child`:
a child's death stops the server with status 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from ..common.process_heap import freeze_startup_heap
from ..ipc.messages import EngineStats, SchedulerReady
from .stats_log import LOG_INTERVAL_SECONDS, banner, throughput_line

if TYPE_CHECKING:
    from .app import AppSettings
    from .metrics import MetricsBoard

logger = logging.getLogger("iris.launcher")
WATCH_INTERVAL_SECONDS = 0.5


@dataclass(frozen=True)
class HttpServerConfig:
    """Where the HTTP server listens, and the children it talks to."""

    host: str
    port: int
    log_level: str
    shutdown_timeout: float  # seconds open requests get before they are aborted
    run_dir: Path  # the sockets' folder
    num_workers: int
    num_replicas: int
    image_uuids_per_worker: int
    arena_bytes: int  # one worker's arena, for the ready banner


def import_http_side() -> None:
    """Import what `serve_http` needs (seconds of a core: torch via transformers' config,
    fastapi), so that the launcher can overlap it with the children's start-up."""
    from . import app, engine_client  # noqa: F401


async def serve_http(
    config: HttpServerConfig,
    settings: AppSettings,
    schedulers: Sequence[SchedulerReady],
    dead_child: Callable[[], str | None],
) -> int:
    """Serves until SIGINT/SIGTERM (0) or a child's death (1). `schedulers`: each
    replica's ready report, for the banner."""
    from .app import create_app
    from .engine_client import ZmqEngineClient

    client = ZmqEngineClient(
        config.run_dir,
        config.num_workers,
        num_replicas=config.num_replicas,
        image_uuids_per_worker=config.image_uuids_per_worker,
    )
    await client.start()
    app = create_app(settings, client)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level.lower(),
        log_config=None,  # uvicorn's loggers write through Iris's format (`common.logs`)
        # the drain below ends what is left first; this only bounds closing the sockets
        # (annotated int, but uvicorn passes it to asyncio.wait_for, which takes a float)
        timeout_graceful_shutdown=config.shutdown_timeout + 5,  # pyright: ignore[reportArgumentType]
    )
    server = _DrainingServer(uvicorn_config, app.state.serving, config.shutdown_timeout)
    failure: list[str] = []
    watchdog = asyncio.create_task(_watch(dead_child, server, failure))
    url = f"http://{config.host}:{config.port}"
    model = settings.served_model_names[0]
    logger.info(banner(model, url, schedulers, client.num_workers, config.arena_bytes))
    throughput = asyncio.create_task(_log_throughput(client.metrics, config.num_replicas))
    freeze_startup_heap()
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        throughput.cancel()
        await client.close()
    if failure:
        logger.error("shutting down: %s", failure[0])
        return 1
    return 0


class _DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown (stop accepting, let open requests finish), plus: at
    `timeout` seconds what still runs is aborted in the engine, so every stream ends with a
    finish reason and `[DONE]` rather than being cut."""

    def __init__(self, config: Any, serving: Any, timeout: float) -> None:
        super().__init__(config)
        self._serving, self._timeout = serving, timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            in_flight = self._serving.num_in_flight
            logger.info(
                "received %s, shutting down%s",
                signal.Signals(sig).name,
                f": {in_flight} request(s) in flight get up to {self._timeout:.0f} s "
                "(--shutdown-timeout)"
                if in_flight
                else "",
            )
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        async def drain_later() -> None:
            await asyncio.sleep(self._timeout)  # the grace period, not synchronisation
            logger.info("shutdown: ending the requests still running after %.0f s", self._timeout)
            await self._serving.drain()

        drainer = asyncio.create_task(drain_later())
        try:
            await super().shutdown(sockets)
        finally:
            drainer.cancel()


async def _log_throughput(board: MetricsBoard, replicas: int) -> None:
    """A throughput line every `LOG_INTERVAL_SECONDS` while the engine has work."""
    idle = EngineStats(0, 0, 0, 0, 0)

    def snapshot() -> list[EngineStats]:
        return [board.engines.get(r, idle) for r in range(replicas)]

    before, since = snapshot(), time.monotonic()
    while True:
        await asyncio.sleep(LOG_INTERVAL_SECONDS)  # a log cadence, not synchronisation
        now, at = snapshot(), time.monotonic()
        line = throughput_line(before, now, at - since)
        if line is not None:
            logger.info(line)
        before, since = now, at


async def _watch(dead_child: Callable[[], str | None], server: Any, failure: list[str]) -> None:
    while not server.should_exit:
        dead = dead_child()
        if dead:
            logger.error("%s; stopping the server", dead)
            failure.append(dead)
            server.should_exit = True
            return
        await asyncio.sleep(WATCH_INTERVAL_SECONDS)
