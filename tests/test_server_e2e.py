"""End to end: the real `iris serve` processes on a tiny checkpoint, over HTTP.

One server is shared by the module; tests that stop or break a server start their own.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch

from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import hf_generate, hf_prompt_pixel_values, make_image
from tests.server_harness import iris_server, stop, wait_until_gone

MAX_TOKENS = 12
IDLE = {"iris_kv_cache_used_pages": 0.0, "iris_scheduler_pinned_images": 0.0,
        "iris_shm_arena_pinned_entries": 0.0, "iris_num_requests_running": 0.0,
        "iris_device_memory_peak_bytes": 0.0,  # on CPU: no device memory
        "iris_linear_state_slots_held": 0.0}  # fmt: skip


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    make_image(77, 55, seed=21).save(folder / "local.png")
    return folder


@pytest.fixture(scope="module")
def server(qwen2_5_vl_tiny, media_dir, tmp_path_factory):
    with iris_server(
        qwen2_5_vl_tiny,
        "--served-model-name", "tiny",
        "--max-model-len", "1024",
        "--limit-mm-per-prompt", "4",
        "--allowed-local-media-path", str(media_dir),
        "--tokenizer-workers", "2",  # the default: which worker a turn goes to is tested
        tmp_path=tmp_path_factory.mktemp("server"),
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def builder(qwen2_5_vl_tiny) -> PromptBuilder:
    return PromptBuilder(qwen2_5_vl_tiny)


def chat_body(text: str, images: list[bytes], **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    content.append({"type": "text", "text": text})
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    return {"max_tokens": MAX_TOKENS, "temperature": 0.0, **body, **extra}


def reference_text(model_dir, builder: PromptBuilder, text: str, images: list[bytes]):
    """transformers `generate` on the same conversation: (text, prompt len, output len)."""
    from PIL import Image

    pil = [Image.open(io.BytesIO(b)) for b in images]
    content = [{"type": "image"} for _ in pil] + [{"type": "text", "text": text}]
    prompt = builder.build(builder.render_chat([{"role": "user", "content": content}]), pil)
    ids = hf_generate(model_dir, prompt, MAX_TOKENS)
    return builder.tokenizer.decode(ids, skip_special_tokens=True), len(prompt.token_ids), len(ids)


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_greedy_output_over_http_equals_transformers(server, builder, qwen2_5_vl_tiny, num_images):
    sizes = [(96, 64), (333, 517), (50, 120)][:num_images]
    images = [png_bytes(make_image(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json=chat_body("Describe.", images),
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    text, prompt_len, output_len = reference_text(qwen2_5_vl_tiny, builder, "Describe.", images)
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["prompt_tokens"] == prompt_len  # image tokens included
    assert body["usage"]["completion_tokens"] == output_len


def test_openai_client_streaming_and_not_with_an_image(server, builder, qwen2_5_vl_tiny, media_dir):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120)
    image = png_bytes(make_image(64, 64, seed=5))
    messages = chat_body("What is it?", [image])["messages"]
    expected, _, _ = reference_text(qwen2_5_vl_tiny, builder, "What is it?", [image])

    completion = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.choices[0].message.content == expected

    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    local = {"type": "image_url", "image_url": {"url": f"file://{media_dir / 'local.png'}"}}
    with_file = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [local, {"type": "text", "text": "hi"}]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    local_bytes = (media_dir / "local.png").read_bytes()
    text, prompt_len, _ = reference_text(qwen2_5_vl_tiny, builder, "hi", [local_bytes])
    assert with_file.choices[0].message.content == text
    assert with_file.usage.prompt_tokens == prompt_len  # the file's image tokens included


def test_logprobs_and_a_penalty_over_http_equal_transformers(server, builder, qwen2_5_vl_tiny):
    """The OpenAI client's logprobs are the log-softmax of transformers' logits at each
    answer token, and a repetition penalty gives `generate(repetition_penalty=...)`."""
    from PIL import Image

    from tests.reference import hf_model

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120)
    image = png_bytes(make_image(64, 48, seed=9))
    messages = chat_body("What is it?", [image])["messages"]
    completion = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"repetition_penalty": 1.4, "min_tokens": MAX_TOKENS},
    )  # fmt: skip
    content = completion.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS

    model = hf_model(str(qwen2_5_vl_tiny))
    template = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
    ]
    prompt = builder.build(builder.render_chat(template), [Image.open(io.BytesIO(image))])
    input_ids = torch.tensor([prompt.token_ids])
    vision = {
        "pixel_values": hf_prompt_pixel_values(qwen2_5_vl_tiny, prompt),
        "image_grid_thw": torch.tensor([im.grid_thw for im in prompt.images]),
    }
    with torch.inference_mode():
        generated = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == model.config.image_token_id).int(), **vision,
            max_new_tokens=MAX_TOKENS, do_sample=False, repetition_penalty=1.4,
            min_new_tokens=MAX_TOKENS,
        )  # fmt: skip
        ids = generated[:, : input_ids.shape[1] + MAX_TOKENS]
        logits = model(
            input_ids=ids, attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == model.config.image_token_id).int(), **vision,
        ).logits[0, input_ids.shape[1] - 1 : -1]  # fmt: skip
    answer = generated[0, input_ids.shape[1] :].tolist()
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert [c.token for c in content] == [builder.tokenizer.decode([t]) for t in answer]
    for token, ours, expected in zip(answer, content, reference, strict=True):
        assert ours.logprob == pytest.approx(expected[token].item(), abs=1e-4)
        assert [top.logprob for top in ours.top_logprobs] == pytest.approx(
            expected.topk(2).values.tolist(), abs=1e-4
        )


def test_n_choices_share_the_prompts_pages_and_its_image(server, builder, qwen2_5_vl_tiny):
    """n=3: three answers, each transformers' (greedy), for one image encoding and one
    prefill: the second and third choice find the prompt's full pages cached."""
    image = png_bytes(make_image(80, 60, seed=31))
    before = server.metrics()
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json=chat_body("Three answers?", [image], n=3),
        timeout=120,
    )
    assert response.status_code == 200, response.text
    expected, prompt_len, _ = reference_text(qwen2_5_vl_tiny, builder, "Three answers?", [image])
    assert [c["message"]["content"] for c in response.json()["choices"]] == [expected] * 3
    server.wait_for_metrics(IDLE)
    after = server.metrics()

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew("iris_mm_images_encoded_total") == 1
    full_pages = (prompt_len - 1) // 16 * 16  # the last prompt token is always computed
    assert full_pages > 0 and grew("iris_prefix_cache_hit_tokens_total") >= 2 * full_pages


