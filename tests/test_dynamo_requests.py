"""A Dynamo frontend's preprocessed request in Iris (server/dynamo/requests.py, and the
tokenizer worker's token-id prompt with image URLs).

The frontend templated and tokenized the chat itself; Iris must expand each image
placeholder exactly as `iris serve` would, keep the router's id of each image for the KV
events, refuse a prompt whose expansion differs from the frontend's count (other
positions would be a wrong answer, not an error), and refuse by name every option it does
not serve.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from iris_serve.ipc.codec import unpack_token_ids
from iris_serve.ipc.messages import (
    EngineRequest,
    RequestError,
    RequestOutput,
    Sampling,
    StructuredOutput,
    TokenizeRequest,
    TokenLogprob,
)
from iris_serve.ipc.shm_names import instance_prefix, sweep
from iris_serve.server.dynamo.requests import (
    NO_DP_RANK,
    RefusedField,
    choice_requests,
    choices,
    output_chunk,
    routed_replica,
    tokenize_request,
)
from iris_serve.server.logprobs import TokenText
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from iris_serve.tokenizer_worker.worker import TokenizerWorker
from tests.reference import make_image
from tests.test_tokenizer_worker import data_url, release_all
from tests.video_clips import make_clip, video_data_url
from tests.worker_harness import worker_factory


@pytest.fixture(scope="module")
def builder(qwen2_5_vl_tiny: Path) -> PromptBuilder:
    return PromptBuilder(qwen2_5_vl_tiny)


@pytest.fixture
def worker(builder: PromptBuilder, tmp_path: Path) -> Iterator[TokenizerWorker]:
    instance = f"test-{uuid.uuid4().hex[:12]}"
    try:
        with worker_factory(builder, instance, tmp_path) as make:
            yield make()
    finally:
        sweep(instance_prefix(instance))


def frontend_request(builder: PromptBuilder, urls: list[str], **more) -> dict:
    """What Dynamo's frontend sends: the templated ids with one placeholder per image."""
    content = [{"type": "image"} for _ in urls] + [{"type": "text", "text": "What is this?"}]
    ids = builder.encode(builder.render_chat([{"role": "user", "content": content}]))
    return {
        "token_ids": ids,
        "multi_modal_data": {"image_url": [{"Url": url} for url in urls]},
        "extra_args": {"mm_hashes": [f"{0xABC0 + i:016x}" for i in range(len(urls))]},
        "sampling_options": {"temperature": None, "top_p": None, "n": 1},
        "stop_conditions": {"max_tokens": 5, "stop": None, "stop_token_ids_hidden": [1]},
        "output_options": {"logprobs": None},
        **more,
    }


def test_a_tokenized_prompt_expands_as_a_chat_does(worker, builder) -> None:
    urls = [data_url(make_image(120, 90, seed=1)), data_url(make_image(56, 56, seed=2))]
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": "What is this?"}]}]
    as_chat = worker.handle(TokenizeRequest("c1", Sampling(), messages=messages))
    assert isinstance(as_chat, EngineRequest), as_chat
    request = frontend_request(builder, urls)
    expected_ids = unpack_token_ids(as_chat.token_ids)
    request["mm_routing_info"] = {"expanded_prompt_len": len(expected_ids)}
    out = worker.handle(tokenize_request(request, "d1", {"temperature": 0.7}))
    assert isinstance(out, EngineRequest), out
    assert unpack_token_ids(out.token_ids) == expected_ids
    assert [(i.offset, i.length, i.key, i.grid_thw) for i in out.images] == [
        (i.offset, i.length, i.key, i.grid_thw) for i in as_chat.images
    ]
    assert [i.routing_hash for i in out.images] == [0xABC0, 0xABC1]
    assert out.sampling.temperature == 0.7 and out.sampling.max_tokens == 5  # its defaults
    release_all(worker, as_chat)
    release_all(worker, out)
    assert worker.arena.num_pinned == 0


