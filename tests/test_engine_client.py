"""`ZmqEngineClient` over real ZMQ sockets: fake workers and a fake scheduler in one loop."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import zmq.asyncio

from iris_serve.ipc.messages import (
    SERVER_TO_TOKENIZER,
    TO_SERVER,
    AbortRequest,
    EngineStats,
    RequestError,
    RequestOutput,
    Sampling,
    TokenBatch,
    TokenizeRequest,
    TokenLogprob,
    WorkerStats,
)
from iris_serve.ipc.sockets import AsyncPullSocket, AsyncPushSocket, ipc_address
from iris_serve.server.engine_client import EngineRequestError, ZmqEngineClient
from iris_serve.server.image_router import affinity_hash

WAIT = 5.0


class Harness:
    def __init__(self, run_dir: Path, ctx: zmq.asyncio.Context, replicas: int = 1) -> None:
        self.client = ZmqEngineClient(run_dir, num_workers=2, num_replicas=replicas)
        self.workers = [
            AsyncPullSocket(SERVER_TO_TOKENIZER, ipc_address(run_dir, f"tokenizer-{i}"), ctx=ctx)
            for i in range(2)
        ]
        self.scheduler = AsyncPushSocket(TO_SERVER, ipc_address(run_dir, "server"), ctx=ctx)

    async def received(self, worker: int):
        message = await self.workers[worker].recv(WAIT)
        assert message is not None, f"worker {worker} got nothing"
        return message

    async def send(self, *messages: TokenBatch | RequestError) -> None:
        for message in messages:
            await self.scheduler.send(message)


def _run(test: Callable[[Harness], Awaitable[None]], replicas: int = 1) -> None:
    async def main() -> None:
        # A short run dir: ipc:// paths are limited to 107 bytes.
        with tempfile.TemporaryDirectory(prefix="iris-") as run_dir:
            ctx = zmq.asyncio.Context()
            harness = Harness(Path(run_dir), ctx, replicas)
            await harness.client.start()
            try:
                await asyncio.wait_for(test(harness), WAIT * 2)
            finally:
                await harness.client.close()
                for sock in [*harness.workers, harness.scheduler]:
                    sock.close(linger=0)
                ctx.term()

    asyncio.run(main())


def _request(request_id: str) -> TokenizeRequest:
    return TokenizeRequest(request_id, Sampling(max_tokens=4), prompt="hi")


def _out(request_id: str, tokens: list[int], finish: str | None = None) -> RequestOutput:
    done = finish is not None
    return RequestOutput(request_id, tokens, done, finish, 5, 0, len(tokens))


def test_routing_dispatch_and_unknown_ids():
    async def test(h: Harness) -> None:
        streams = {rid: h.client.generate(_request(rid)) for rid in ("a", "b")}
        firsts = {rid: asyncio.ensure_future(anext(s)) for rid, s in streams.items()}
        # Fewest in flight: the two requests go to different workers.
        got = {(await h.received(0)).request_id, (await h.received(1)).request_id}
        assert got == {"a", "b"}
        assert h.client.num_in_flight == 2

        await h.send(TokenBatch([_out("b", [7]), _out("a", [1]), _out("ghost", [9])]))
        assert (await firsts["a"]).new_token_ids == [1]
        assert (await firsts["b"]).new_token_ids == [7]
        await h.send(TokenBatch([_out("a", [2], "length")]))
        last_a = await anext(streams["a"])
        assert last_a.finished and last_a.finish_reason == "length"
        with pytest.raises(StopAsyncIteration):
            await anext(streams["a"])

        with_logprobs = [_out("b", [8]), _out("b", [9], "stop")]
        for output, token in zip(with_logprobs, (8, 9), strict=True):
            output.logprobs = [TokenLogprob(token, -1.0)]
        await h.send(TokenBatch(with_logprobs))
        rest = [o async for o in streams["b"]]  # queued outputs may arrive merged
        # merged or not, every token keeps its logprobs, in order
        assert [lp.token_id for o in rest for lp in o.logprobs or []] == [8, 9]
        assert [t for o in rest for t in o.new_token_ids] == [8, 9]
        assert rest[-1].finished and rest[-1].finish_reason == "stop"
        assert h.client.num_in_flight == 0

        # Late outputs of finished requests are dropped; the next request still works.
        # Gauges go to the metrics board.
        engine_stats = EngineStats(1, 2, 3, 40, 5)
        await h.send(TokenBatch([_out("a", [3])]), engine_stats, WorkerStats(1, 10, 100, 2))
        stream = h.client.generate(_request("c"))
        first = asyncio.ensure_future(anext(stream))
        await h.received(0)  # both idle again: round-robin picks worker 0
        await h.send(TokenBatch([_out("c", [4], "length")]))
        assert (await first).new_token_ids == [4]
        assert h.client.metrics.engines[0] == engine_stats  # sent before "c"'s output
        assert h.client.metrics.workers[1].arena_used_bytes == 10

    _run(test)


def test_a_replica_a_cluster_router_chose_is_where_the_request_goes():
    """Dynamo's KV router chose data-parallel replica 1 (it routed on that replica's KV
    events): the request goes to the worker feeding replica 1, where the image router
    (both idle: round-robin from worker 0) would have sent it to replica 0's."""

    async def test(h: Harness) -> None:
        stream = h.client.generate(_request("a"), replica=1)
        first = asyncio.ensure_future(anext(stream))
        assert (await h.received(1)).request_id == "a"
        await h.send(TokenBatch([_out("a", [1], "length")]))
        assert (await first).finished
        stream = h.client.generate(_request("b"))  # no choice made: the image router's
        first = asyncio.ensure_future(anext(stream))
        assert (await h.received(0)).request_id == "b"
        await h.send(TokenBatch([_out("b", [1], "length")]))
        assert (await first).finished

    _run(test, replicas=2)