def test_the_start_up_log_says_each_step_on_lines_of_one_format(server):
    lines = server.log.splitlines()
    line_format = re.compile(
        r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \S+ \S+: "
    )
    assert [line for line in lines if not line_format.match(line)] == []
    steps = ["started scheduler", "loading ", "model loaded in", "KV cache: ", " ready at "]
    found = [next((i for i, line in enumerate(lines) if step in line), None) for step in steps]
    assert None not in found and found == sorted(found), list(zip(steps, found, strict=True))
    banner = lines[found[-1]]
    assert f"ready at {server.base_url}, serving 'tiny'" in banner
    assert "(Qwen2_5_VLForConditionalGeneration, float32 on cpu)" in banner
    assert "max_model_len 1024" in banner


def test_sixteen_concurrent_requests_all_finish_correctly(server, builder, qwen2_5_vl_tiny):
    cases = [
        (
            f"Question {i}: " + "why " * i,
            [png_bytes(make_image(40 + 8 * i, 48, seed=i))] if i % 2 else [],
        )
        for i in range(16)
    ]
    results: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        text, images = cases[i]
        results[i] = httpx.post(
            f"{server.base_url}/v1/chat/completions", json=chat_body(text, images), timeout=300
        )

    threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 16, "some requests never returned"
    for i, (text, images) in enumerate(cases):
        assert results[i].status_code == 200, results[i].text
        expected, _, _ = reference_text(qwen2_5_vl_tiny, builder, text, images)
        assert results[i].json()["choices"][0]["message"]["content"] == expected, f"request {i}"
    server.wait_for_metrics(IDLE)


