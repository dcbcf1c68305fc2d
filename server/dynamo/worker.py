"""`iris serve --dynamo`: this node's Iris as one NVIDIA Dynamo backend worker.

The launcher starts the tokenizer workers and the scheduler replicas as for `iris serve`
and then runs `serve_dynamo` in place of the HTTP server. It registers the model with
Dynamo's discovery as a chat model taking token ids (Iris's KV page as the router's
block), serves Dynamo's endpoint with `DynamoHandler`, and relays each replica's KV
events (`scheduler/kv/event_publisher.py`, vLLM's format on a local ZMQ socket) into
Dynamo's event plane with its data-parallel rank, through Dynamo's own relay
(`KvEventPublisher` with a ZMQ endpoint), which turns an image's placeholder tokens into
the router's pad values from the image's id in the events.

Which planes and discovery Dynamo uses comes from its own environment variables, as for
its other workers (`DYN_DISCOVERY_BACKEND`, `DYN_REQUEST_PLANE`, `DYN_EVENT_PLANE`). The
node keeps its own /health and /metrics on `--host`/`--port` (no API there). On
SIGINT/SIGTERM the worker leaves discovery first (the router stops sending to it), gives
running requests `--shutdown-timeout` seconds, then aborts the rest; a child's death
stops it with status 1. Only this module imports `dynamo` (`pip install
'iris-serve[dynamo]'`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...common.process_heap import freeze_startup_heap
from ...ipc.messages import SchedulerReady, TokenizeRequest
from ..app import AppSettings
from ..engine_client import EngineRequestError, ZmqEngineClient
from ..logprobs import TokenText
from ..metrics import CONTENT_TYPE, MetricsBoard
from ..stats_log import banner
from ..streaming import closing, interleaved, starting_with
from .requests import (
    RefusedField,
    choice_requests,
    choices,
    output_chunk,
    routed_replica,
    tokenize_request,
)

logger = logging.getLogger("iris.launcher")
WATCH_INTERVAL_SECONDS = 0.5


@dataclass(frozen=True)
class DynamoWorkerConfig:
    endpoint: str  # Dynamo's "namespace.component.endpoint" this worker serves
    host: str  # where the node's /health and /metrics are served
    port: int
    event_endpoints: tuple[str, ...]  # each replica's KV-event socket, to connect to
    shutdown_timeout: float
    run_dir: Path
    num_workers: int
    image_uuids_per_worker: int
    arena_bytes: int  # one worker's arena, for the ready banner


class DynamoHandler:
    """Serves Dynamo's preprocessed requests through Iris's tokenizer workers."""

    def __init__(self, client: ZmqEngineClient, settings: AppSettings) -> None:
        from transformers import AutoTokenizer

        self.client = client
        self.settings = settings
        self.token_text = TokenText(AutoTokenizer.from_pretrained(settings.model_path))
        self.in_flight: set[str] = set()
        self._count = 0

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict]:
        self._count += 1
        request_id = f"dynamo-{context.id() or self._count}"
        try:
            settings = self.settings
            tokenize = tokenize_request(
                request, request_id, settings.sampling_defaults, settings.max_logprobs
            )
            answers = choice_requests(tokenize, choices(request))
        except (RefusedField, ValueError) as error:
            raise _client_error(400, str(error)) from None
        ids = [answer.request_id for answer in answers]
        self.in_flight.update(ids)
        cancel = asyncio.ensure_future(self._abort_when_stopped(context, ids))
        replica = routed_replica(request, self.client.num_replicas)
        try:
            first = self._chunks(answers[0], 0, replica)
            head = await anext(first)  # its prompt's pages are cached before the others start
            others = [self._chunks(a, i, replica) for i, a in enumerate(answers[1:], 1)]
            async with closing(interleaved([starting_with(head, first), *others])) as chunks:
                async for chunk in chunks:  # closed with this stream: every answer's too
                    yield chunk
        except EngineRequestError as error:
            raise _client_error(error.status, error.message) from None
        finally:
            cancel.cancel()
            self.in_flight.difference_update(ids)

    async def _chunks(
        self, request: TokenizeRequest, index: int, replica: int | None
    ) -> AsyncIterator[dict]:
        """Answer `index`'s chunks as the engine's outputs come."""
        async for output in self.client.generate(request, replica):
            yield output_chunk(output, self.token_text, index)

    async def abort_all(self) -> None:
        for request_id in list(self.in_flight):
            await self.client.abort(request_id)

    async def _abort_when_stopped(self, context: Any, request_ids: list[str]) -> None:
        """The client went away (Dynamo stopped the request's context): abort its answers."""
        await context.async_killed_or_stopped()
        for request_id in request_ids:
            await self.client.abort(request_id)


async def serve_dynamo(
    config: DynamoWorkerConfig,
    settings: AppSettings,
    schedulers: Sequence[SchedulerReady],
    dead_child: Callable[[], str | None],
) -> int:
    """Serves Dynamo's endpoint until SIGINT/SIGTERM (0) or a child's death (1)."""
    from dynamo.llm import (
        KvEventPublisher,
        ModelInput,
        ModelRuntimeConfig,
        ModelType,
        WorkerType,
        register_model,
    )
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop,
        os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
        os.environ.get("DYN_REQUEST_PLANE", "tcp"),
        event_plane=os.environ.get("DYN_EVENT_PLANE", "nats"),
    )
    endpoint = runtime.endpoint(config.endpoint)
    client = ZmqEngineClient(
        config.run_dir,
        config.num_workers,
        num_replicas=len(schedulers),
        image_uuids_per_worker=config.image_uuids_per_worker,
    )
    await client.start()
    status = uvicorn.Server(
        uvicorn.Config(
            node_status_app(client.metrics),
            host=config.host,
            port=config.port,
            log_level="warning",
            log_config=None,
        )
    )
    status.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # ours below
    status_task = await _started(status)  # /health answers before the router can route here
    first = schedulers[0]
    runtime_config = ModelRuntimeConfig()
    runtime_config.total_kv_blocks = first.kv_pages
    runtime_config.max_num_seqs = first.max_num_seqs
    runtime_config.max_num_batched_tokens = first.max_num_batched_tokens
    runtime_config.context_length = settings.max_model_len
    runtime_config.enable_local_indexer = True  # a restarted router learns what we hold
    runtime_config.data_parallel_size = len(schedulers)
    image_token_id = _image_token_id(settings.model_path)
    relays = [  # held while serving: each relays one replica's KV events
        KvEventPublisher(
            endpoint,
            kv_block_size=first.page_size,
            dp_rank=rank,
            enable_local_indexer=True,
            zmq_endpoint=events,
            image_token_id=image_token_id,
        )
        for rank, events in enumerate(config.event_endpoints)
    ]
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,  # /v1/completions too
        endpoint,
        settings.model_path,
        settings.served_model_names[0],
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=first.page_size,
        runtime_config=runtime_config,
    )
    handler = DynamoHandler(client, settings)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    failure: list[str] = []
    watchdog = asyncio.create_task(_watch(dead_child, stop, failure))
    serving = asyncio.ensure_future(endpoint.serve_endpoint(handler.generate))
    logger.info("relaying the KV events of %d replica(s) to Dynamo's router", len(relays))
    model = settings.served_model_names[0]
    where = f"Dynamo endpoint {config.endpoint}"
    logger.info(banner(model, where, schedulers, config.num_workers, config.arena_bytes))
    freeze_startup_heap()
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if failure:
            logger.error("shutting down: %s", failure[0])
        else:
            logger.info("shutting down: leaving Dynamo's discovery")
        await endpoint.unregister_endpoint_instance()
        await _drain(handler, config.shutdown_timeout)
    finally:
        watchdog.cancel()
        stopping.cancel()
        status.should_exit = True
        await asyncio.gather(status_task, return_exceptions=True)
        runtime.shutdown()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await client.close()
    return 1 if failure else 0


