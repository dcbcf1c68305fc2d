"""The composition root (`docs/design.md`, "Packages and seams"): `iris` and its
subcommands, the launcher of `iris serve`, and the flags derived from the roles' config
dataclasses.

Its own public surface, for the benchmarks, resolved on first use: `main` (the `iris`
command), `ServeArgs` and `parse_serve_args` (`iris serve`'s flags), `engine_config` and
`worker_config` (the roles' settings those flags give), `usable_cores` (the CPUs the
scheduler's threads are sized from).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .args import ServeArgs, parse_serve_args
    from .cli import main
    from .launcher import engine_config, usable_cores, worker_config

__all__ = [
    "ServeArgs",
    "engine_config",
    "main",
    "parse_serve_args",
    "usable_cores",
    "worker_config",
]
_HOMES = {
    "ServeArgs": "args",
    "parse_serve_args": "args",
    "main": "cli",
    "engine_config": "launcher",
    "usable_cores": "launcher",
    "worker_config": "launcher",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