def _truncated_png() -> str:
    data = png_bytes(make_image(64, 64, seed=9))
    return data_url(data[: len(data) // 2])


def _bomb_png() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buffer, format="PNG")  # tiny file, 400 Mpx
    return data_url(buffer.getvalue())


BAD_IMAGES = {
    "invalid base64": "data:image/png;base64,!!!not-base64!!!",
    "not an image": data_url(b"hello, I am text", "image/png"),
    "truncated": _truncated_png(),
    "decompression bomb": _bomb_png(),
    "unsupported scheme": "ftp://example.com/a.png",
    "outside allowed folder": "file:///etc/passwd",
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_images_get_a_400_and_the_server_stays_healthy(server, case):
    content = [{"type": "image_url", "image_url": {"url": BAD_IMAGES[case]}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == "messages[0].content[0]"  # the part
    good = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=chat_body("ok", []), timeout=60
    )
    assert good.status_code == 200
    server.wait_for_metrics(IDLE)


def test_an_image_url_on_the_servers_own_host_is_refused(server):
    """Issue 40's case: the server must not read its own endpoints for a client."""
    content = [{"type": "image_url", "image_url": {"url": f"{server.base_url}/metrics"}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[0]"
    assert "127.0.0.1 is a loopback address" in error["message"]
    assert "--allow-private-media-hosts" in error["message"]


@pytest.mark.parametrize(
    ("change", "param", "status"),
    [
        ({"max_tokens": 5000}, "max_tokens", 400),
        ({"messages_images": 5}, "messages", 400),
        ({"model": "no-such-model"}, "model", 404),
    ],
)
def test_limits_get_a_400(server, change, param, status):
    images = [
        png_bytes(make_image(30, 30, seed=i)) for i in range(change.pop("messages_images", 0))
    ]
    body = {**chat_body("limits", images), **change}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    server.wait_for_metrics(IDLE)


def test_a_client_disconnect_mid_stream_frees_pages_and_pins(server):
    server.wait_for_metrics(IDLE)
    generated_before = server.metrics()["iris_generation_tokens_total"]
    image = png_bytes(make_image(120, 90, seed=3))
    body = chat_body("Tell a long story.", [image], max_tokens=900, ignore_eos=True, stream=True)
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert received  # the stream was flowing when we hung up
    server.wait_for_metrics(IDLE)
    generated = server.metrics()["iris_generation_tokens_total"] - generated_before
    assert generated < 900, "the request ran to the end: the disconnect did not abort it"


PREFILL_SERIES = ("vllm:request_prefill_time_seconds", "iris_request_prefill_step_seconds")


def test_metrics_count_an_answer_by_the_time_it_arrives(server):
    """A scrape right after an answer includes it, with no wait: the processes send their
    counters ahead of the request (worker) and of its tokens (scheduler). Requests come
    back to back, well inside the 0.2 s by which busy processes space other gauge updates."""
    server.wait_for_metrics(IDLE)
    before = server.metrics()
    for i in range(3):
        body = chat_body(f"Count request {i}.", [], max_tokens=3)
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        usage = response.json()["usage"]
        after = server.metrics()
        delta = {name: after[name] - before[name] for name in after if name in before}
        assert delta["iris_tokenizer_requests_total"] == 1, f"request {i}"
        assert delta["iris_prompt_tokens_total"] == usage["prompt_tokens"], f"request {i}"
        assert delta["iris_generation_tokens_total"] == usage["completion_tokens"], f"request {i}"
        # vLLM's names: the engine's counters, and the server's per-request series
        assert delta['vllm:prompt_tokens_total{engine="0"}'] == usage["prompt_tokens"]
        assert delta['vllm:prefix_cache_queries_total{engine="0"}'] == usage["prompt_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert delta['vllm:prefix_cache_hits_total{engine="0"}'] == cached
        reason = response.json()["choices"][0]["finish_reason"]
        assert delta[f'vllm:request_success_total{{finished_reason="{reason}"}}'] == 1
        assert delta["vllm:e2e_request_latency_seconds_count"] == 1
        assert delta["vllm:request_queue_time_seconds_count"] == 1  # the scheduler's
        # its prefill time, and of it its own steps' time: the server's TTFT holds both
        assert delta["vllm:request_prefill_time_seconds_count"] == 1
        prefill, steps = (delta[f"{name}_sum"] for name in PREFILL_SERIES)
        first_token = delta["vllm:time_to_first_token_seconds_sum"]
        assert 0 < steps <= prefill <= first_token, (steps, prefill, first_token)
        assert delta["vllm:request_generation_tokens_sum"] == usage["completion_tokens"]
        assert delta["vllm:inter_token_latency_seconds_count"] == usage["completion_tokens"] - 1
        before = after


def test_a_denormal_temperature_or_top_p_answers_the_greedy_text(server):
    """The fuzzer's finding: `temperature` 1e-40 (or `top_p` 1e-300) picked token 0 at every
    step (`"!!!!!!"`). It is the greedy answer."""
    url = f"{server.base_url}/v1/completions"

    def text(**sampling) -> str:
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 6, **sampling}
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert greedy != "!" * 6  # token 0's text: the greedy answer tells the two apart
    assert text(temperature=1e-40) == greedy and text(top_p=1e-300, seed=3) == greedy


def test_request_shaped_like_vllm_bench_serve_random_mm(server):
    """Exactly the body `vllm bench serve --backend openai-chat --dataset-name random-mm`
    posts, and the parts of the stream that client reads."""
    image = png_bytes(make_image(128, 72, seed=11))
    body = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "random words " * 10},
                    {"type": "image_url", "image_url": {"url": data_url(image, "image/jpeg")}},
                ],
            }
        ],
        "temperature": 0.0,
        "max_completion_tokens": 10,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=120
    ) as response:
        raw = b"".join(response.iter_bytes()).decode()
    assert response.status_code == 200
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    finish = chunks[-2]
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[:-2]]
    assert all(d for d in deltas[1:]), "every content delta after the first carries text"


