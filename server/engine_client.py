"""The server's bridge to the engine: requests out to tokenizer workers, tokens back
(`docs/design.md`, "Processes" and "Life of a request").

The server binds one PULL socket (`server`) that the scheduler and every worker connect
to, and connects one PUSH per worker (`tokenizer-{i}`, bound by the worker). Routing is
`server.image_router`'s. A request's abort goes to the same worker, after it on the same
socket, so it never overtakes its request. One background task reads the PULL socket and
hands each output to its request's queue; outputs for requests no longer in flight are
dropped. The gauges (`EngineStats`, `WorkerStats`) land in `metrics`, rendered at /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from ..ipc.codec import MessageError
from ..ipc.messages import (
    SERVER_TO_TOKENIZER,
    TO_SERVER,
    AbortRequest,
    RequestError,
    RequestOutput,
    TokenBatch,
    TokenizeRequest,
    ToServer,
)
from ..ipc.sockets import AsyncPullSocket, AsyncPushSocket, ipc_address, worker_replica
from .errors import APIError
from .image_router import DEFAULT_CAPACITY, ImageRouter
from .metrics import MetricsBoard

logger = logging.getLogger(__name__)


class EngineRequestError(APIError):
    """The engine refused or failed a request (a `RequestError` for it arrived)."""


def _field_out_of_range(request: TokenizeRequest) -> str:
    """The field of `request` (a sampling option by its own name) holding an integer
    msgpack cannot carry: JSON passed on as it came (the messages' extra keys, the tools'
    schemas, the chat template's arguments) or a number the API does not bound."""
    for name in request.__struct_fields__:
        value = getattr(request, name)
        fields = value.__struct_fields__ if isinstance(value, msgspec.Struct) else ()
        for where, item in [(f, getattr(value, f)) for f in fields] or [(name, value)]:
            try:
                msgspec.msgpack.encode(item)
            except OverflowError:
                return where
    return "messages"


class EngineClient(Protocol):
    def generate(self, request: TokenizeRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs, the last one `finished`; raises `EngineRequestError`."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop the request (idempotent; unknown or finished ids are ignored)."""
        ...


@dataclass
class _InFlight:
    worker: int
    items: deque[RequestOutput | RequestError] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | RequestError) -> None:
        self.items.append(item)
        self.ready.set()

    async def next(self) -> RequestOutput | RequestError:
        """The next item; consecutive outputs already queued are merged into one."""
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.popleft()
        while isinstance(item, RequestOutput) and self.items:
            following = self.items[0]
            if not isinstance(following, RequestOutput):
                break
            self.items.popleft()
            following.new_token_ids = item.new_token_ids + following.new_token_ids
            if item.logprobs is not None or following.logprobs is not None:
                following.logprobs = (item.logprobs or []) + (following.logprobs or [])
            if following.images is None:  # the image report comes once, on the first token
                following.images = item.images
            if following.queue_seconds is None:  # so do the times before it
                following.queue_seconds = item.queue_seconds
                following.prefill_seconds = item.prefill_seconds
                following.prefill_step_seconds = item.prefill_step_seconds
            item = following  # counts are totals, so the later output's are right
        return item


class ZmqEngineClient:
    """`EngineClient` over ZMQ; `start()` and `close()` run on the server's event loop."""

    def __init__(
        self,
        run_dir: Path,
        num_workers: int,
        *,
        num_replicas: int = 1,
        send_timeout: float = 5.0,
        image_uuids_per_worker: int = DEFAULT_CAPACITY,
    ) -> None:
        """`image_uuids_per_worker`: the workers' `--max-image-uuids` (the router must
        remember at least as many, to send a uuid to the worker that knows it)."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.run_dir = Path(run_dir)
        self.num_workers = num_workers
        self.num_replicas = num_replicas
        self.send_timeout = send_timeout
        self._requests: dict[str, _InFlight] = {}
        self._load = [0] * num_workers
        self._router = ImageRouter(num_workers, uuid_capacity=num_workers * image_uuids_per_worker)
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: AsyncPullSocket | None = None
        self._pushes: list[AsyncPushSocket] = []
        self._receiver: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.metrics = MetricsBoard(num_replicas)

    async def start(self) -> None:
        """Binds PULL `server`, connects PUSH `tokenizer-{i}`, starts receiving."""
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._pull = AsyncPullSocket(TO_SERVER, ipc_address(self.run_dir, "server"), ctx=self._ctx)
        self._pushes = [
            AsyncPushSocket(
                SERVER_TO_TOKENIZER,
                ipc_address(self.run_dir, f"tokenizer-{i}"),
                send_timeout=self.send_timeout,
                ctx=self._ctx,
            )
            for i in range(self.num_workers)
        ]
        self._receiver = asyncio.create_task(self._receive_loop(), name="iris-engine-receiver")

    async def close(self) -> None:
        """Stops receiving, ends every request in flight with a 503, closes the sockets."""
        if self._ctx is None:
            return
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        for request_id in list(self._requests):
            self._finish(request_id).put(
                RequestError(request_id, 503, "the server is shutting down", "server_error")
            )
        for task in list(self._background):
            task.cancel()
        for push in self._pushes:
            push.close(linger=0.1)  # aborts just sent still go out
        if self._pull is not None:
            self._pull.close(linger=0)
        self._ctx.term()
        self._ctx, self._pull, self._pushes, self._receiver = None, None, [], None

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    async def generate(
        self, request: TokenizeRequest, replica: int | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; `replica`: the data-parallel replica a
        cluster router chose for it (None: the image router picks the worker)."""
        if not self._pushes:
            raise RuntimeError("ZmqEngineClient.start() was not called")
        request_id = request.request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        flight = _InFlight(self._pick_worker(request, replica))
        self._requests[request_id] = flight
        self._load[flight.worker] += 1
        try:
            await self._pushes[flight.worker].send(request)
        except TimeoutError:
            self._finish(request_id)
            raise EngineRequestError(
                503, f"tokenizer worker {flight.worker} is not taking requests"
            ) from None
        except OverflowError:  # msgpack's ints are 64-bit; JSON's are not
            self._finish(request_id)
            field = _field_out_of_range(request)
            raise EngineRequestError(
                400, f"{field}: holds an integer that does not fit in 64 bits", param=field
            ) from None
        try:
            while True:
                item = await flight.next()
                if isinstance(item, RequestError):
                    raise EngineRequestError(item.status, item.message, item.type, item.param)
                yield item
                if item.finished:
                    return
        finally:
            if self._requests.get(request_id) is flight:  # the consumer left early
                self._finish(request_id)
                self._spawn(self._send_abort(flight.worker, request_id))

    async def abort(self, request_id: str) -> None:
        flight = self._requests.get(request_id)
        if flight is None:
            return
        self._finish(request_id).put(RequestOutput(request_id, [], True, "abort"))
        await self._send_abort(flight.worker, request_id)

    # -- internals ----------------------------------------------------------------------

    def _pick_worker(self, request: TokenizeRequest, replica: int | None = None) -> int:
        """The image router's choice, or, for a chosen `replica`, the least loaded of the
        workers feeding it (ties: the lowest)."""
        if replica is None:
            return self._router.pick(request.messages, self._load)
        workers = [
            w for w in range(self.num_workers) if worker_replica(w, self.num_replicas) == replica
        ]
        return min(workers, key=lambda w: self._load[w])

    def _finish(self, request_id: str) -> _InFlight:
        flight = self._requests.pop(request_id)
        self._load[flight.worker] -= 1
        return flight

    async def _send_abort(self, worker: int, request_id: str) -> None:
        try:
            await self._pushes[worker].send(AbortRequest(request_id))
        except (TimeoutError, zmq.ZMQError) as e:
            logger.warning("could not send the abort of %s to worker %d: %s", request_id, worker, e)

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[call-overload]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _receive_loop(self) -> None:
        assert self._pull is not None
        socket, codec = self._pull.socket, self._pull.codec
        while True:
            data = await socket.recv()
            try:
                self._dispatch(codec.decode(data))
            except MessageError as e:
                logger.error("dropped a malformed message: %s", e)
            except Exception:
                logger.exception("could not dispatch an engine message")

    def _dispatch(self, message: ToServer) -> None:
        if isinstance(message, RequestError):
            if message.request_id in self._requests:
                self._finish(message.request_id).put(message)
            return
        if not isinstance(message, TokenBatch):
            self.metrics.update(message)
            return
        for output in message.outputs:
            flight = self._requests.get(output.request_id)
            if flight is None:
                continue  # finished or aborted already
            if output.finished:
                self._finish(output.request_id)
            flight.put(output)
