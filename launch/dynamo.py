"""`iris serve --dynamo`: what the launcher does differently for a Dynamo worker.

The children are the same; the KV events are turned on, on local sockets if the
command line named none (each replica on its own port), and the server role's
`serve_dynamo` runs instead of `serve_http` (`server/dynamo/worker.py`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import socket

from ..scheduler import EngineConfig
from .args import ServeArgs


class DynamoMissing(RuntimeError):
    """`--dynamo` without Dynamo's runtime installed."""


def check_dynamo_installed() -> None:
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.llm") is None:
        raise DynamoMissing(
            "--dynamo needs NVIDIA Dynamo's runtime: pip install 'iris-serve[dynamo]'"
        )


def with_kv_events(args: ServeArgs) -> ServeArgs:
    """`args` with the KV events on: as given, or on free loopback ports."""
    if args.engine.get("kv_events_config") is not None:
        return args
    port = free_ports(args.data_parallel_size)
    events = json.dumps({"endpoint": f"tcp://127.0.0.1:{port}"})
    return dataclasses.replace(args, engine={**args.engine, "kv_events_config": events})


def event_endpoints(engine: EngineConfig, replicas: int) -> tuple[str, ...]:
    """Where each replica's KV events can be read on this node."""
    config = engine.kv_events
    assert config is not None, "with_kv_events turned them on"
    local = config.endpoint.replace("tcp://*:", "tcp://127.0.0.1:")
    local = local.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
    return tuple(config.endpoint_of(local, replica) for replica in range(replicas))


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports free now."""
    for _ in range(64):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        if all(_free(first + offset) for offset in range(1, count)):
            return first
    raise OSError(f"found no {count} consecutive free ports for the KV events")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
