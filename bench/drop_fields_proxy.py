"""A pass-through HTTP proxy that drops named top-level fields from JSON request bodies.

    python -m bench.drop_fields_proxy --upstream http://127.0.0.1:8000 --port 8100 --drop ignore_eos

Why: `vllm bench serve` always sends `ignore_eos` with its random datasets, and
`transformers serve` answers any field it does not know with a 422. `bench.peers` puts
one in front of `transformers serve` (`ProxyServer`), saying `ignore_eos` its way.

It is kept cheap because it shares the cores with the server it measures: each request
(HTTP/1.1 with a Content-Length body) gets its own upstream connection, the request head
is rewritten (Content-Length, `Connection: close`) and the body filtered, and then the
response is copied back as raw bytes as they arrive -- no parsing of the stream, one
`Connection: close` header added so the client does not reuse the connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

from bench.server_process import REPO, IrisServer

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 64 * 1024
_HOP = (b"connection", b"keep-alive")
_REPLACED = (*_HOP, b"content-length", b"host")


def drop_fields(body: bytes, fields: frozenset[str], min_new_tokens: bool = False) -> bytes:
    """`body` without the named top-level keys when it is a JSON object, else unchanged.

    `min_new_tokens`: a request with `ignore_eos` true gets `transformers serve`'s own way
    of saying it, a `generation_config` of `{"min_new_tokens": its max tokens}` (EOS is
    masked until then), so its answer has exactly that many tokens, as on a server that
    honours `ignore_eos`."""
    if not body or not fields:
        return body
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict) or fields.isdisjoint(payload):
        return body
    wanted = payload.get("max_completion_tokens") or payload.get("max_tokens")
    kept = {k: v for k, v in payload.items() if k not in fields}
    if min_new_tokens and payload.get("ignore_eos") is True and wanted:
        kept["generation_config"] = json.dumps({"min_new_tokens": int(wanted)})
    return json.dumps(kept).encode()


class ProxyServer(IrisServer):
    """This proxy in front of `upstream`, dropping `ignore_eos`, started and stopped the
    way `IrisServer` does it."""

    label = "drop_fields_proxy"
    iris_metrics = False

    def __init__(self, upstream: str, flags: Sequence[str] = ()) -> None:
        super().__init__(REPO, ["--drop", "ignore_eos", *flags], start_timeout=60.0)
        self.upstream = upstream

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "bench.drop_fields_proxy", "--upstream", self.upstream,
            "--port", str(self.port), *self.flags,
        ]  # fmt: skip


def _split_head(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    first, *lines = head.split(b"\r\n")
    headers = []
    for line in lines:
        name, _, value = line.partition(b":")
        headers.append((name.strip(), value.strip()))
    return first, headers


def _join_head(first: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"\r\n".join([first, *(name + b": " + value for name, value in headers)]) + _HEAD_END


def _keep(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() not in _REPLACED]


class DropFieldsProxy:
    def __init__(self, upstream: str, fields: frozenset[str], min_new_tokens: bool = False) -> None:
        url = urlsplit(upstream)
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or 80
        self.fields = fields
        self.min_new_tokens = min_new_tokens

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._one_request(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _one_request(self, reader, writer) -> None:
        first, headers = _split_head((await reader.readuntil(_HEAD_END))[: -len(_HEAD_END)])
        lengths = [int(v) for k, v in headers if k.lower() == b"content-length"]
        if any(k.lower() == b"transfer-encoding" for k, _ in headers):
            writer.write(b"HTTP/1.1 411 Length Required\r\nConnection: close\r\n\r\n")
            return
        body = await reader.readexactly(lengths[0]) if lengths else b""
        body = drop_fields(body, self.fields, self.min_new_tokens)
        host = f"{self.host}:{self.port}".encode()
        head = [*_keep(headers), (b"Host", host), (b"Connection", b"close")]
        if lengths:
            head.append((b"Content-Length", str(len(body)).encode()))
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        try:
            up_writer.write(_join_head(first, head) + body)
            await up_writer.drain()
            # The response head, with `Connection: close`; then the body as raw bytes.
            status, response_headers = _split_head(
                (await up_reader.readuntil(_HEAD_END))[: -len(_HEAD_END)]
            )
            kept = [
                (k, v)
                for k, v in response_headers
                if k.lower() not in (b"connection", b"keep-alive")
            ]
            writer.write(_join_head(status, [*kept, (b"Connection", b"close")]))
            while chunk := await up_reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        finally:
            up_writer.close()


async def serve(
    upstream: str, host: str, port: int, fields: frozenset[str], min_new_tokens: bool = False
) -> None:
    proxy = DropFieldsProxy(upstream, fields, min_new_tokens)
    server = await asyncio.start_server(proxy.handle, host, port, limit=_MAX_HEAD)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--drop", nargs="+", default=["ignore_eos"], help="top-level fields")
    parser.add_argument(
        "--ignore-eos-as-min-new-tokens",
        action="store_true",
        help="turn `ignore_eos: true` into transformers serve's generation_config "
        "min_new_tokens (see drop_fields)",
    )
    args = parser.parse_args(argv)
    fields = frozenset(args.drop)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            serve(args.upstream, args.host, args.port, fields, args.ignore_eos_as_min_new_tokens)
        )


if __name__ == "__main__":
    main()