def test_a_number_beyond_64_bits_in_a_free_form_field_is_a_400_naming_it():
    """JSON integers are unbounded; the messages' extra keys and the tools go on to the
    worker as they came, in msgpack, whose integers are 64-bit: such a request is the
    client's error, naming the field, and nothing of it stays in flight."""

    async def test(h: Harness) -> None:
        messages = [{"role": "user", "content": "hi", "note": 2**70}]
        request = TokenizeRequest("big", Sampling(max_tokens=4), messages=messages)
        with pytest.raises(EngineRequestError) as raised:
            await anext(h.client.generate(request))
        error = raised.value
        assert (error.status, error.param) == (400, "messages"), error.message
        tools = [
            {"type": "function", "function": {"name": "f", "parameters": {"maximum": -(2**64)}}}
        ]
        request = TokenizeRequest("big2", Sampling(max_tokens=4), messages=[], tools=tools)
        with pytest.raises(EngineRequestError, match="tools: holds an integer"):
            await anext(h.client.generate(request))
        request = TokenizeRequest("big3", Sampling(max_tokens=4, seed=2**65), prompt="hi")
        with pytest.raises(EngineRequestError, match="seed: holds an integer"):
            await anext(h.client.generate(request))
        assert h.client.num_in_flight == 0

    _run(test)


def _chat(request_id: str, *turns: list[str]) -> TokenizeRequest:
    """A conversation: one user message per turn with these image URLs, answered."""
    messages: list[dict] = []
    for urls in turns:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": "?"}]})
        messages.append({"role": "assistant", "content": "ok"})
    return TokenizeRequest(request_id, Sampling(max_tokens=4), messages=messages[:-1])


def test_requests_go_to_the_worker_that_holds_their_images():
    urls = [f"https://example.com/{i}.png" for i in range(9)]
    by_worker = {affinity_hash(url) % 2: url for url in urls}  # one URL for each worker
    a, b = by_worker[0], by_worker[1]

    async def test(h: Harness) -> None:
        streams = {}

        async def send(request: TokenizeRequest, worker: int) -> None:
            stream = h.client.generate(request)
            streams[request.request_id] = asyncio.ensure_future(anext(stream))
            assert await h.received(worker) == request, request.request_id

        # Three turns of one conversation stay on worker 0, where its first image went.
        await send(_chat("turn1", [a]), 0)
        await send(_chat("turn2", [a], ["https://example.com/new.png"]), 0)
        await send(_chat("turn3", [a], [], ["https://example.com/new2.png"]), 0)
        await send(_chat("text", []), 1)  # text only: the least loaded worker
        await send(_request("prompt"), 1)  # completions: text only too
        await send(_chat("other", [b]), 1)
        await h.send(TokenBatch([_out(rid, [1], "length") for rid in streams]))
        for first in streams.values():
            assert (await first).finished

    _run(test)


def test_request_error_raises_engine_request_error():
    async def test(h: Harness) -> None:
        stream = h.client.generate(_request("bad"))
        first = asyncio.ensure_future(anext(stream))
        await h.received(0)
        await h.send(RequestError("bad", 400, "unreadable image", param="messages"))
        with pytest.raises(EngineRequestError) as error:
            await first
        assert (error.value.status, error.value.message) == (400, "unreadable image")
        assert (error.value.type, error.value.param) == ("invalid_request_error", "messages")
        assert h.client.num_in_flight == 0

    _run(test)


