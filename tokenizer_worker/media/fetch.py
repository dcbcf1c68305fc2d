"""Image and video bytes from a URL, within limits, and images' decoding: the worker's
attack surface (videos are decoded by `video_decode`).

Sources: `data:image/...;base64,` URLs (`data:video/...` for a video); `http(s)://` (a timeout per fetch, a size cap
read as a stream, redirects only between http and https and only to allowed hosts, an
optional host allow-list, and no loopback, private or other non-public address unless
the operator allows it, checked on the address connected to, on every hop:
`media_hosts`; environment proxies are not used, since a proxy would connect where
the check cannot see); local files (`file:///...` or an absolute path) only under an
allowed folder, symlinks and `..` resolved first. Anything else is refused. Decoding
checks the pixel count on the header before the pixels are decoded (decompression
bombs), refuses truncated files and opens only common raster formats (never EPS, which
would run Ghostscript). Every failure a client can cause is a `MediaError` (→ 400).
Videos are fetched under the same rules, with their own size cap.
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from time import monotonic
from typing import Any, NamedTuple
from urllib.parse import unquote, urljoin, urlsplit

from PIL import Image, ImageFile

from ..config import WorkerConfig
from .hosts import HostPolicy, RefusedHost

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG covers MPO
LOCAL_FILES_DISABLED = "local files are disabled, start the server with --allowed-local-media-path"
_CHUNK = 1 << 16
_MAX_PARALLEL_FETCHES = 8


class MediaError(ValueError):
    """An image or video the client sent cannot be used; the request fails with `status`."""

    status = 400

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class _Kind(NamedTuple):
    """What a URL is expected to hold: `noun` for messages, a data URL's MIME type
    (`mime/...`), the byte cap."""

    noun: str
    mime: str
    max_bytes: int


class MediaFetcher:
    """Fetches the encoded bytes of image and video URLs under one policy. Thread-safe."""

    def __init__(
        self,
        *,
        allowed_local_media_path: str | Path | None = None,
        allowed_media_domains: Sequence[str] | None = None,
        allow_private_hosts: bool = False,
        timeout_s: float = 10.0,
        max_bytes: int = 32 << 20,
        max_video_bytes: int = 128 << 20,
    ) -> None:
        self.local_root: Path | None = None
        if allowed_local_media_path is not None:
            self.local_root = Path(allowed_local_media_path).resolve(strict=True)
            if not self.local_root.is_dir():
                raise ValueError(f"allowed local media path {self.local_root} is no folder")
        self.domains = (
            None if allowed_media_domains is None else {d.lower() for d in allowed_media_domains}
        )
        self.hosts = HostPolicy(self.domains, allow_private_hosts)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_video_bytes = max_video_bytes
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, config: WorkerConfig) -> MediaFetcher:
        return cls(
            allowed_local_media_path=config.allowed_local_media_path,
            allowed_media_domains=config.allowed_media_domains,
            allow_private_hosts=config.allow_private_media_hosts,
            timeout_s=config.media_timeout_s,
            max_bytes=config.max_image_bytes,
            max_video_bytes=config.max_video_bytes,
        )

    def fetch_all(
        self, urls: Sequence[str], parts: Sequence[str] | None = None, *, video: bool = False
    ) -> list[bytes]:
        """Every URL's bytes in order (of videos when `video`); remote ones are fetched in
        parallel.

        The first failure in prompt order is raised, prefixed with where its part is:
        `parts[i]` (e.g. `messages[0].content[1]`, then also the error's `param`), else
        the image's (video's) number.
        """
        kind = self._kind(video)
        remote = [i for i, url in enumerate(urls) if _scheme(url) in ("http", "https")]
        futures: dict[int, Future[bytes]] = {}
        if len(remote) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_MAX_PARALLEL_FETCHES, "iris-media")
            futures = {i: self._pool.submit(self.fetch, urls[i], video) for i in remote}
        try:
            results = []
            for i, url in enumerate(urls):
                try:
                    results.append(futures[i].result() if i in futures else self.fetch(url, video))
                except MediaError as e:
                    if parts is None:
                        raise MediaError(f"{kind.noun} {i + 1}: {e.message}", e.param) from None
                    raise MediaError(f"{parts[i]}: {e.message}", parts[i]) from None
            return results
        finally:
            for future in futures.values():
                future.cancel()

    def fetch(self, url: str, video: bool = False) -> bytes:
        """The bytes `url` names: an image's, or a video's when `video`."""
        kind = self._kind(video)
        if not isinstance(url, str) or not url:
            raise MediaError(f"the {kind.noun} URL must be a non-empty string")
        scheme = _scheme(url)
        if scheme == "data":
            return self._decode_data_url(url, kind)
        if scheme in ("http", "https"):
            return self._fetch_http(url, kind)
        if scheme == "file":
            return self._read_local(_file_url_path(url), url, kind)
        if url.startswith("/"):
            return self._read_local(Path(url), url, kind)
        raise MediaError(
            f"unsupported URL scheme in {_short(url)}: use data:{kind.mime}/...;base64, "
            "http(s):// or, with --allowed-local-media-path, file://"
        )

    def _kind(self, video: bool) -> _Kind:
        if video:
            return _Kind("video", "video", self.max_video_bytes)
        return _Kind("image", "image", self.max_bytes)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- data: ---------------------------------------------------------------------

    def _decode_data_url(self, url: str, kind: _Kind) -> bytes:
        header, comma, payload = url[len("data:") :].partition(",")
        params = [p.strip().lower() for p in header.split(";")]
        if not comma or not params[0].startswith(f"{kind.mime}/"):
            raise MediaError(
                f"a data URL of {kind.noun}s must start with data:{kind.mime}/<type>: {_short(url)}"
            )
        if params[-1] != "base64":
            raise MediaError(f"a data URL must be base64-encoded (';base64,'): {_short(url)}")
        max_bytes = kind.max_bytes
        if len(payload) // 4 * 3 > max_bytes + 3:
            raise MediaError(f"the data URL holds more than {max_bytes} bytes")
        # Missing padding is unambiguous, so it is tolerated; anything else is not.
        missing = -len(payload) % 4
        try:
            if missing == 3:
                raise ValueError("a base64 payload cannot end with a single character")
            data = base64.b64decode(payload + "=" * missing, validate=True)
        except ValueError as e:  # binascii.Error, or a non-ASCII character
            raise MediaError(f"invalid base64 in the data URL: {e}") from None
        if not data:
            raise MediaError("the data URL holds no data")
        if len(data) > max_bytes:
            raise MediaError(f"the data URL holds more than {max_bytes} bytes")
        return data

    # --- local files -----------------------------------------------------------------

    def _read_local(self, path: Path, url: str, kind: _Kind) -> bytes:
        if self.local_root is None:
            raise MediaError(LOCAL_FILES_DISABLED)
        try:
            resolved = path.resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # missing, symlink loop, NUL byte
            raise MediaError(f"no such file: {_short(url)}") from None
        if not resolved.is_relative_to(self.local_root):
            raise MediaError(f"{_short(url)} is not under the allowed local media path")
        if not resolved.is_file():
            raise MediaError(f"{_short(url)} is not a regular file")
        try:
            with resolved.open("rb") as f:
                data = f.read(kind.max_bytes + 1)
        except OSError as e:
            raise MediaError(f"cannot read {_short(url)}: {e.strerror}") from None
        if len(data) > kind.max_bytes:
            raise MediaError(f"{_short(url)} is larger than {kind.max_bytes} bytes")
        return data

    # --- http(s) -------------------------------------------------------------------

    def _check_remote(self, url: str) -> None:
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError as e:
            raise MediaError(f"malformed URL {_short(url)}: {e}") from None
        if parts.scheme.lower() not in ("http", "https"):
            raise MediaError(
                f"refused a redirect to {_short(url)}: only http and https are followed"
            )
        if not host:
            raise MediaError(f"no host in URL {_short(url)}")
        if self.domains is not None and host not in self.domains:
            raise MediaError(
                f"host {host!r} is not in the allowed media domains (--allowed-media-domains)"
            )

    def _fetch_http(self, url: str, kind: _Kind) -> bytes:
        self._check_remote(url)
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),
            _CheckedHTTPHandler(self.hosts),
            _CheckedHTTPSHandler(self.hosts),
            _RedirectHandler(self._check_remote),
        )
        request = urllib.request.Request(
            url, headers={"User-Agent": "iris", "Accept": f"{kind.mime}/*"}
        )
        deadline = monotonic() + self.timeout_s
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                length = response.headers.get("Content-Length", "")
                if length.isdigit() and int(length) > kind.max_bytes:
                    raise MediaError(f"{_short(url)} is larger than {kind.max_bytes} bytes")
                body = self._read_capped(response, url, deadline, kind.max_bytes)
                if length.isdigit() and len(body) < int(length):  # http.client does not say
                    raise MediaError(
                        f"cannot fetch {_short(url)}: the body ended after {len(body)} of "
                        f"its {length} bytes"
                    )
                return body
        except MediaError:
            raise
        except RefusedHost as e:
            raise MediaError(f"refused {_short(url)}: {e}") from None
        except urllib.error.HTTPError as e:
            raise MediaError(f"fetching {_short(url)} failed: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise self._timed_out(url) from None
            raise MediaError(f"cannot fetch {_short(url)}: {reason}") from None
        except (http.client.HTTPException, OSError, ValueError) as e:
            raise MediaError(f"cannot fetch {_short(url)}: {type(e).__name__}: {e}") from None

    def _read_capped(self, response: Any, url: str, deadline: float, max_bytes: int) -> bytes:
        """The body, refusing more than `max_bytes` or a trickle past the deadline.

        The socket timeout bounds each read; the deadline bounds the whole body, so a
        fetch takes at most about twice `timeout_s`.
        """
        chunks: list[bytes] = []
        total = 0
        while chunk := response.read1(_CHUNK):
            total += len(chunk)
            if total > max_bytes:
                raise MediaError(f"{_short(url)} is larger than {max_bytes} bytes")
            if monotonic() > deadline:
                raise self._timed_out(url)
            chunks.append(chunk)
        return b"".join(chunks)

    def _timed_out(self, url: str) -> MediaError:
        return MediaError(f"fetching {_short(url)} timed out after {self.timeout_s:g} s")


class _CheckedHTTPHandler(urllib.request.HTTPHandler):
    """http:// through connections that connect only where `hosts` allows."""

    def __init__(self, hosts: HostPolicy) -> None:
        super().__init__()
        self._hosts = hosts

    def http_open(self, req):  # type: ignore[no-untyped-def]
        return self.do_open(
            functools.partial(_checked, http.client.HTTPConnection, self._hosts), req
        )


