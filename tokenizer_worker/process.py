"""The tokenizer worker process: sockets around `TokenizerWorker`, and its lifetime.

Sockets, all `ipc_address(run_dir, name)`:

    PULL bind     tokenizer-<id>   TokenizeRequest / AbortRequest from the server
    PULL bind     release-<id>     ReleaseImages / CoreReady from the scheduler
    PUSH connect  scheduler        EngineRequest / AbortEngineRequest / MediaWork
    PUSH connect  server           RequestError, WorkerStats

While a request with media is turned into an engine request, the worker tells its
scheduler so (`MediaWork`, on the scheduler socket, before the request itself): it takes
a core meanwhile, and on a CPU the steps leave it one. It starts once the scheduler
answers (`CoreReady`, on the release socket: the step that was running when the notice
came has ended), or after `CORE_WAIT_SECONDS`.

The loop: wait (bounded, and never past the deadline of a request waiting for arena
room) for either socket; apply releases first, and between requests (they free arena
room, and the waiting requests are tried again); handle the queued requests; answer the
waits that timed out; report the gauges when they changed. SIGTERM/SIGINT end it after
the current request (or when the launcher died), with a 503 for the requests still
waiting; the arena is removed on the way out. No request can kill the loop.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import zmq

from ..common.logs import configure_logging
from ..common.process_heap import freeze_startup_heap
from ..ipc.codec import MessageError
from ..ipc.messages import (
    SCHEDULER_TO_TOKENIZER,
    SERVER_TO_TOKENIZER,
    TO_SERVER,
    TOKENIZER_TO_SCHEDULER,
    CoreReady,
    EngineRequest,
    MediaWork,
    ProcessFailed,
    ProcessReady,
    ReadySink,
    ReleaseImages,
    RequestError,
    TokenizeRequest,
    WorkerStats,
)
from ..ipc.sockets import PullSocket, PushSocket, ipc_address, scheduler_socket
from .config import WorkerConfig
from .prompt_path import MediaWorkContext
from .worker import Reply, TokenizerWorker, drop_aborted

logger = logging.getLogger("iris.tokenizer")

POLL_SECONDS = 0.1
MAX_BATCH = 32  # requests read ahead (to skip the ones aborted meanwhile)
STATS_INTERVAL_SECONDS = 0.2
CORE_WAIT_SECONDS = 0.25  # the longest wait for `CoreReady`: a step that runs longer loses


def run_worker(config: WorkerConfig, ready: ReadySink) -> None:
    """Entry point of a spawned worker process; reports a `ProcessReady`, or a
    `ProcessFailed`, on `ready`."""
    configure_logging(config.log_level)
    torch.set_num_threads(1)  # workers scale by process; a torch thread pool would only contend
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, stop.set)
    try:
        loop = _Loop(config, stop, lambda media_work: TokenizerWorker.open(config, media_work))
    except Exception as e:
        logger.exception("start-up failed")
        ready.put(ProcessFailed.of(config.name, e))
        sys.exit(1)
    worker = loop.worker
    freeze_startup_heap()
    ready.put(ProcessReady(config.name))
    logger.info(
        "ready: arena %s of %d bytes, processor cache %s",
        worker.arena.name,
        worker.arena.capacity_bytes,
        "on" if config.enable_processor_cache else "off",
    )
    try:
        loop.run()
    finally:
        loop.close()
        worker.close()
        logger.info("stopped")
        _exit_now()


def _exit_now() -> None:
    """Leave without the interpreter's teardown: everything we own is closed, and a
    final garbage collection over transformers' objects can take seconds on a busy
    machine, past the launcher's grace period."""
    logging.shutdown()
    os._exit(0)


class _Stop:
    def __init__(self) -> None:
        self.requested = False

    def set(self, *_: object) -> None:
        self.requested = True