def test_a_later_turn_finds_its_images_in_the_processor_cache(server):
    """Two tokenizer workers: the second turn of a conversation goes to the worker that
    cached its first image, so only the new image is decoded; /metrics counts it."""
    server.wait_for_metrics(IDLE)
    before = server.metrics()
    first, second = (png_bytes(make_image(96, 64, seed=s)) for s in (31, 32))
    turn = chat_body("What is this?", [first], max_tokens=2)
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json=turn, timeout=120).is_success
    later = chat_body("And this?", [second], max_tokens=2)
    later["messages"] = [*turn["messages"], {"role": "assistant", "content": "A picture."},
                         *later["messages"]]  # fmt: skip
    assert httpx.post(f"{server.base_url}/v1/chat/completions", json=later, timeout=120).is_success
    counted = {
        "iris_mm_processor_cache_hits_total": 1,
        "iris_mm_processor_cache_misses_total": 2,
        "iris_tokenizer_images_total": 2,
        "iris_time_to_first_token_seconds_count": 2,
    }
    server.wait_for_metrics({name: before[name] + n for name, n in counted.items()} | IDLE)


def test_api_key_is_enforced(qwen2_vl_tiny, tmp_path):
    with iris_server(qwen2_vl_tiny, "--api-key", "sesame", "--tokenizer-workers", "1",
                     tmp_path=tmp_path) as running:  # fmt: skip
        url = f"{running.base_url}/v1/chat/completions"
        body = {**chat_body("hi", []), "model": running_model_name(running)}
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(url, json=body, headers=wrong, timeout=60).status_code == 401
        right = {"Authorization": "Bearer sesame"}
        assert httpx.post(url, json=body, headers=right, timeout=60).status_code == 200
        assert httpx.get(f"{running.base_url}/health", timeout=10).status_code == 200


