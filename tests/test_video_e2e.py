"""A video over HTTP: the real `iris serve` on the tiny Qwen3-VL checkpoint answers a
`video_url` question as transformers `generate` does on the prompt and pixels the worker
makes (tests/test_video_golden.py holds those to transformers' processing); a second
question about the same video encodes no temporal patch and finds its KV in the prefix
cache; a file that is no video is a 400 naming its part and holds nothing."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import openai
import pytest

from iris_serve.ipc.codec import unpack_token_ids
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import EngineRequest, Prompt, Sampling, TokenizeRequest
from iris_serve.ipc.shm_arena import ShmReader
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import hf_generate
from tests.server_harness import iris_server
from tests.test_server_e2e import IDLE
from tests.video_clips import make_clip, video_data_url, video_part
from tests.worker_harness import worker_factory

MAX_TOKENS = 8
CLIP = make_clip(9)


@pytest.fixture(scope="module")
def server(qwen3_vl_tiny, tmp_path_factory):
    with iris_server(
        qwen3_vl_tiny,
        "--served-model-name", "tiny",
        "--max-model-len", "1024",
        "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
        tmp_path=tmp_path_factory.mktemp("server"),
    ) as running:  # fmt: skip
        yield running


def messages(question: str, url: str) -> list[dict]:
    content = [video_part(url), {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def ask(server, question: str, url: str) -> httpx.Response:
    body = {"model": "tiny", "messages": messages(question, url), "max_tokens": MAX_TOKENS,
            "temperature": 0.0}  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def reference_text(model_dir: Path, question: str, url: str, run_dir: Path) -> str:
    """transformers `generate` on the token ids and temporal patches an in-process worker
    makes of the same messages, decoded as the server decodes."""
    builder = PromptBuilder(model_dir)
    with worker_factory(builder, f"test-{uuid.uuid4().hex[:12]}", run_dir) as make:
        worker = make()
        request = TokenizeRequest("ref", Sampling(), messages=messages(question, url))
        out = worker.handle(request)
        assert isinstance(out, EngineRequest), out
        with ShmReader() as reader:
            pixels = [reader.view(ref.pixels).clone() for ref in out.images if ref.pixels]
        worker.unpin(out)
    assert all(ref.frames == 2 for ref in out.images) and len(pixels) == len(out.images)
    prompt = PromptInput(Prompt(unpack_token_ids(out.token_ids), list(out.images)), pixels)
    ids = hf_generate(model_dir, prompt, MAX_TOKENS)
    return builder.tokenizer.decode(ids, skip_special_tokens=True)


def test_a_video_question_and_a_second_one_about_it(server, qwen3_vl_tiny, tmp_path):
    url = video_data_url(CLIP)
    first = ask(server, "What happens?", url)
    assert first.status_code == 200, first.text
    expected = reference_text(qwen3_vl_tiny, "What happens?", url, tmp_path)
    assert first.json()["choices"][0]["message"]["content"] == expected
    server.wait_for_metrics(IDLE)
    encoded = server.metrics()["iris_mm_images_encoded_total"]
    assert encoded >= 2  # the clip's temporal patches

    second = ask(server, "And at the end?", url)
    assert second.status_code == 200, second.text
    server.wait_for_metrics(IDLE)
    assert server.metrics()["iris_mm_images_encoded_total"] == encoded  # no patch again
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0


def test_a_file_that_is_no_video_is_a_400_naming_its_part(server):
    response = ask(server, "What happens?", video_data_url(b"not a video at all" * 100))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in (error.get("param") or "") + error["message"]
    server.wait_for_metrics(IDLE)


def test_the_openai_sdk_sends_a_video_with_its_processor_options(server):
    """The SDK has no video part type: users send the dict, options in `extra_body`."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    url = video_data_url(make_clip(12, fps=8.0))
    completion = client.chat.completions.create(
        model="tiny",
        messages=messages("What happens?", url),  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0.0,
        extra_body={"mm_processor_kwargs": {"fps": 4}},
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="crop_size"):
        client.chat.completions.create(
            model="tiny",
            messages=messages("What happens?", url),  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"mm_processor_kwargs": {"crop_size": 4}},
        )
    server.wait_for_metrics(IDLE)