class _Loop:
    def __init__(
        self,
        config: WorkerConfig,
        stop: _Stop,
        open_worker: Callable[[MediaWorkContext], TokenizerWorker],
    ) -> None:
        """Opens the sockets, then the worker through `open_worker(media_work)`."""
        self.stop = stop
        self.worker_id = config.worker_id
        self._media_work_seq = 0
        run_dir = Path(config.run_dir)
        self.ctx = zmq.Context()
        self.sockets: list[Any] = []
        try:
            self.requests = self._open(PullSocket, SERVER_TO_TOKENIZER, run_dir, config.name)
            self.releases = self._open(
                PullSocket, SCHEDULER_TO_TOKENIZER, run_dir, f"release-{config.worker_id}"
            )
            self.to_scheduler = self._open(
                PushSocket, TOKENIZER_TO_SCHEDULER, run_dir, scheduler_socket(config.replica)
            )
            self.to_server = self._open(PushSocket, TO_SERVER, run_dir, "server")
            self.worker = open_worker(self.media_work)
        except BaseException:
            self.close()
            raise
        self._last_stats: WorkerStats | None = None
        self._last_stats_time = 0.0

    def _open(self, cls: type, codec: Any, run_dir: Path, name: str) -> Any:
        socket = cls(codec, ipc_address(run_dir, name), ctx=self.ctx)
        self.sockets.append(socket)
        return socket

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.requests.socket, zmq.POLLIN)
        poller.register(self.releases.socket, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        while not self.stop.requested:
            ready = dict(poller.poll(self._poll_ms()))
            if not ready and parent is not None and not parent.is_alive():
                logger.error("the launcher died; stopping")
                break
            self._apply_releases()
            if self.requests.socket in ready:
                for message in drop_aborted(self._receive(self.requests, MAX_BATCH)):
                    if self.stop.requested:
                        break
                    self._apply_releases()
                    self._serve(message)
            self._answer(self.worker.expire_waiting(time.monotonic()))
            self._send_stats(rate_limited=bool(ready))
        self._answer(self.worker.drop_waiting())

    def close(self) -> None:
        for socket in self.sockets:
            socket.close()  # lingers up to a second for unsent replies
        self.ctx.destroy(linger=0)  # also closes a socket whose bind failed

    @contextmanager
    def media_work(self) -> Iterator[None]:
        """Tells the scheduler that this worker takes a core until the block ends, and
        enters it once the scheduler's steps leave it one (see the module)."""
        self._media_work_seq += 1
        self._notify(MediaWork(self.worker_id, busy=True, seq=self._media_work_seq))
        try:
            self._await_core(self._media_work_seq)
            yield
        finally:
            self._notify(MediaWork(self.worker_id, busy=False, seq=self._media_work_seq))

    def _await_core(self, seq: int) -> None:
        """Waits up to `CORE_WAIT_SECONDS` for the `CoreReady` of start `seq`, applying the
        releases that come meanwhile (this request has pinned nothing yet)."""
        deadline = time.monotonic() + CORE_WAIT_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self.releases.recv(left)
            except MessageError as e:
                logger.error("dropped a message: %s", e)
                continue
            if message is None or (isinstance(message, CoreReady) and message.seq == seq):
                return
            if isinstance(message, ReleaseImages):
                self.worker.release(message)

    def _notify(self, notice: MediaWork) -> None:
        try:
            self.to_scheduler.send(notice)
        except TimeoutError as e:  # the requests behind it will say so too
            logger.error("%s", e)

    def _poll_ms(self) -> int:
        """The poll's timeout: `POLL_SECONDS`, or less up to a waiting request's deadline."""
        timeout = POLL_SECONDS
        deadline = self.worker.waiting.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        return math.ceil(timeout * 1000)

    def _apply_releases(self) -> None:
        for message in self._receive(self.releases, None):
            if isinstance(message, ReleaseImages):  # a CoreReady here came after its wait
                self.worker.release(message)
        self._answer(self.worker.retry_waiting())

    def _answer(self, replies: Sequence[EngineRequest | RequestError]) -> None:
        """Replies to requests that waited for arena room (after the gauges)."""
        if replies:
            self._send_stats(rate_limited=False)
            for reply in replies:
                self._send(reply)

    def _receive(self, socket: PullSocket, limit: int | None) -> list[Any]:
        messages: list[Any] = []
        while limit is None or len(messages) < limit:
            try:
                message = socket.recv(0)
            except MessageError as e:
                logger.error("dropped a message: %s", e)
                continue
            if message is None:
                break
            messages.append(message)
        return messages

    def _serve(self, message: Any) -> None:
        try:
            reply = self.worker.handle(message)
            # The counters go out before the request does, so by the time its answer
            # reaches a client, /metrics already counts it (and shows its pins).
            self._send_stats(rate_limited=False)
            if reply is not None:  # None: it waits for arena room
                self._send(reply)
        except Exception as e:  # a bug; `handle` already turns request errors into replies
            logger.exception("failed to serve %r", message.request_id)
            if isinstance(message, TokenizeRequest):
                error = f"internal error in a tokenizer worker: {type(e).__name__}: {e}"
                self._to_server(RequestError(message.request_id, 500, error, type="server_error"))

    def _send(self, reply: Reply) -> None:
        if isinstance(reply, RequestError):
            self._to_server(reply)
            return
        try:
            self.to_scheduler.send(reply)
        except TimeoutError as e:
            logger.error("%s", e)
            if isinstance(reply, EngineRequest):
                self.worker.unpin(reply)
                self._to_server(
                    RequestError(
                        reply.request_id,
                        503,
                        "the scheduler is not taking requests",
                        type="server_busy",
                    )
                )

    def _to_server(self, message: RequestError | WorkerStats) -> None:
        try:
            self.to_server.send(message)
        except TimeoutError as e:
            logger.error("%s", e)

    def _send_stats(self, rate_limited: bool) -> None:
        """Gauges when they change: after every request served, and otherwise at most
        every 0.2 s while messages keep coming (`rate_limited`), then once idle."""
        now = time.monotonic()
        if rate_limited and now - self._last_stats_time < STATS_INTERVAL_SECONDS:
            return
        stats = self.worker.stats()
        if stats != self._last_stats:
            self._to_server(stats)
            self._last_stats, self._last_stats_time = stats, now
