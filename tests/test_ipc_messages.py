"""Wire messages (round trips, size bounds, errors) and the typed ZMQ sockets."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from iris_serve.ipc.codec import Codec, MessageError, pack_token_ids, unpack_token_ids
from iris_serve.ipc.messages import (
    READY,
    SCHEDULER_TO_TOKENIZER,
    SERVER_TO_TOKENIZER,
    TO_SERVER,
    TOKENIZER_TO_SCHEDULER,
    AbortEngineRequest,
    AbortRequest,
    EngineRequest,
    ImageRef,
    ProcessFailed,
    ProcessReady,
    ReleaseImages,
    RequestError,
    RequestOutput,
    Sampling,
    SchedulerReady,
    ShmPointer,
    TokenBatch,
    TokenizeRequest,
)
from iris_serve.ipc.sockets import (
    AsyncPullSocket,
    AsyncPushSocket,
    PullSocket,
    PushSocket,
    ipc_address,
)

RECV_TIMEOUT_S = 10.0
IMAGE_PAD = 151655  # Qwen2-VL's <|image_pad|>: above 65535, so 5 bytes as a msgpack int

# A 1920×1080 image after Qwen2-VL's smart resize: grid (1, 68, 120) → 8160 patches of
# 3·2·14·14 = 1176 values, 2040 tokens after the 2×2 merge.
FULL_HD = ShmPointer(
    worker_id=3,
    segment="iris-123456-0123abcd-w3",
    offset=1 << 33,
    nbytes=8160 * 1176 * 4,
    dtype="float32",
    shape=(8160, 1176),
    generation=(1 << 62) + 12345,
)


def engine_request(num_images: int, num_text_tokens: int = 300) -> EngineRequest:
    token_ids: list[int] = list(range(1000, 1000 + num_text_tokens))
    images = []
    for i in range(num_images):
        images.append(ImageRef(bytes([i]) * 16, len(token_ids), 2040, (1, 68, 120), FULL_HD))
        token_ids += [IMAGE_PAD] * 2040
    return EngineRequest(
        f"chatcmpl-{'f' * 32}",
        pack_token_ids(token_ids),
        Sampling(max_tokens=512, temperature=0.7, top_p=0.9, seed=1234, stop_token_ids=(7, 8)),
        images,
    )


SCHEDULER_READY = SchedulerReady(
    "scheduler-dp1", 4096, "Qwen3VLForConditionalGeneration", "cuda:1", "bfloat16",
    kv_pages=1000, page_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
)  # fmt: skip
MESSAGES: list[tuple[Codec, msgspec.Struct]] = [
    (
        SERVER_TO_TOKENIZER,
        TokenizeRequest(
            "r1",
            Sampling(max_tokens=8),
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]}
            ],
            max_pixels=1280 * 28 * 28,
        ),
    ),
    (SERVER_TO_TOKENIZER, TokenizeRequest("r2", Sampling(), prompt="Hello")),
    (SERVER_TO_TOKENIZER, TokenizeRequest("r3", Sampling(ignore_eos=True), prompt=[1, 2, 3])),
    (SERVER_TO_TOKENIZER, AbortRequest("r1")),
    (TOKENIZER_TO_SCHEDULER, engine_request(num_images=2)),
    (TOKENIZER_TO_SCHEDULER, EngineRequest("r4", pack_token_ids([1, 2]), Sampling())),
    (TOKENIZER_TO_SCHEDULER, AbortEngineRequest("r4")),
    (SCHEDULER_TO_TOKENIZER, ReleaseImages([FULL_HD.handle, FULL_HD.handle])),
    (
        TO_SERVER,
        TokenBatch(
            [
                RequestOutput("r1", [5]),
                RequestOutput("r2", [6, 7], True, "length", 2300, 2048, 16),
            ]
        ),
    ),
    (TO_SERVER, RequestError("r3", 400, "image 2: cannot decode", param="messages")),
    (READY, SCHEDULER_READY),
    (READY, ProcessReady("tokenizer-0")),
    (READY, ProcessFailed("scheduler-rank1", "RuntimeError: NCCL timed out")),
]


@pytest.mark.parametrize(("codec", "msg"), MESSAGES, ids=lambda x: type(x).__name__)
def test_every_message_round_trips_through_its_union(codec: Codec, msg: msgspec.Struct) -> None:
    decoded = codec.decode(codec.encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_full_hd_image_costs_tens_of_bytes_not_its_pixels() -> None:
    one, two = engine_request(num_images=1), engine_request(num_images=2)
    size_one = len(TOKENIZER_TO_SCHEDULER.encode(one))
    size_two = len(TOKENIZER_TO_SCHEDULER.encode(two))
    assert size_one < 4 * 1024 + len(one.token_ids)
    # What one more 1920×1080 image adds besides its 2040 token ids: its ImageRef only.
    per_image = size_two - size_one - 2040 * 4
    assert per_image < 160, per_image
    assert size_two < 4 * 1024 + len(two.token_ids)


def test_token_ids_pack_to_four_bytes_each() -> None:
    ids = [0, 1, 127, 128, 65535, 65536, IMAGE_PAD, 2**31 - 1]
    data = pack_token_ids(ids)
    assert len(data) == 4 * len(ids)
    assert unpack_token_ids(data) == ids
    assert EngineRequest("r", data, Sampling()).num_tokens == len(ids)


def test_unknown_tag_and_garbage_are_clear_errors() -> None:
    with pytest.raises(
        MessageError, match=r"unknown tag 99 \(expected one of \[40, 41, 42, 43\]\)"
    ):
        TO_SERVER.decode(msgspec.msgpack.encode([99, "r1"]))
    # A valid message of another direction is an unknown tag here too.
    with pytest.raises(MessageError, match="unknown tag 11"):
        TO_SERVER.decode(SERVER_TO_TOKENIZER.encode(AbortRequest("r1")))
    with pytest.raises(MessageError, match="malformed"):
        TO_SERVER.decode(b"\xc1")
    with pytest.raises(MessageError, match="length >= 16"):
        TOKENIZER_TO_SCHEDULER.decode(
            msgspec.msgpack.encode([20, "r", b"", [], [[b"short", 0, 1, [1, 2, 2], None]]])
        )
    with pytest.raises(TypeError, match="not a →server message"):
        TO_SERVER.encode(AbortRequest("r1"))  # type: ignore[arg-type]


def test_invalid_messages_are_refused_on_decode() -> None:
    bad_tokenize = msgspec.msgpack.encode([10, "r", []])  # neither messages nor prompt
    with pytest.raises(MessageError, match="exactly one of"):
        SERVER_TO_TOKENIZER.decode(bad_tokenize)
    bad_span = msgspec.msgpack.encode(
        [20, "r", pack_token_ids([1, 2]), [], [[b"k" * 16, 1, 5, [1, 2, 2], None]]]
    )
    with pytest.raises(MessageError, match="exceeds 2 tokens"):
        TOKENIZER_TO_SCHEDULER.decode(bad_span)


# --- sockets -----------------------------------------------------------------------


@pytest.fixture
def address(tmp_path: Path) -> str:
    return ipc_address(tmp_path, "scheduler")


def receive(pull: PullSocket, n: int) -> list:
    """`n` messages: wait (bounded) for one, then take what is already queued."""
    got: list = []
    while len(got) < n:
        msg = pull.recv(timeout=RECV_TIMEOUT_S)
        assert msg is not None, f"only {len(got)} of {n} messages in {RECV_TIMEOUT_S} s"
        got += [msg, *pull.drain(max_messages=n - len(got) - 1)]
    return got


def test_push_pull_round_trip(address: str) -> None:
    with (
        PullSocket(TOKENIZER_TO_SCHEDULER, address) as pull,
        PushSocket(TOKENIZER_TO_SCHEDULER, address) as push,
    ):
        sent = [engine_request(1), AbortEngineRequest("r1"), engine_request(0)] * 20
        for msg in sent:
            push.send(msg)
        assert receive(pull, len(sent)) == sent
        assert pull.drain() == []


def test_recv_times_out_instead_of_hanging(address: str) -> None:
    with PullSocket(TO_SERVER, address) as pull:
        start = time.monotonic()
        assert pull.recv(timeout=0.05) is None
        assert pull.recv(timeout=0) is None
        assert pull.drain() == []
        assert time.monotonic() - start < 2.0


def test_send_without_a_peer_times_out(address: str) -> None:
    with PushSocket(TO_SERVER, address, bind=True, send_timeout=0.05, linger=0) as push:
        with pytest.raises(TimeoutError, match="no peer took"):
            push.send(RequestError("r", 500, "x"))
        with pytest.raises(TypeError):
            push.send(AbortRequest("r"))  # type: ignore[arg-type]


def test_recv_of_garbage_raises_and_the_socket_keeps_working(address: str) -> None:
    with PullSocket(TO_SERVER, address) as pull:
        raw = zmq.Context.instance().socket(zmq.PUSH)
        try:
            raw.connect(address)
            raw.send(b"\xc1")
            raw.send(TO_SERVER.encode(RequestError("r", 400, "bad")))
            with pytest.raises(MessageError):
                pull.recv(timeout=RECV_TIMEOUT_S)
            assert pull.recv(timeout=RECV_TIMEOUT_S) == RequestError("r", 400, "bad")
        finally:
            raw.close(linger=0)


def test_async_round_trip_and_timeout(address: str) -> None:
    async def main() -> None:
        with (
            AsyncPullSocket(TO_SERVER, address) as pull,
            AsyncPushSocket(TO_SERVER, address) as push,
        ):
            assert await pull.recv(timeout=0.05) is None
            batch = TokenBatch([RequestOutput("r1", [1, 2, 3], True, "stop", 5, 0, 3)])
            await push.send(batch)
            assert await pull.recv(timeout=RECV_TIMEOUT_S) == batch
        lonely = AsyncPushSocket(TO_SERVER, address, bind=True, send_timeout=0.05, linger=0)
        with lonely, pytest.raises(TimeoutError, match="no peer took"):
            await lonely.send(RequestError("r", 500, "x"))

    asyncio.run(asyncio.wait_for(main(), timeout=2 * RECV_TIMEOUT_S))


def test_ipc_address_is_checked(tmp_path: Path) -> None:
    assert ipc_address(tmp_path, "tokenizer-0") == f"ipc://{tmp_path}/tokenizer-0.sock"
    with pytest.raises(ValueError, match="longer than"):
        ipc_address(tmp_path / ("x" * 120), "scheduler")
    with pytest.raises(ValueError):
        ipc_address(tmp_path, "../escape")
