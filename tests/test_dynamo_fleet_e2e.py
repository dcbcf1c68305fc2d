"""Iris behind NVIDIA Dynamo (`docs/scale-out.md`, "A fleet"): Dynamo's frontend with its
KV router, two `iris serve --dynamo` workers on the tiny Qwen2.5-VL checkpoint, on
127.0.0.1 with file discovery and the ZMQ event plane, and one plain `iris serve` to
compare with.

What a user of the fleet relies on: image and video chats through the frontend answer as one Iris
node does; an agent's next turn lands on the worker that holds its history and finds it
cached (the router follows Iris's KV events, images included); a cancelled stream frees
its pages; what Iris refuses comes back through the frontend as an error naming it and
costs the worker nothing; a worker killed mid-run fails its own requests only, and the
router stops sending to it.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.dynamo_fleet import DynamoFleet, FleetProcess, dynamo_fleet
from iris_serve.ipc.shm_names import sweep_orphans
from tests.reference import make_image
from tests.server_harness import RunningServer, iris_server
from tests.video_clips import make_clip, video_data_url

MODEL = "iris-tiny"  # --served-model-name of every server here
SYSTEM = "You are a careful assistant for a desktop agent. " * 12  # a long shared head
WAIT_SECONDS = 60.0


def data_url(seed: int, size: int = 112) -> str:
    buffer = io.BytesIO()
    make_image(size, size, seed=seed).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(seed: int, size: int = 112) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(seed, size)}}


@pytest.fixture(scope="module")
def fleet(qwen2_5_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoFleet]:
    run_dir = tmp_path_factory.mktemp("fleet")
    try:
        limits = ("--limit-mm-per-prompt", "3", "--served-model-name", MODEL)
        with dynamo_fleet(qwen2_5_vl_tiny, run_dir, workers=2, worker_args=limits) as running:
            for worker in running.workers:  # a node the router lists already answers /health
                health = httpx.get(f"{worker.url}/health", timeout=10)
                assert health.status_code == 200, f"{worker.name}: {health.status_code}"
            yield running
    finally:
        sweep_orphans()  # a killed worker's segments, as the next Iris start would


@pytest.fixture(scope="module")
def single(
    qwen2_5_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    with iris_server(
        qwen2_5_vl_tiny,
        *("--tokenizer-workers", "1", "--served-model-name", MODEL),
        tmp_path=tmp_path_factory.mktemp("one"),
    ) as server:
        yield server


def chat(base_url: str, messages: list[dict], **fields) -> httpx.Response:
    body = {"model": fields.pop("model", MODEL), "messages": messages, "max_tokens": 8,
            "temperature": 0, **fields}  # fmt: skip
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=WAIT_SECONDS)


def streamed_text(base_url: str, messages: list[dict]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
            "stream": True}  # fmt: skip
    text = []
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, timeout=WAIT_SECONDS
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", ()):
                    text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


VIDEO_PART = {"type": "video_url", "video_url": {"url": video_data_url(make_clip(8, fps=4.0))}}


def test_image_and_video_chats_through_the_frontend_answer_as_one_iris_node(
    fleet: DynamoFleet, single: RunningServer
) -> None:
    conversations = [
        [{"role": "user", "content": [image_part(1), {"type": "text", "text": "What is this?"}]}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part(2),
                                      image_part(3, 56), {"type": "text", "text": "please."}]}],
        [{"role": "user", "content": [image_part(4, 56), VIDEO_PART,
                                      {"type": "text", "text": "What happens?"}]}],
    ]  # fmt: skip
    for messages in conversations:
        want = chat(single.base_url, messages)
        assert want.status_code == 200, want.text
        got = chat(fleet.base_url, messages)
        assert got.status_code == 200, got.text
        assert (
            got.json()["choices"][0]["message"]["content"]
            == (want.json()["choices"][0]["message"]["content"])
        )
        assert got.json()["usage"]["prompt_tokens"] == want.json()["usage"]["prompt_tokens"]
        assert (
            streamed_text(fleet.base_url, messages)
            == (want.json()["choices"][0]["message"]["content"])
        )
    # a completion: the frontend templates nothing and routes it to the same workers
    body = {"model": MODEL, "prompt": SYSTEM + "Hello", "max_tokens": 6, "temperature": 0}
    want, got = (
        httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_SECONDS)
        for url in (single.base_url, fleet.base_url)
    )
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["completion_tokens"] == want.json()["usage"]["completion_tokens"]
    # the frontend detokenizes by its own rules (a control character Iris leaves out comes
    # through there): the printable text must agree
    printable = [
        "".join(c for c in r.json()["choices"][0]["text"] if c.isprintable()) for r in (got, want)
    ]
    assert printable[0] == printable[1], printable
    # n answers, seeded: each as one node draws it
    seeded = {"n": 3, "temperature": 1.0, "seed": 7}
    want, got = (
        [c["message"]["content"] for c in chat(url, conversations[0], **seeded).json()["choices"]]
        for url in (single.base_url, fleet.base_url)
    )
    assert got == want and len(set(got)) > 1, got
    # logprobs, each token's and its two most likely ones', as one node gives them
    asked = {"logprobs": True, "top_logprobs": 2}
    want, got = (
        chat(url, conversations[0], **asked).json()["choices"][0]["logprobs"]["content"]
        for url in (single.base_url, fleet.base_url)
    )
    assert [t["token"] for t in got] == [t["token"] for t in want]
    for ours, theirs in zip(got, want, strict=True):
        assert [t["token"] for t in ours["top_logprobs"]] == [
            t["token"] for t in theirs["top_logprobs"]
        ]
        assert ours["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)


def test_returning_agents_land_on_the_worker_holding_their_history(fleet: DynamoFleet) -> None:
    agents = 4
    histories = [[{"role": "system", "content": f"Agent {a}. " + SYSTEM}] for a in range(agents)]
    previous = [0] * agents
    returning, found = 0, 0
    for turn in range(3):
        for agent in range(agents):
            history = histories[agent]
            history.append({"role": "user", "content": [
                image_part(100 * agent + turn), {"type": "text", "text": f"Step {turn}: next?"}]})  # fmt: skip
            response = chat(fleet.base_url, history)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            if turn:
                returning += 1
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                found += cached >= 0.8 * previous[agent]
            previous[agent] = usage["prompt_tokens"]
            history.append({"role": "assistant", "content": f"Clicked button {turn}."})
    # Only the worker that served an agent's last turn holds its screenshots: finding them
    # cached is landing there (which worker that is, the router decides by overlap and load).
    assert found >= 0.9 * returning, f"{found} of {returning} returning turns found their history"


def wait_idle(fleet: DynamoFleet) -> None:
    """Every live worker runs nothing, holds no KV page and no arena pin (bounded)."""
    deadline = time.monotonic() + WAIT_SECONDS
    figures: list[tuple[float, float, float]] = []
    while time.monotonic() < deadline:
        figures = [
            (w.metric("iris_num_requests_running"), w.metric("iris_kv_cache_used_pages"),
             w.metric("iris_scheduler_pinned_images"))
            for w in fleet.workers if w.name not in fleet.killed
        ]  # fmt: skip
        if all(figure == (0, 0, 0) for figure in figures):
            return
        time.sleep(0.05)  # polling other processes' gauges, bounded above
    raise AssertionError(f"workers not idle (running, KV pages, pins): {figures}")


def test_a_cancelled_stream_frees_its_pages(fleet: DynamoFleet) -> None:
    body = {"model": MODEL, "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True, "messages": [{"role": "user", "content": [
                image_part(7), {"type": "text", "text": "Describe at length."}]}]}  # fmt: skip
    with httpx.stream(
        "POST", f"{fleet.base_url}/v1/chat/completions", json=body, timeout=WAIT_SECONDS
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    wait_idle(fleet)


def test_what_iris_refuses_is_an_error_naming_it_and_costs_nothing(fleet: DynamoFleet) -> None:
    four = [{"role": "user", "content": [*(image_part(seed, 56) for seed in range(4)),
                                         {"type": "text", "text": "Hi"}]}]  # fmt: skip
    response = chat(fleet.base_url, four)
    assert response.status_code == 400, response.text
    assert "at most 3 images" in response.text, response.text
    broken = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "Hi"}]}]  # fmt: skip
    response = chat(fleet.base_url, broken)
    assert 400 <= response.status_code < 500, response.text
    response = chat(fleet.base_url, [{"role": "user", "content": "Hi"}], use_beam_search=True)
    assert response.status_code == 400 and "use_beam_search" in response.text, response.text
    wait_idle(fleet)
    ok = chat(fleet.base_url, [{"role": "user", "content": [image_part(6)]}])
    assert ok.status_code == 200, ok.text


def test_pages_spilled_to_the_host_tier_still_route_the_prompt_back(
    qwen2_5_vl_tiny: Path, tmp_path: Path
) -> None:
    """A node's host tier is a medium the router reads: a prompt whose pages were evicted
    from the device into host memory still counts as overlap there (without the host's
    events only its first block, which every prompt shares, would)."""
    small = ("--served-model-name", MODEL, "--kv-cache-memory", "1MiB", "--kv-offload-gib", "0.01")
    with dynamo_fleet(qwen2_5_vl_tiny, tmp_path, workers=1, worker_args=small) as one:
        stories = [[{"role": "user", "content": f"Story {i}: " + "word " * 500}] for i in range(6)]
        for story in stories:  # 33 blocks each; the device holds 128: the first spills
            assert chat(one.base_url, story, max_tokens=1).status_code == 200
        again = chat(one.base_url, stories[0], max_tokens=1)
        assert again.status_code == 200, again.text
        [worker] = one.workers
        assert worker.metric("iris_prefix_cache_host_hit_tokens_total") > 0
        routed = re.findall(r"overlap_blocks=(\d+)", ANSI.sub("", one.frontend.log))
        blocks = again.json()["usage"]["prompt_tokens"] // 16
        assert int(routed[-1]) >= blocks // 2, f"the router saw {routed[-1]} of {blocks} blocks"


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def running_worker(fleet: DynamoFleet) -> FleetProcess:
    """The one worker whose /metrics shows a request running (its stats come a step or a
    stats interval after the stream's first line; bounded)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        running = [w for w in fleet.workers if w.metric("iris_num_requests_running") > 0]
        if running:
            assert len(running) == 1, "one stream runs on one worker"
            return running[0]
        time.sleep(0.05)  # polling other processes' gauges, bounded above
    raise AssertionError(f"no worker shows the stream running in {WAIT_SECONDS} s")


def test_a_killed_worker_fails_only_its_requests(fleet: DynamoFleet) -> None:
    body = {"model": MODEL, "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Count slowly."}]}  # fmt: skip
    with httpx.stream(
        "POST", f"{fleet.base_url}/v1/chat/completions", json=body, timeout=WAIT_SECONDS
    ) as response:
        lines = response.iter_lines()
        next(lines)
        victim = running_worker(fleet)
        fleet.kill(victim)
        with pytest.raises((httpx.HTTPError, StopIteration, AssertionError)):
            for line in lines:  # the stream ends without its [DONE], or with an error
                assert '"error"' not in line, line
            raise AssertionError("ended cleanly")
    fleet.wait_for_instances(1, timeout=WAIT_SECONDS)
    for seed in range(4):
        messages = [{"role": "user", "content": [image_part(200 + seed), {"type": "text",
                                                                          "text": "Still there?"}]}]  # fmt: skip
        response = chat(fleet.base_url, messages)
        assert response.status_code == 200, response.text
    wait_idle(fleet)
