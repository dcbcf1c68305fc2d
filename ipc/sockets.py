"""Typed ZMQ PUSH/PULL sockets over `ipc://` paths in a private run folder
(`docs/design.md`, "Processes" and "No loop waits without a bound").

Each socket carries one message union (`ipc.messages.Codec`). `recv(timeout)` returns
None when nothing came, `send` raises `TimeoutError` when no peer takes the message in
time, and `close()` lingers at most `linger` seconds. The sync classes serve the worker
and scheduler loops; the `Async*` ones the server's event loop. A process that reads
several sockets registers their `.socket` with a `zmq.Poller` (or `zmq.asyncio.Poller`)
and calls `recv(0)` on the ready ones.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from .codec import Codec

T = TypeVar("T")
E = TypeVar("E", bound="_Endpoint[Any]")

# sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_IPC_PATH = 107


def new_run_dir(prefix: str = "iris-") -> Path:
    """A fresh private (0700) folder for one server instance's sockets."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def scheduler_socket(replica: int) -> str:
    """The name of data-parallel replica `replica`'s scheduler socket (tokenizer workers
    push `EngineRequest`s into it): `scheduler`, then `scheduler-1`, `scheduler-2`, ..."""
    return "scheduler" if replica == 0 else f"scheduler-{replica}"


def worker_replica(worker_id: int, replicas: int) -> int:
    """The data-parallel replica whose scheduler tokenizer worker `worker_id` feeds: the
    workers are dealt round the replicas (worker w to replica w mod `replicas`)."""
    return worker_id % replicas


def ipc_address(run_dir: Path, name: str) -> str:
    """`ipc://` address of the socket `name` (e.g. "scheduler", "tokenizer-0")."""
    if not name or "/" in name:
        raise ValueError(f"bad socket name {name!r}")
    path = str(run_dir / f"{name}.sock")
    if len(path.encode()) > _MAX_IPC_PATH:
        raise ValueError(
            f"socket path {path!r} is longer than {_MAX_IPC_PATH} bytes; use a shorter run dir"
        )
    return f"ipc://{path}"


def _ms(seconds: float) -> int:
    if seconds < 0:
        raise ValueError(f"timeout must be non-negative, got {seconds}")
    return round(seconds * 1000)


class _Endpoint(Generic[T]):
    def __init__(
        self,
        socket: Any,
        codec: Codec[T],
        address: str,
        bind: bool,
        linger: float,
        hwm: int | None,
    ) -> None:
        self.socket = socket
        self.codec = codec
        self.address = address
        socket.setsockopt(zmq.LINGER, _ms(linger))
        if hwm is not None:
            socket.setsockopt(zmq.SNDHWM if socket.type == zmq.PUSH else zmq.RCVHWM, hwm)
        if bind:
            socket.bind(address)
        else:
            socket.connect(address)

    def close(self, linger: float | None = None) -> None:
        """Close; unsent messages are kept at most `linger` seconds (default: as built)."""
        self.socket.close(None if linger is None else _ms(linger))

    def __enter__(self: E) -> E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PushSocket(_Endpoint[T]):
    def __init__(
        self,
        codec: Codec[T],
        address: str,
        *,
        bind: bool = False,
        send_timeout: float = 5.0,
        linger: float = 1.0,
        hwm: int | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        socket = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDTIMEO, _ms(send_timeout))
        super().__init__(socket, codec, address, bind, linger, hwm)

    def send(self, msg: T) -> None:
        """Queue `msg`; TimeoutError if no peer takes it within `send_timeout`."""
        self.send_encoded(self.codec.encode(msg))

    def send_encoded(self, data: bytes) -> None:
        """Queue a message this socket's codec already encoded (one encoding, many peers)."""
        try:
            self.socket.send(data)
        except zmq.Again:
            raise TimeoutError(
                f"no peer took a {self.codec.name} message on {self.address}"
            ) from None


class PullSocket(_Endpoint[T]):
    def __init__(
        self,
        codec: Codec[T],
        address: str,
        *,
        bind: bool = True,
        linger: float = 0.0,
        hwm: int | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        socket = (ctx or zmq.Context.instance()).socket(zmq.PULL)
        super().__init__(socket, codec, address, bind, linger, hwm)

    def recv(self, timeout: float) -> T | None:
        """The next message, or None if none arrives within `timeout` seconds (0: poll); raises
        `MessageError` for bytes that are not a message of this socket's union."""
        if not self.socket.poll(_ms(timeout), zmq.POLLIN):
            return None
        return self.codec.decode(self.socket.recv(zmq.NOBLOCK))

    def drain(self, max_messages: int | None = None) -> list[T]:
        """Every message already queued (at most `max_messages`), without waiting."""
        messages: list[T] = []
        while max_messages is None or len(messages) < max_messages:
            try:
                data = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            messages.append(self.codec.decode(data))
        return messages


class AsyncPushSocket(_Endpoint[T]):
    def __init__(
        self,
        codec: Codec[T],
        address: str,
        *,
        bind: bool = False,
        send_timeout: float = 5.0,
        linger: float = 1.0,
        hwm: int | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        socket = (ctx or zmq.asyncio.Context.instance()).socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDTIMEO, _ms(send_timeout))
        super().__init__(socket, codec, address, bind, linger, hwm)

    async def send(self, msg: T) -> None:
        """Queue `msg` without blocking the loop; TimeoutError after `send_timeout`."""
        try:
            await self.socket.send(self.codec.encode(msg))
        except zmq.Again:
            raise TimeoutError(
                f"no peer took a {self.codec.name} message on {self.address}"
            ) from None


class AsyncPullSocket(_Endpoint[T]):
    def __init__(
        self,
        codec: Codec[T],
        address: str,
        *,
        bind: bool = True,
        linger: float = 0.0,
        hwm: int | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        socket = (ctx or zmq.asyncio.Context.instance()).socket(zmq.PULL)
        super().__init__(socket, codec, address, bind, linger, hwm)

    async def recv(self, timeout: float) -> T | None:
        """The next message, or None if none arrives within `timeout` seconds."""
        if not await self.socket.poll(_ms(timeout), zmq.POLLIN):
            return None
        return self.codec.decode(await self.socket.recv(zmq.NOBLOCK))
