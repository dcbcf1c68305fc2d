"""A PUSH socket owned by its own thread: `send` queues and returns at once.

The scheduler's step loop must neither wait on a slow server nor drop what it produced
(a lost `TokenBatch` is a request that never ends). So, as vLLM's engine core does, the
loop only encodes and enqueues; one sender thread sends the queue in order, with
blocking sends retried for as long as it takes. ZMQ sockets are not thread-safe: the
thread creates, uses and closes the socket. `close()` queues a stop after everything
already queued; if the peer takes nothing for `close_timeout` seconds the rest is
dropped (logged), so exit never hangs on a peer that is gone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Generic, TypeVar

import zmq

from .codec import Codec
from .sockets import PushSocket

T = TypeVar("T")
logger = logging.getLogger(__name__)

_STOP = object()
RETRY_SECONDS = 0.1  # one blocking send's slice: how soon the thread notices `close()`
WARN_AFTER_SECONDS = 5.0
LINGER_SECONDS = 1.0  # what ZMQ may still flush once the socket is closed


class PushThread(Generic[T]):
    def __init__(
        self,
        codec: Codec[T],
        address: str,
        *,
        name: str = "iris-push",
        close_timeout: float = 2.0,
        hwm: int | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.codec = codec
        self.address = address
        self.close_timeout = close_timeout
        self.num_send_timeouts = 0  # send slices the peer let pass: how far behind it is
        self._hwm = hwm
        self._ctx = ctx
        self._queue: queue.SimpleQueue[bytes | object] = queue.SimpleQueue()
        self._deadline: float | None = None  # set by close(): give up sending after it
        self._closed = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._started.wait(10.0):
            raise RuntimeError(f"the sender thread for {address} did not start")
        if self._start_error is not None:
            raise self._start_error

    def send(self, message: T) -> None:
        """Encodes `message` (so later changes to it cannot reach the wire) and queues it;
        never blocks. Messages go out in the order they were queued."""
        if self._closed or not self._thread.is_alive():
            raise RuntimeError(f"the sender thread for {self.address} is not running")
        self._queue.put(self.codec.encode(message))

    def close(self) -> None:
        """Sends what is queued (for at most `close_timeout` s), then ends the thread and
        closes the socket; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._deadline = time.monotonic() + self.close_timeout
        self._queue.put(_STOP)
        self._thread.join(self.close_timeout + LINGER_SECONDS + 1.0)
        if self._thread.is_alive():  # only if a send ignored its timeout
            logger.error("the sender thread for %s did not stop", self.address)

    # -- the sender thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            socket = PushSocket(
                self.codec,
                self.address,
                send_timeout=RETRY_SECONDS,
                linger=LINGER_SECONDS,
                hwm=self._hwm,
                ctx=self._ctx,
            )
        except BaseException as error:
            self._start_error = error
            self._started.set()
            return
        self._started.set()
        dropped = 0
        try:
            while True:
                data = self._queue.get()
                if data is _STOP:
                    break
                assert isinstance(data, bytes)
                if not self._deliver(socket.socket, data):
                    dropped += 1
        except Exception:
            logger.exception("the sender thread for %s failed", self.address)
        finally:
            socket.close(linger=0 if dropped else None)
        if dropped:
            logger.error(
                "%s took nothing for %.1f s at shutdown: dropped %d messages",
                self.address,
                self.close_timeout,
                dropped,
            )

    def _deliver(self, socket: zmq.Socket, data: bytes) -> bool:
        """Sends `data`, waiting as long as the peer needs; False only once the close
        deadline has passed."""
        waited_since = time.monotonic()
        warned = False
        while True:
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                return False
            try:
                socket.send(data)
                return True
            except zmq.Again:
                self.num_send_timeouts += 1
            if not warned and time.monotonic() - waited_since > WARN_AFTER_SECONDS:
                warned = True
                logger.warning(
                    "%s has taken no message for %.0f s; holding %d more",
                    self.address,
                    WARN_AFTER_SECONDS,
                    self._queue.qsize(),
                )