async def _started(status: uvicorn.Server) -> asyncio.Task:
    """Serves the node's /health and /metrics, returning once they answer."""
    task = asyncio.ensure_future(status.serve())
    while not status.started:
        if task.done():  # it could not bind: uvicorn logged why
            raise RuntimeError(f"the node's /health and /metrics did not start: {task!r}")
        await asyncio.sleep(0.01)  # uvicorn's startup sets `started`; nothing to await
    return task


async def _drain(handler: DynamoHandler, timeout: float) -> None:
    """Lets running requests finish for up to `timeout` seconds, then aborts the rest."""
    deadline = asyncio.get_running_loop().time() + timeout
    while handler.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)  # polling a set the handlers shrink, bounded by the deadline
    if handler.in_flight:
        logger.info("shutdown: aborting %d request(s) still running", len(handler.in_flight))
        await handler.abort_all()


def node_status_app(board: MetricsBoard) -> Starlette:
    """The node's own /health and /metrics (Iris's figures, as `iris serve` has them)."""

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(board.render(), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/health", health), Route("/metrics", metrics)])


def _client_error(status: int, message: str) -> Exception:
    """The exception Dynamo's frontend answers with `status` and `message`."""
    from dynamo.llm.exceptions import HttpError, InvalidArgument

    return InvalidArgument(message) if status == 400 else HttpError(status, message)


def _image_token_id(model_path: str) -> int | None:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("image_token_id")


async def _watch(
    dead_child: Callable[[], str | None], stop: asyncio.Event, failure: list[str]
) -> None:
    while not stop.is_set():
        dead = dead_child()
        if dead:
            failure.append(dead)
            stop.set()
            return
        await asyncio.sleep(WATCH_INTERVAL_SECONDS)
