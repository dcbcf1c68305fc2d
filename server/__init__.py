"""The HTTP role: the OpenAI-compatible API, streaming, detokenization, tool calls and
structured-output checks.

Its public surface (`docs/design.md`, "Packages and seams"), resolved on first use:

- `HttpServerConfig`, `serve_http`: the HTTP process body, run by the launcher once the
  children are ready; `import_http_side`: its heavy imports, done while they start;
- `AppSettings`: what the API serves (model names, limits, sampling defaults);
- `sampling_defaults`: `--generation-config`'s defaults, read before start-up so a bad
  value fails at once;
- `DynamoWorkerConfig`, `serve_dynamo`: the same role as an NVIDIA Dynamo backend worker
  (`iris serve --dynamo`), in place of `serve_http`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .app import AppSettings
    from .dynamo.worker import DynamoWorkerConfig, serve_dynamo
    from .generation_config import sampling_defaults
    from .http_process import HttpServerConfig, import_http_side, serve_http

__all__ = [
    "AppSettings",
    "DynamoWorkerConfig",
    "HttpServerConfig",
    "import_http_side",
    "sampling_defaults",
    "serve_dynamo",
    "serve_http",
]
_HOMES = {
    "AppSettings": "app",
    "DynamoWorkerConfig": "dynamo.worker",
    "serve_dynamo": "dynamo.worker",
    "HttpServerConfig": "http_process",
    "import_http_side": "http_process",
    "serve_http": "http_process",
    "sampling_defaults": "generation_config",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
