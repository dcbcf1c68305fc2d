"""Client image ids and precomputed image embeddings end to end: the real `iris serve`
driven by the OpenAI SDK.

The server runs without a processor cache, so a part that sends a uuid alone reaches the
scheduler without pixels (the path of an image whose pixels were evicted) and is served
from the embedding cache; with two tokenizer workers, each uuid must also be routed to
the worker that saw its data. The worker-level behaviour (processor-cache hits, eviction,
the map's bound) is tests/test_image_uuids.py's, the checks of image_embeds
tests/test_image_embeds.py's."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import cpu_engine, make_image
from tests.server_harness import RunningServer, iris_server

MODEL = "tiny"
# long enough that the image's tokens lie in full KV pages (the prefix cache's unit)
AFTER = "Describe this picture in a few words, please, and be brief about it, thank you."
UUIDS = ["shot-a", "shot-b", "shot-c", "shot-d"]  # over two workers: routing must hold


def image(seed: int):
    return make_image(64 + 8 * seed, 48, seed=seed)


def data_url(seed: int) -> str:
    out = io.BytesIO()
    image(seed).save(out, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def messages(before: str, image: dict) -> list[dict]:
    content = [{"type": "text", "text": before}, image, {"type": "text", "text": AFTER}]
    return [{"role": "user", "content": content}]


def with_data(uuid: str, seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(seed)}, "uuid": uuid}


def uuid_only(uuid: str) -> dict:
    return {"type": "image_url", "image_url": None, "uuid": uuid}


@pytest.fixture(scope="module")
def server(qwen2_5_vl_tiny, tmp_path_factory):
    with iris_server(
        qwen2_5_vl_tiny,
        "--served-model-name", MODEL,
        "--max-model-len", "1024",
        "--tokenizer-workers", "2",
        "--disable-mm-processor-cache",
        "--enable-mm-embeds",
        tmp_path=tmp_path_factory.mktemp("server"),
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer):
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0
    ) as sdk:
        yield sdk


def ask(client: openai.OpenAI, chat: list[dict]) -> tuple[str, list[dict]]:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=chat,
        max_completion_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    return completion.choices[0].message.content or "", completion.usage.image_cache  # type: ignore[union-attr]


def test_an_image_sent_once_is_named_by_its_uuid_later(client, server):
    before = server.metrics()
    for seed, uuid in enumerate(UUIDS):
        answer, report = ask(client, messages("First:", with_data(uuid, seed)))
        part = "messages[0].content[1]"
        assert report == [{"part": part, "uuid": uuid, "hit": False, "cache": None}]
        # the same prompt, the image by its uuid alone: its KV pages are cached
        again, report = ask(client, messages("First:", uuid_only(uuid)))
        assert again == answer
        assert report == [{"part": part, "uuid": uuid, "hit": True, "cache": "prefix"}]
        # other text before it: its embedding serves, and equals sending the data again
        by_uuid, report = ask(client, messages(f"Then {uuid}:", uuid_only(uuid)))
        assert report[0]["cache"] == "embedding"
        by_data, _ = ask(client, messages(f"Then {uuid}:", with_data(uuid, seed)))
        assert by_uuid == by_data
    hits = before.get("iris_mm_uuid_hits_total", 0) + 2 * len(UUIDS)
    server.wait_for_metrics({"iris_mm_uuid_hits_total": hits, "iris_mm_uuid_misses_total": 0})
    assert server.metrics()["iris_mm_images_encoded_total"] == len(UUIDS)


def test_the_image_report_comes_with_a_streamed_answer_s_usage(client):
    ask(client, messages("Stream:", with_data("streamed", 9)))
    stream = client.chat.completions.create(
        model=MODEL, messages=messages("Streamed:", uuid_only("streamed")),  # type: ignore[arg-type]
        max_completion_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    last = [chunk for chunk in stream][-1]
    assert last.usage.image_cache[0]["hit"] is True  # type: ignore[union-attr]


def test_an_unknown_uuid_is_a_400_naming_the_part(client, server):
    before = server.metrics().get("iris_mm_uuid_misses_total", 0)
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, messages("Who?", uuid_only("never-sent")))
    error = refused.value.body
    assert error["param"] == "messages[0].content[1]", error  # type: ignore[index]
    assert "send it again with its data" in error["message"]  # type: ignore[index]
    server.wait_for_metrics({"iris_mm_uuid_misses_total": before + 1})
    with pytest.raises(openai.BadRequestError) as neither:  # no URL and no uuid
        ask(client, messages("What?", {"type": "image_url", "image_url": None}))
    assert "uuid of an image sent before" in neither.value.body["message"]  # type: ignore[index]


def test_embeds_from_the_model_s_own_vision_tower_answer_as_the_image_does(client, qwen2_5_vl_tiny):
    builder, engine = PromptBuilder(qwen2_5_vl_tiny), cpu_engine(qwen2_5_vl_tiny)
    pixels, grid = builder.resize_image(image(20))
    with torch.no_grad():
        pixel_values = engine.patches([torch.tensor(pixels)], [grid])
        embeds = engine.model.encode_images(pixel_values, torch.tensor([grid]))
    saved = io.BytesIO()
    torch.save(embeds.clone(), saved)
    part = {
        "type": "image_embeds",
        "image_embeds": {  # vLLM's form: both tensors torch-saved, base64
            "image_embeds": base64.b64encode(saved.getvalue()).decode(),
            "image_grid_thw": _b64_tensor(torch.tensor(grid)),
        },
        "uuid": "embedded",
    }
    from_embeds, report = ask(client, messages("Embeds:", part))
    from_image, _ = ask(
        client, messages("Embeds:", {"type": "image_url", "image_url": {"url": data_url(20)}})
    )
    assert from_embeds == from_image
    assert report == [{"part": "messages[0].content[1]", "uuid": "embedded", "hit": False,
                       "cache": None}]  # fmt: skip
    _, report = ask(client, messages("Later:", uuid_only("embedded")))
    assert report[0]["cache"] == "embedding"
    wrong = {"type": "image_embeds", "image_embeds": _b64_tensor(embeds[:, :8].clone()),
             "image_grid_thw": list(grid)}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, messages("Wrong:", wrong))
    assert "do not fit this model" in refused.value.body["message"]  # type: ignore[index]
    assert refused.value.body["param"] == "messages[0].content[1]"  # type: ignore[index]


def _b64_tensor(tensor: torch.Tensor) -> str:
    out = io.BytesIO()
    torch.save(tensor, out)
    return base64.b64encode(out.getvalue()).decode()