def test_a_tokenized_prompt_with_a_video_expands_as_a_chat_does(worker, builder) -> None:
    """The frontend sends a video as one placeholder and its URL, with no routing id."""
    image, video = data_url(make_image(56, 56, seed=3)), video_data_url(make_clip(8, fps=4.0))
    content = [{"type": "image_url", "image_url": {"url": image}},
               {"type": "video_url", "video_url": {"url": video}},
               {"type": "text", "text": "What happens?"}]  # fmt: skip
    as_chat = worker.handle(TokenizeRequest("c2", Sampling(), messages=[
        {"role": "user", "content": content}]))  # fmt: skip
    assert isinstance(as_chat, EngineRequest), as_chat
    templated = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    request = frontend_request(builder, [image])
    request["token_ids"] = builder.encode(
        builder.render_chat([{"role": "user", "content": templated}])
    )
    request["multi_modal_data"]["video_url"] = [{"Url": video}]
    out = worker.handle(tokenize_request(request, "d4", {}))
    assert isinstance(out, EngineRequest), out
    assert unpack_token_ids(out.token_ids) == unpack_token_ids(as_chat.token_ids)
    assert len(out.images) == len(as_chat.images) > 2  # the image and the video's patches
    assert [(i.offset, i.length, i.key, i.grid_thw) for i in out.images] == [
        (i.offset, i.length, i.key, i.grid_thw) for i in as_chat.images
    ]
    assert out.images[0].routing_hash == 0xABC0  # the image's; the video's patches have none
    assert all(i.routing_hash is None for i in out.images[1:])
    release_all(worker, as_chat)
    release_all(worker, out)
    assert worker.arena.num_pinned == 0


def test_an_expansion_other_than_the_frontends_is_refused_and_holds_nothing(
    worker, builder
) -> None:
    request = frontend_request(builder, [data_url(make_image(112, 112))])
    request["mm_routing_info"] = {"expanded_prompt_len": 9999}
    out = worker.handle(tokenize_request(request, "d2", {}))
    assert isinstance(out, RequestError) and out.status == 400, out
    assert "9999" in out.message and "preprocessor_config.json" in out.message
    assert worker.arena.num_pinned == 0


def test_a_placeholder_count_other_than_the_images_is_refused(worker, builder) -> None:
    request = frontend_request(builder, [data_url(make_image(64, 64))])
    request["multi_modal_data"]["image_url"].append({"Url": data_url(make_image(64, 64))})
    request["extra_args"]["mm_hashes"].append("ff")
    out = worker.handle(tokenize_request(request, "d3", {}))
    assert isinstance(out, RequestError) and "1 image placeholders for 2 images" in out.message
    assert worker.arena.num_pinned == 0


@pytest.mark.parametrize(
    ("section", "options", "field"),
    [
        ("output_options", {"prompt_logprobs": 2}, "output_options.prompt_logprobs"),
        ("sampling_options", {"n": 0}, "sampling_options.n"),
        ("sampling_options", {"use_beam_search": True}, "sampling_options.use_beam_search"),
        ("stop_conditions", {"max_thinking_tokens": 9}, "stop_conditions.max_thinking_tokens"),
        ("multi_modal_data", {"audio_url": [{"Url": "x"}]}, "multi_modal_data.audio_url"),
        ("multi_modal_data", {"video_url": [{"Uri": "x"}]}, "multi_modal_data.video_url[0]"),
        ("sampling_options", {"guided_decoding": {"structural_tag": "x"}}, "structural_tag"),
    ],
)
def test_an_option_iris_does_not_serve_is_refused_by_name(builder, section, options, field) -> None:
    request = frontend_request(builder, [])
    request[section] = {**(request.get(section) or {}), **options}
    with pytest.raises(RefusedField, match=re.escape(field)):
        tokenize_request(request, "d5", {})