def test_abort_goes_to_the_worker_that_has_the_request():
    async def test(h: Harness) -> None:
        streams = [h.client.generate(_request(rid)) for rid in ("x", "y")]
        pending = [asyncio.ensure_future(anext(s)) for s in streams]
        owner = {(await h.received(w)).request_id: w for w in (0, 1)}

        await h.client.abort("y")
        abort = await h.received(owner["y"])
        assert abort == AbortRequest("y")
        ended = await pending[1]  # the aborted stream ends at once
        assert ended.finished and ended.finish_reason == "abort"
        await h.send(TokenBatch([_out("y", [1]), _out("x", [2], "length")]))  # "y" dropped
        assert (await pending[0]).new_token_ids == [2]
        await h.client.abort("y")  # idempotent: nothing more is sent
        await h.client.abort("never-seen")

        # A consumer that stops iterating early aborts its request too.
        stream = h.client.generate(_request("z"))
        first = asyncio.ensure_future(anext(stream))
        worker = 0  # both workers idle again: round-robin comes back to worker 0
        assert await h.received(worker) == _request("z")
        await h.send(TokenBatch([_out("z", [5])]))
        assert (await first).new_token_ids == [5]
        await stream.aclose()
        assert await h.received(worker) == AbortRequest("z")
        assert await h.workers[1 - worker].recv(0.05) is None  # nothing stray elsewhere

    _run(test)


def test_close_ends_requests_in_flight():
    async def test(h: Harness) -> None:
        stream = h.client.generate(_request("q"))
        first = asyncio.ensure_future(anext(stream))
        await h.received(0)
        await h.client.close()
        with pytest.raises(EngineRequestError) as error:
            await first
        assert error.value.status == 503

    _run(test)


def test_app_over_zmq(qwen2_vl_tiny: Path):
    """The app with a `ZmqEngineClient` (started by its lifespan) and a fake engine
    process on the other side of the sockets: a worker that answers with tokens."""
    import threading

    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from iris_serve.ipc.sockets import PullSocket, PushSocket
    from iris_serve.server.app import AppSettings, create_app

    tokens = AutoTokenizer.from_pretrained(qwen2_vl_tiny).encode("Hello world, how are you?")
    seen: list[object] = []
    stop, aborted = threading.Event(), threading.Event()

    def fake_engine(run_dir: Path, ctx: zmq.Context) -> None:
        with (
            PullSocket(SERVER_TO_TOKENIZER, ipc_address(run_dir, "tokenizer-0"), ctx=ctx) as pull,
            PushSocket(TO_SERVER, ipc_address(run_dir, "server"), ctx=ctx) as push,
        ):
            while not stop.is_set():
                message = pull.recv(0.05)
                if message is not None:
                    seen.append(message)
                if isinstance(message, AbortRequest):
                    aborted.set()
                elif isinstance(message, TokenizeRequest):
                    rid = message.request_id
                    push.send(EngineStats(0, 0, 0, 64, 0))  # before the tokens: seen by then
                    endless = message.sampling.max_tokens == 0  # never finishes on its own
                    for n, token in enumerate(tokens):
                        last = n == len(tokens) - 1 and not endless
                        finish = "length" if last else None
                        push.send(
                            TokenBatch([RequestOutput(rid, [token], last, finish, 9, 4, n + 1)])
                        )

    with tempfile.TemporaryDirectory(prefix="iris-") as run_dir:
        ctx = zmq.Context()
        worker = threading.Thread(target=fake_engine, args=(Path(run_dir), ctx), daemon=True)
        worker.start()
        settings = AppSettings(str(qwen2_vl_tiny), ("tiny",), 128)
        app = create_app(settings, ZmqEngineClient(Path(run_dir), num_workers=1))
        try:
            with TestClient(app) as client:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
                answer = client.post("/v1/chat/completions", json=body).json()
                assert answer["choices"][0]["message"]["content"] == "Hello world, how are you?"
                assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
                metrics = client.get("/metrics").text
                assert 'iris_num_requests_running{model_name="tiny"} 0.0' in metrics.splitlines()

                body = {"messages": body["messages"], "stream": True, "stop": ", how"}
                streamed = client.post("/v1/chat/completions", json=body).text
                assert '"finish_reason":"stop"' in streamed and "how" not in streamed
                assert aborted.wait(WAIT), "the stop string did not abort the request"
        finally:
            stop.set()
            worker.join(WAIT)
            ctx.term()
    requests = [m for m in seen if isinstance(m, TokenizeRequest)]
    assert [r.sampling.max_tokens for r in requests] == [8, 0]
    assert seen[-1] == AbortRequest(requests[1].request_id)  # the stop string aborted it
