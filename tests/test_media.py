"""Image sources and their limits: data URLs, http(s) on a local server, local files, decoding.

Every fetch goes to 127.0.0.1 and nowhere else: no name server is asked (`localhost` is
127.0.0.1, other names resolve to nothing), and the rules for other addresses are
checked on literal addresses, never by connecting.
"""

from __future__ import annotations

import base64
import io
import ipaddress
import socket
import struct
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from PIL import Image

from iris_serve.tokenizer_worker.media import hosts as media_hosts
from iris_serve.tokenizer_worker.media.fetch import (
    LOCAL_FILES_DISABLED,
    MediaError,
    MediaFetcher,
    decode_image,
)
from iris_serve.tokenizer_worker.media.hosts import address_rule
from tests.reference import make_image

KiB = 1024


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width`x`height`, followed by a few bytes of pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)


PNG = encode(make_image(40, 30, seed=1))


@pytest.fixture(autouse=True)
def no_name_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names resolve without asking any name server: `localhost` to 127.0.0.1 alone
    (some hosts list ::1 first), address literals to themselves, any other name to
    nothing."""
    resolve = socket.getaddrinfo

    def local_only(host: str, *args: object, **kwargs: object) -> list:
        if host == "localhost":
            return resolve("127.0.0.1", *args, **kwargs)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, f"{host} is not resolved in tests") from None
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)


def local(**kwargs: object) -> MediaFetcher:
    """A fetcher that may fetch from the test's server on 127.0.0.1."""
    return MediaFetcher(allow_private_hosts=True, **kwargs)  # type: ignore[arg-type]


# --- http(s) -----------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, dict[str, str], bytes]]] = {}
    release: ClassVar[threading.Event]
    paths: ClassVar[list[str]] = []  # every request's path, in order
    hosts: ClassVar[list[str]] = []  # and its Host header

    def do_GET(self) -> None:
        self.paths.append(self.path)
        self.hosts.append(self.headers.get("Host", ""))
        try:
            if self.path == "/slow":  # headers, then nothing until the test ends
                self._head(200, {"Content-Length": str(len(PNG))})
                self.release.wait(10)
            elif self.path == "/trickle":  # a byte every 20 ms: each read is quick
                self._head(200, {"Content-Length": str(len(PNG))})
                for byte in PNG:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    if self.release.wait(0.02):
                        return
            elif self.path in ("/reset", "/cut"):  # half the body, then a reset or a close
                self._head(200, {"Content-Length": str(len(PNG))})
                self.wfile.write(PNG[: len(PNG) // 2])
                self.wfile.flush()
                if self.path == "/reset":  # SO_LINGER 0: close sends RST, not FIN
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                self.close_connection = True
            elif self.path == "/stream-big":  # no Content-Length: read until close
                self.close_connection = True
                self._head(200, {})
                self.wfile.write(b"x" * (4 * KiB))
            else:
                status, headers, body = self.routes.get(self.path, (404, {}, b"not found"))
                self._head(status, {"Content-Length": str(len(body)), **headers})
                self.wfile.write(body)
        except OSError:  # the client gave up (timeout, size cap)
            pass

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    base = f"http://127.0.0.1:{httpd.server_port}"
    _Handler.release = threading.Event()
    _Handler.routes = {
        "/ok.png": (200, {"Content-Type": "image/png"}, PNG),
        "/declared-big": (200, {}, b"x" * (4 * KiB)),
        "/to-ok": (302, {"Location": "/ok.png"}, b""),
        "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
        "/to-localhost": (302, {"Location": f"http://localhost:{httpd.server_port}/ok.png"}, b""),
    }
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield base
    _Handler.release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_http_ok_and_redirect_within_http(server: str) -> None:
    fetcher = local(timeout_s=5)
    assert fetcher.fetch(f"{server}/ok.png") == PNG
    assert fetcher.fetch(f"{server}/to-ok") == PNG


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/missing.png", "HTTP 404"),
        ("/declared-big", "larger than 1024 bytes"),
        ("/stream-big", "larger than 1024 bytes"),
        ("/to-file", "refused a redirect to file:///etc/passwd"),
    ],
)
def test_http_errors(server: str, path: str, message: str) -> None:
    with pytest.raises(MediaError, match=message) as error:
        local(timeout_s=5, max_bytes=KiB).fetch(f"{server}{path}")
    assert error.value.param == "messages"
    assert error.value.status == 400


@pytest.mark.parametrize("path", ["/reset", "/cut"])
def test_a_host_that_resets_or_cuts_the_body_is_a_400_naming_the_url(server: str, path: str):
    with pytest.raises(MediaError, match=rf"cannot fetch {server}{path}") as error:
        local(timeout_s=5).fetch(f"{server}{path}")
    assert error.value.status == 400


@pytest.mark.parametrize("path", ["/slow", "/trickle"])
def test_http_timeout(server: str, path: str) -> None:
    with pytest.raises(MediaError, match=r"timed out after 0.2 s"):
        local(timeout_s=0.2).fetch(f"{server}{path}")


def test_domain_allow_list(server: str) -> None:
    allowed = MediaFetcher(allowed_media_domains=["127.0.0.1"], timeout_s=5)
    assert allowed.fetch(f"{server}/ok.png") == PNG
    with pytest.raises(MediaError, match="'localhost' is not in the allowed media domains"):
        allowed.fetch(f"{server}/to-localhost")  # a redirect is checked too
    with pytest.raises(MediaError, match=r"'127\.0\.0\.1' is not in the allowed media domains"):
        MediaFetcher(allowed_media_domains=["example.com"]).fetch(f"{server}/ok.png")


def test_fetch_all_keeps_order_and_names_the_failing_image(server: str) -> None:
    fetcher = local(timeout_s=5)
    urls = [f"{server}/ok.png", data_url(PNG), f"{server}/to-ok"]
    assert fetcher.fetch_all(urls) == [PNG, PNG, PNG]
    with pytest.raises(MediaError, match=r"^image 2: fetching .* HTTP 404"):
        fetcher.fetch_all([f"{server}/ok.png", f"{server}/nope", f"{server}/ok.png"])
    parts = ["messages[0].content[0]", "messages[2].content[1]"]
    with pytest.raises(MediaError, match=r"^messages\[2\]\.content\[1\]: fetching .* 404") as e:
        fetcher.fetch_all([f"{server}/ok.png", f"{server}/nope"], parts)
    assert e.value.param == "messages[2].content[1]"
    fetcher.close()


# --- which hosts: judged on the address connected to -----------------------------------

REFUSED_ADDRESSES = {
    "127.0.0.1": "loopback",
    "127.9.9.9": "loopback",
    "::1": "loopback",
    "10.0.0.1": "private",
    "172.16.5.4": "private",
    "192.168.1.1": "private",
    "fd00::1": "private",
    "169.254.169.254": "link-local",  # cloud metadata services
    "fe80::1": "link-local",
    "fe80::1%eth0": "link-local",
    "224.0.0.1": "multicast",
    "ff02::1": "multicast",
    "0.0.0.0": "unspecified",
    "::": "unspecified",
    "240.0.0.1": "reserved",
    "100.64.0.1": "not global",  # shared address space (carrier-grade NAT)
    "::ffff:127.0.0.1": "loopback",  # IPv4-mapped IPv6
    "::ffff:169.254.169.254": "link-local",
    "::ffff:10.0.0.1": "private",
    "2002:a9fe:a9fe::": "link-local",  # 6to4 of 169.254.169.254
    "64:ff9b::a00:1": "private",  # NAT64 of 10.0.0.1
}
PUBLIC_ADDRESSES = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                    "64:ff9b::808:808", "2002:808:808::"]  # fmt: skip


@pytest.mark.parametrize("address", REFUSED_ADDRESSES)
def test_address_rules(address: str) -> None:
    assert address_rule(address) == REFUSED_ADDRESSES[address]


@pytest.mark.parametrize("address", PUBLIC_ADDRESSES)
def test_public_addresses_pass(address: str) -> None:
    assert address_rule(address) is None


def test_private_hosts_are_refused_by_default_before_any_request(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    _Handler.paths.clear()
    refusals = {
        f"{server}/ok.png": "127.0.0.1 is a loopback address",
        f"http://localhost:{port}/ok.png": "host 'localhost' resolves to a loopback address",
        f"https://127.0.0.1:{port}/ok.png": "127.0.0.1 is a loopback address",
    }
    for url, says in refusals.items():
        with pytest.raises(MediaError) as refused:
            MediaFetcher(timeout_s=5).fetch(url)
        assert says in refused.value.message
        assert "--allowed-media-domains" in refused.value.message
        assert "--allow-private-media-hosts" in refused.value.message
    assert _Handler.paths == []


def test_the_flag_or_naming_the_host_lets_a_private_host_serve(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    assert local(timeout_s=5).fetch(f"{server}/ok.png") == PNG
    named = MediaFetcher(allowed_media_domains=["127.0.0.1"], timeout_s=5)
    assert named.fetch(f"{server}/ok.png") == PNG
    named = MediaFetcher(allowed_media_domains=["LocalHost"], timeout_s=5)
    assert named.fetch(f"http://localhost:{port}/to-localhost") == PNG


def test_a_redirect_from_an_allowed_host_to_a_private_one_is_refused(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _Handler.paths.clear()
    named = MediaFetcher(allowed_media_domains=["127.0.0.1"], timeout_s=5)
    with pytest.raises(MediaError, match="'localhost' is not in the allowed media domains"):
        named.fetch(f"{server}/to-localhost")
    # Without an allow-list, the hop's own connection is judged on its address: here
    # 127.0.0.1 plays a public host for the first connection, and only for it.
    judged: list[str] = []

    def public_once(address: str) -> str | None:
        judged.append(address)
        return None if len(judged) == 1 else address_rule(address)

    monkeypatch.setattr(media_hosts, "address_rule", public_once)
    with pytest.raises(MediaError, match="host 'localhost' resolves to a loopback address"):
        MediaFetcher(timeout_s=5).fetch(f"{server}/to-localhost")
    assert judged == ["127.0.0.1", "127.0.0.1"]
    assert _Handler.paths == ["/to-localhost", "/to-localhost"]


def test_a_name_is_resolved_once_and_its_checked_address_connected_to(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS rebinding: a name that answers a public address to the check and a private
    one to the connection gets no second question. "rebind.test" answers 127.0.0.1 (here
    judged public) once; a second lookup fails the test."""
    port = server.rsplit(":", 1)[1]
    resolve = socket.getaddrinfo
    lookups: list[str] = []

    def rebinding(host: str, *args: object, **kwargs: object) -> list:
        if host != "rebind.test":
            return resolve(host, *args, **kwargs)
        lookups.append(host)
        assert len(lookups) == 1, "the name was looked up again"
        return resolve("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(media_hosts, "address_rule", lambda address: None)
    _Handler.hosts.clear()
    assert MediaFetcher(timeout_s=5).fetch(f"http://rebind.test:{port}/ok.png") == PNG
    assert lookups == ["rebind.test"]
    assert _Handler.hosts == [f"rebind.test:{port}"]  # the name, though the address was dialled


# --- data: URLs and schemes ----------------------------------------------------------


def test_data_url_and_missing_padding() -> None:
    fetcher = MediaFetcher()
    assert fetcher.fetch(data_url(PNG)) == PNG
    data = PNG[:-1] if len(PNG) % 3 == 0 else PNG
    unpadded = data_url(data).rstrip("=")
    assert fetcher.fetch(unpadded) == data


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,iVBO*w0K", "invalid base64"),
        ("data:image/png;base64,iVBORw0KG", "invalid base64"),  # 4n + 1 characters
        ("data:image/png;base64,", "holds no data"),
        ("data:text/plain;base64,aGVsbG8=", "must start with data:image/"),
        ("data:image/png,rawbytes", "must be base64-encoded"),
        ("data:image/png;base64" + "A" * 8, "must start with data:image/"),
        (data_url(b"x" * (2 * KiB)), "more than 1024 bytes"),
        ("http://[::1/a.png", "malformed URL"),
        ("https:///a.png", "no host"),
        ("http://exa mple.com/a.png", "cannot fetch"),
        ("ftp://example.com/a.png", "unsupported URL scheme"),
        ("images/a.png", "unsupported URL scheme"),
        ("", "non-empty string"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        MediaFetcher(max_bytes=KiB).fetch(url)


# --- local files -----------------------------------------------------------------------


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "a b.png").write_bytes(PNG)
    (root / "sub" / "c.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    (root / "inner-link.png").symlink_to(root / "sub" / "c.png")
    return root


def test_local_files_under_the_allowed_path(media_root: Path) -> None:
    fetcher = MediaFetcher(allowed_local_media_path=media_root)
    assert fetcher.fetch(str(media_root / "a b.png")) == PNG
    assert fetcher.fetch(f"file://{media_root}/a%20b.png") == PNG
    assert fetcher.fetch(f"file://localhost{media_root}/sub/c.png") == PNG
    assert fetcher.fetch(str(media_root / "inner-link.png")) == PNG
    assert fetcher.fetch(f"{media_root}/sub/../sub/c.png") == PNG


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("../secret.png", "not under the allowed local media path"),
        ("sub/../../secret.png", "not under the allowed local media path"),
        ("link.png", "not under the allowed local media path"),
        ("missing.png", "no such file"),
        ("sub", "not a regular file"),
    ],
)
def test_local_files_outside_or_missing(media_root: Path, name: str, message: str) -> None:
    fetcher = MediaFetcher(allowed_local_media_path=media_root)
    with pytest.raises(MediaError, match=message):
        fetcher.fetch(f"{media_root}/{name}")
    with pytest.raises(MediaError, match=message):
        fetcher.fetch(f"file://{media_root}/{name}")


def test_local_files_disabled_and_remote_file_urls(media_root: Path) -> None:
    for url in (str(media_root / "a b.png"), f"file://{media_root}/sub/c.png"):
        with pytest.raises(MediaError) as error:
            MediaFetcher().fetch(url)
        assert error.value.message == LOCAL_FILES_DISABLED
    with pytest.raises(MediaError, match="absolute local path"):
        MediaFetcher(allowed_local_media_path=media_root).fetch(f"file://host{media_root}/a.png")
    with pytest.raises(MediaError, match="larger than 100 bytes"):
        MediaFetcher(allowed_local_media_path=media_root, max_bytes=100).fetch(
            str(media_root / "sub" / "c.png")
        )


# --- decoding --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_decode_formats(fmt: str) -> None:
    image = decode_image(encode(make_image(33, 21, seed=3), fmt), max_pixels=10_000)
    assert image.size == (33, 21)


DECODE_ERRORS = {
    "text": (b"definitely not an image", "not an image in a supported format"),
    "eps": (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not an image"),
    "truncated png": (PNG[: len(PNG) // 2], "cannot decode the PNG image"),
    "truncated jpeg": (encode(make_image(64, 64), "JPEG")[:-400], "cannot decode the JPEG image"),
    "pixels missing": (png_header(100, 100), "cannot decode the PNG image"),
    "over the limit": (png_header(3000, 3000), "9000000 pixels, more than the limit of 1000000"),
    "bomb": (png_header(100_000, 100_000), "too large to decode"),  # PIL's own check
}


@pytest.mark.parametrize("case", DECODE_ERRORS)
def test_decode_errors(case: str) -> None:
    data, message = DECODE_ERRORS[case]
    with pytest.raises(MediaError, match=message):
        decode_image(data, max_pixels=1_000_000)