class _CheckedHTTPSHandler(urllib.request.HTTPSHandler):
    """https:// likewise; TLS still checks the certificate against the host's name."""

    def __init__(self, hosts: HostPolicy) -> None:
        super().__init__()
        self._hosts = hosts

    def https_open(self, req):  # type: ignore[no-untyped-def]
        connection = functools.partial(_checked, http.client.HTTPSConnection, self._hosts)
        return self.do_open(connection, req, context=self._context)  # pyright: ignore[reportAttributeAccessIssue]: HTTPSHandler's, not in typeshed


def _checked(
    cls: type[http.client.HTTPConnection], hosts: HostPolicy, *args: Any, **kwargs: Any
) -> http.client.HTTPConnection:
    """A connection of `cls` that connects through `hosts` (resolve, check, connect to
    the checked address) instead of `socket.create_connection`."""
    connection = cls(*args, **kwargs)
    connection._create_connection = hosts.connect  # type: ignore[attr-defined]
    return connection


class _RedirectHandler(urllib.request.HTTPRedirectHandler):
    """Checks every redirect target's scheme and host name before following it; its
    address is checked when its connection is made, as every hop's is."""

    max_redirections = 5

    def __init__(self, check: Callable[[str], None]) -> None:
        self._check = check

    def http_error_302(self, req, fp, code, msg, headers):  # type: ignore[no-untyped-def]
        location = headers.get("location") or headers.get("uri")
        if location:
            try:
                self._check(urljoin(req.full_url, location))
            except MediaError:
                fp.close()
                raise
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode encoded image bytes; the size is checked on the header, before decoding."""
    # A truncated file is the client's error: never pad it with grey (PIL's option).
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        raise MediaError(f"the image is too large to decode: {e}") from None
    except Exception:  # any parser error on client bytes
        raise MediaError(
            f"the data is not an image in a supported format ({', '.join(IMAGE_FORMATS)})"
        ) from None
    _check_size(image, max_pixels)
    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise MediaError(f"the image is too large to decode: {e}") from None
    except Exception as e:
        raise MediaError(f"cannot decode the {image.format} image: {e}") from None
    _check_size(image, max_pixels)
    return image


def _check_size(image: Image.Image, max_pixels: int) -> None:
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(
            f"the image is {width}x{height} = {width * height} pixels, "
            f"more than the limit of {max_pixels}"
        )
    if width < 1 or height < 1:
        raise MediaError(f"the image is empty ({width}x{height})")


def _scheme(url: object) -> str:
    if not isinstance(url, str):
        return ""
    head, colon, _ = url.partition(":")
    return head.lower() if colon and head.isascii() and head.isalpha() else ""


def _file_url_path(url: str) -> Path:
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise MediaError(f"malformed file URL {url!r}: {e}") from None
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/"):
        raise MediaError(f"a file URL must name an absolute local path (file:///...): {url!r}")
    return Path(path)


def _short(url: str, limit: int = 80) -> str:
    """The URL for an error message (a data URL can be megabytes)."""
    return url if len(url) <= limit else url[: limit - 3] + "..."