def running_model_name(running) -> str:
    models = httpx.get(
        f"{running.base_url}/v1/models", headers={"Authorization": "Bearer sesame"}, timeout=10
    ).json()
    entry = models["data"][0]
    assert {"id", "object", "created", "owned_by", "root"} <= set(entry)
    return entry["id"]


def test_clean_shutdown_leaves_no_process_and_no_shared_memory(qwen2_vl_tiny, tmp_path):
    with iris_server(qwen2_vl_tiny, "--served-model-name", "tiny", "--tokenizer-workers", "2",
                     tmp_path=tmp_path) as running:  # fmt: skip
        image = png_bytes(make_image(64, 64, seed=1))
        response = httpx.post(
            f"{running.base_url}/v1/chat/completions", json=chat_body("x", [image]), timeout=60
        )
        assert response.status_code == 200
        names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in running.children_pids()]
        # as `ps` and `top` name them (beside multiprocessing's resource tracker)
        assert {"scheduler", "tokenizer-0", "tokenizer-1"} <= set(names), names
        assert stop(running) == 0
        wait_until_gone(running)


@pytest.mark.parametrize(
    "victim, flags",
    [
        ("tokenizer-1", ("--tokenizer-workers", "2")),
        ("scheduler-rank1", ("--tensor-parallel-size", "2")),  # a follower rank
        # rank 0 with a follower waiting: a single scheduler's death, and the follower too
        ("scheduler", ("--tensor-parallel-size", "2")),
    ],
)
def test_a_child_killed_with_sigkill_stops_everything_cleanly(
    qwen2_vl_tiny, tmp_path, victim, flags
):
    """Killed mid-step, with a stream in flight: the stream ends (no hang), the server
    exits 1 naming the dead child, and nothing is left in /dev/shm or as a process."""
    with iris_server(qwen2_vl_tiny, *flags, tmp_path=tmp_path) as running:
        match = re.search(rf"started {victim} \(pid (\d+)\)", running.log)
        assert match, running.log
        streaming, ended = threading.Event(), threading.Event()
        body = {"messages": [{"role": "user", "content": "Count on."}], "max_tokens": 8000,
                "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip

        def stream() -> None:
            try:
                url = f"{running.base_url}/v1/chat/completions"
                with httpx.stream("POST", url, json=body, timeout=60) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            streaming.set()
            except httpx.HTTPError:
                pass  # the connection closed with the server: an end, not a hang
            finally:
                ended.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert streaming.wait(60), f"the stream never started:\n{running.log[-3000:]}"
        os.kill(int(match.group(1)), signal.SIGKILL)
        status = running.process.wait(timeout=60)
        assert status == 1
        assert f"{victim} (pid {match.group(1)}) died: killed by SIGKILL" in running.log
        assert ended.wait(60), "the stream in flight did not end with the server"
        wait_until_gone(running)


def test_sigterm_lets_running_streams_end_with_a_finish_reason_and_done(qwen2_vl_tiny, tmp_path):
    """Graceful drain: no new connections; a stream still running after --shutdown-timeout
    ends as aborted: its finish chunk, an error event saying why, [DONE]; the server
    exits 0."""
    with iris_server(qwen2_vl_tiny, "--shutdown-timeout", "1", tmp_path=tmp_path) as running:
        lines: list[str] = []
        started = threading.Event()
        body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 8000,
                "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip

        def read() -> None:
            url = f"{running.base_url}/v1/chat/completions"
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(60), running.log
        running.process.send_signal(signal.SIGTERM)
        reader.join(60)
        assert not reader.is_alive()
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shut down" in error["message"]
        finish = json.loads(lines[-3].removeprefix("data: "))["choices"][0]["finish_reason"]
        assert finish == "abort"
        assert running.process.wait(timeout=30) == 0
        wait_until_gone(running)
        shutdown = running.log[running.log.index("received SIGTERM") :].splitlines()
        assert "1 request(s) in flight get up to 1 s" in shutdown[0]  # Iris's line first