@pytest.mark.parametrize(
    ("section", "options", "field"),
    [
        ("sampling_options", {"temperature": "hot"}, "sampling_options.temperature"),
        ("stop_conditions", {"max_tokens": 2.5}, "stop_conditions.max_tokens"),
        ("extra_args", {"mm_hashes": ["f" * 17]}, "extra_args.mm_hashes"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_by_name(builder, section, options, field) -> None:
    request = frontend_request(builder, [data_url(make_image(56, 56))])
    request[section] = {**(request.get(section) or {}), **options}
    with pytest.raises(RefusedField, match=field.replace(".", r"\.")):
        tokenize_request(request, "d6", {})


def test_no_max_tokens_means_as_many_as_the_context_allows_and_eos_ids_stop(builder) -> None:
    request = frontend_request(builder, [])
    request["stop_conditions"] = {"stop": ["\n\n"], "stop_token_ids_hidden": [151645]}
    sampling = tokenize_request(request, "d7", {}).sampling
    assert sampling.max_tokens == 0 and sampling.stop_token_ids == (151645,)


def test_guided_decoding_becomes_iris_constraints(builder) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"json": schema}, StructuredOutput("json_schema", '{"type": "object", "properties": '
                                            '{"a": {"type": "integer"}}}')),
        ({"choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]')),
        ({"regex": "[0-9]+", "backend": "xgrammar"}, StructuredOutput("regex", "[0-9]+")),
    ]  # fmt: skip
    for guided, want in cases:
        request = frontend_request(builder, [])
        request["sampling_options"]["guided_decoding"] = guided
        assert tokenize_request(request, "d5", {}).sampling.structured == want


def test_the_last_chunk_carries_the_finish_reason_and_cached_tokens() -> None:
    last = RequestOutput("r", [5, 6], True, "abort", prompt_tokens=40, cached_tokens=32,
                         completion_tokens=2)  # fmt: skip
    chunk = output_chunk(last, TOKEN_TEXT)
    assert chunk["token_ids"] == [5, 6] and chunk["finish_reason"] == "cancelled"
    usage = chunk["completion_usage"]
    assert usage["total_tokens"] == 42 and usage["prompt_tokens_details"]["cached_tokens"] == 32
    assert "finish_reason" not in output_chunk(RequestOutput("r", [7]), TOKEN_TEXT)
    assert "log_probs" not in chunk  # none asked for


TOKEN_TEXT = TokenText(SimpleNamespace(decode=lambda ids: f"<{ids[0]}>"))


def test_logprobs_go_to_the_frontend_one_per_token_with_the_top_ones_by_rank(builder) -> None:
    """`output_options.logprobs` k (what the frontend asks for `logprobs`/`top_logprobs`)
    is Iris's `Sampling.logprobs`; each token's logprob and its k most likely tokens' go
    back in vLLM's backend's shape, which the frontend turns into the OpenAI fields."""
    request = frontend_request(builder, [])
    request["output_options"] = {"logprobs": 2, "prompt_logprobs": None}
    assert tokenize_request(request, "d8", {}).sampling.logprobs == 2
    with pytest.raises(RefusedField, match=r"output_options\.logprobs.*at most 1 "):
        tokenize_request(request, "d9", {}, max_logprobs=1)  # --max-logprobs holds here too
    logprobs = [TokenLogprob(5, -0.5, ((5, -0.5), (9, -1.5))),
                TokenLogprob(6, -2.0, ((7, -0.25), (6, -2.0)))]  # fmt: skip
    chunk = output_chunk(RequestOutput("r", [5, 6], logprobs=logprobs), TOKEN_TEXT)
    assert chunk["log_probs"] == [-0.5, -2.0]
    second = chunk["top_logprobs"][1]
    assert [(e["rank"], e["token_id"], e["logprob"]) for e in second] == [
        (1, 7, -0.25),
        (2, 6, -2.0),
    ]
    assert second[0]["token"] == "<7>" and second[0]["bytes"] == list(b"<7>")


@pytest.mark.parametrize(
    ("routing", "replica"),
    [({"dp_rank": 1}, 1), ({"dp_rank": 0}, 0), (None, None), ({}, None),
     ({"dp_rank": NO_DP_RANK}, None), ({"dp_rank": 2}, None), ({"dp_rank": "1"}, None)],
)  # fmt: skip
def test_the_routers_dp_rank_picks_the_replica_where_it_names_one_of_ours(routing, replica):
    """The KV router's `routing.dp_rank` is the replica whose events it routed on; none
    chosen, u32::MAX, a rank this worker does not have (2 of 2) or a malformed one leave
    the choice to Iris's own router rather than fail a request the user sent right."""
    assert routed_replica({"token_ids": [1], "routing": routing}, replicas=2) == replica


def test_n_answers_are_n_iris_requests_each_seeded_apart(builder) -> None:
    """`sampling_options.n` answers run as n Iris requests (ids apart, choice i of a
    seeded request drawing with seed + i, as `iris serve` runs `n`)."""
    request = frontend_request(builder, [])
    request["sampling_options"] = {"n": 3, "seed": 7, "temperature": 1.0}
    n = choices(request)
    answers = choice_requests(tokenize_request(request, "d10", {}), n)
    assert [a.request_id for a in answers] == ["d10-0", "d10-1", "d10-2"]
    assert [a.sampling.seed for a in answers] == [7, 8, 9]
    assert all(a.prompt == answers[0].prompt for a in answers)
    assert choices(frontend_request(builder, [])) == 1  # n 1 or null: one, as it came
