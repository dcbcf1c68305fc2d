"""KV events on the wire, as vLLM publishes them (`--kv-events-config`), so that the
routers reading vLLM read Iris unchanged: Dynamo's relay (`KvEventPublisher` with a ZMQ
endpoint) and llm-d's scorer.

A ZMQ PUB socket sends each step's events as one multipart message `[topic, sequence
number (8 bytes, big-endian), msgpack KVEventBatch]`; with a `replay_endpoint`, a ROUTER
socket answers a subscriber that missed some (it sends the first sequence number it
wants) with the batches still buffered, then sequence number -1. Each data-parallel
replica publishes its own stream, on the endpoint's port plus its rank (`_dp<rank>`
after an ipc path), and says its rank in every batch. Sending never blocks a step: PUB
drops what a slow subscriber cannot take (`hwm`), and the replay buffer is bounded.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

from .kv_events import KvEvent, KVEventBatch

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's `KVEventsConfig` fields, by the same names and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null" (vLLM's default when events are off)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        """`--kv-events-config`'s JSON; ValueError naming what is wrong."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-events-config is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {field.name: field for field in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(
                f"--kv-events-config: unknown field {unknown[0]!r} (known: {', '.join(known)})"
            )
        if "enable_kv_cache_events" not in value:  # as vLLM: a config given turns them on
            value["enable_kv_cache_events"] = True
        if value.get("enable_kv_cache_events") and "publisher" not in value:
            value["publisher"] = "zmq"
        config = cls(**value)
        config._check()
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def endpoint_of(self, endpoint: str, replica: int) -> str:
        """vLLM's per-replica endpoint: the port plus the replica's rank (tcp), or the path
        with `_dp<rank>` appended (ipc)."""
        if replica == 0:
            return endpoint
        if endpoint.startswith("ipc://"):
            return f"{endpoint}_dp{replica}"
        match = re.match(r"^(.*):(\d+)$", endpoint)
        if match is None:
            raise ValueError(f"--kv-events-config: no port in endpoint {endpoint!r}")
        return f"{match.group(1)}:{int(match.group(2)) + replica}"

    def _check(self) -> None:
        checks: list[tuple[str, Any, type]] = [
            ("enable_kv_cache_events", self.enable_kv_cache_events, bool),
            ("publisher", self.publisher, str),
            ("endpoint", self.endpoint, str),
            ("topic", self.topic, str),
        ]
        checks += [(name, getattr(self, name), int) for name in ("buffer_steps", "hwm")]
        checks.append(("max_queue_size", self.max_queue_size, int))
        for name, value, kind in checks:
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"--kv-events-config: {name} must be a {kind.__name__}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("--kv-events-config: replay_endpoint must be a string")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {self.publisher!r} (zmq or null)")
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError("--kv-events-config: buffer_steps must be positive, hwm >= 0")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"--kv-events-config: {endpoint!r} is not tcp:// or ipc://")


class ZmqEventPublisher:
    """One replica's event stream (see the module); `publish` once per step, in its loop."""

    def __init__(self, config: KvEventsConfig, replica: int) -> None:
        self.replica = replica
        self._topic = config.topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = config.endpoint_of(config.endpoint, replica)
        self._pub.bind(self.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.endpoint_of(config.replay_endpoint, replica))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = 0

    def publish(self, events: list[KvEvent]) -> None:
        """Sends the step's events (nothing when there are none) and answers replays."""
        if events:
            batch = KVEventBatch(time.time(), list(events), self.replica)
            payload = self._encoder.encode(batch)
            sequence = self._sequence.to_bytes(8, "big", signed=True)
            self._buffer.append((self._sequence, payload))
            self._sequence += 1
            # past the high-water mark the message is dropped; the replay buffer keeps it
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart((self._topic, sequence, payload), flags=zmq.NOBLOCK)
        if self._replay is not None:
            self._answer_replays(self._replay)

    def close(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    def _answer_replays(self, replay: zmq.Socket[bytes]) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for sequence, payload in self._buffer:
                if sequence >= start:
                    seq = sequence.to_bytes(8, "big", signed=True)
                    replay.send_multipart((client, b"", seq, payload))
            replay.send_multipart((client, b"", END_OF_REPLAY, b""))
