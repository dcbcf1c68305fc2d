"""A step that raises fails only its requests, and the engine serves the rest (fault
injection in process: the model runner or the vision tower raises on a chosen call).

Each test checks what the failed requests held comes back (every KV page, every pin, the
embedding cache's entries) and that the other requests' tokens equal those of an engine
that saw no fault."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

import pytest
import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import RequestOutput, Sampling
from iris_serve.scheduler.step import engine as engine_module
from iris_serve.scheduler.step.engine import Engine
from iris_serve.scheduler.step.faults import release_device_memory
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, cpu_engine, make_image

torch.set_num_threads(2)
MAX_NEW = 6
# penalised, as every request is under Qwen2.5-VL's generation_config.json: the sampler
# holds state for each request, which an ended request must give back as well
GREEDY = Sampling(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.05)


@pytest.fixture(scope="module")
def clean(model_dir) -> Engine:
    """An engine that sees no fault: the tokens every other request must match."""
    return cpu_engine(model_dir)


def text(n: int, start: int) -> PromptInput:
    return PromptInput.text(range(start, start + n))


def fail_call(monkeypatch, owner: object, name: str, number: int, error: Exception) -> None:
    """Makes call `number` (from 1) of `owner.name` raise `error`; the others run as usual."""
    real = getattr(owner, name)
    calls = itertools.count(1)

    def faulty(*args, **kwargs):
        if next(calls) == number:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)


def drain(iris: Engine, tokens: dict[str, list[int]], finished: set[str]) -> None:
    while iris.has_unfinished_requests():
        collect(iris.step(), tokens, finished)


def collect(outputs: Iterable[RequestOutput], tokens: dict, finished: set[str]) -> None:
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finished.add(out.request_id)


def assert_all_released(iris: Engine) -> None:
    pool = iris.kv_cache.pool
    assert pool.num_free == pool.num_pages, "a KV page of a failed request leaked"
    assert not iris.requests and not iris.has_unfinished_requests()
    assert iris.pixels.num_pinned == 0 and iris.embedding_cache.num_held == 0
    assert iris.embedding_cache.pending_keys() == []
    penalties = iris.runner.sampler.penalties
    assert penalties is None or len(penalties) == 0, "a request's penalty state leaked"


def test_a_failed_step_ends_its_requests_and_the_others_finish_as_without_it(
    model_dir, clean, monkeypatch, caplog
):
    """Two requests decode, a third waits (max_num_seqs=2); the third step raises. The two
    end with an error and nothing more; the waiting one and one added after the fault
    produce the tokens of an engine without the fault."""
    iris = cpu_engine(model_dir, max_num_seqs=2)
    prompts = {"a": text(20, 100), "b": text(9, 300), "c": text(14, 500), "d": text(11, 700)}
    fail_call(monkeypatch, iris.runner, "run", 3, RuntimeError("injected fault"))
    for request_id in "abc":
        iris.add_request(request_id, prompts[request_id], GREEDY)
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    for _ in range(3):  # prefill of a and b, one decode, the decode that raises
        collect(iris.step(), tokens, finished)
    failed = iris.pop_failed()
    assert sorted(f.request_id for f in failed) == ["a", "b"]
    assert all("RuntimeError" in f.message for f in failed)
    assert iris.pop_failed() == [], "each failure is handed out once"
    assert set(iris.requests) == {"c"} and not iris.planner.running
    assert len(tokens["a"]) == len(tokens["b"]) == 2 and not finished

    iris.add_request("d", prompts["d"], GREEDY)
    drain(iris, tokens, finished)
    assert finished == {"c", "d"} and len(tokens["a"]) == len(tokens["b"]) == 2
    for request_id in "cd":
        [expected] = clean.generate([prompts[request_id]], GREEDY)
        assert tokens[request_id] == expected, request_id
    assert_all_released(iris)
    assert iris.runner.sampler.penalties is not None  # the failed requests had state
    logged = [record for record in caplog.records if record.exc_info]
    assert len(logged) == 1 and "a step failed" in logged[0].getMessage()


def test_a_failed_prefill_chunk_leaves_only_earlier_chunks_in_the_prefix_cache(
    model_dir, clean, monkeypatch
):
    """Chunked prefill, 32 tokens a step over pages of 16: the second chunk raises. Only
    the two pages the first chunk computed are cached; the four the failed chunk was to
    fill are not, so the same prompt again hits exactly 32 tokens and answers right."""
    iris = cpu_engine(model_dir, max_num_batched_tokens=32, page_size=16)
    prompt = text(80, 1000)
    fail_call(monkeypatch, iris.runner, "run", 2, RuntimeError("injected fault"))
    iris.add_request("a", prompt, GREEDY)
    assert iris.step() == [] and iris.step() == []
    assert [f.request_id for f in iris.pop_failed()] == ["a"]
    assert_all_released(iris)
    assert iris.kv_cache.pool.num_cached == 2

    [again] = iris.generate([prompt], GREEDY)
    assert iris.prefix_cache is not None and iris.prefix_cache.hit_tokens == 32
    [expected] = clean.generate([prompt], GREEDY)
    assert again == expected


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "thread"])
def test_a_failed_image_encoding_releases_the_pins_and_the_embedding_entries(
    model_dir, clean, monkeypatch, inline
):
    """The vision tower raises. Inline, the step's requests (one with an image, one
    text-only) fail; beside the steps, only the request waiting for the image does and
    the text request answers right. Either way the image's shared-memory pin is handed
    back and no embedding entry is left pending; the same prompt afterwards encodes again
    and answers right."""
    builder = PromptBuilder(model_dir)
    prompt = chat_prompt(builder, "Describe it.", [make_image(56, 56, seed=5)])
    iris = cpu_engine(model_dir, mm_encoder_placement="inline" if inline else "thread")
    fail_call(monkeypatch, iris.model, "encode_images", 1, RuntimeError("injected fault"))
    iris.add_request("image", prompt, GREEDY, pins=["pin-0"])
    iris.add_request("text", text(10, 100), GREEDY)
    tokens: dict[str, list[int]] = {}
    drain(iris, tokens, set())
    failed = sorted(f.request_id for f in iris.pop_failed())
    assert failed == (["image", "text"] if inline else ["image"])
    if not inline:
        assert tokens["text"] == clean.generate([text(10, 100)], GREEDY)[0]
    assert "image" not in tokens
    assert iris.pop_released_pins() == ["pin-0"]
    assert_all_released(iris)
    assert len(iris.embedding_cache) == 0

    iris.add_request("again", prompt, GREEDY, pins=["pin-1"])
    drain(iris, tokens, set())
    [expected] = clean.generate([prompt], GREEDY)
    assert tokens["again"] == expected
    assert iris.pop_released_pins() == ["pin-1"] and iris.stats().images_encoded == 1


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("injected"), RuntimeError("injected")])
def test_only_an_out_of_memory_step_empties_the_device_cache(model_dir, monkeypatch, error):
    iris = cpu_engine(model_dir)
    emptied: list[torch.device] = []
    monkeypatch.setattr(engine_module, "release_device_memory", emptied.append)
    fail_call(monkeypatch, iris.runner, "run", 1, error)
    iris.add_request("a", text(10, 100), GREEDY)
    assert iris.step() == []
    [failed] = iris.pop_failed()
    is_oom = isinstance(error, torch.OutOfMemoryError)
    assert emptied == ([iris.device] if is_oom else [])
    assert ("out of device memory" in failed.message) == is_oom
    assert_all_released(iris)
    assert iris.generate([text(10, 100)], GREEDY)  # and it keeps serving


def test_release_device_memory_empties_the_cuda_cache_only_on_cuda(monkeypatch):
    calls: list[None] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(None))
    release_device_memory(torch.device("cpu"))
    assert calls == []
    release_device_memory(torch.device("cuda", 0))
    assert calls == [None]


def test_a_device_error_is_not_isolated(model_dir, monkeypatch):
    """A CUDA error poisons the context for every later step: it propagates, and the
    scheduler process exits for the launcher to see."""
    iris = cpu_engine(model_dir)
    fail_call(monkeypatch, iris.runner, "run", 1, torch.AcceleratorError("device assert"))
    iris.add_request("a", text(10, 100), GREEDY)
    with pytest.raises(torch.AcceleratorError):
        iris.step()


def test_generate_raises_when_one_of_its_prompts_failed(model_dir, monkeypatch, caplog):
    caplog.set_level(logging.CRITICAL)
    iris = cpu_engine(model_dir, max_num_seqs=1)  # the second prompt waits out the fault
    fail_call(monkeypatch, iris.runner, "run", 1, RuntimeError("injected fault"))
    with pytest.raises(RuntimeError, match="1 of 2 prompts failed: internal error"):
        iris.generate([text(10, 100), text(10, 200)], Sampling(temperature=0.0, max_tokens=2))


def test_a_forward_failing_after_the_other_ranks_were_sent_the_step_is_not_isolated(
    model_dir, monkeypatch
):
    """Under tensor parallelism the followers are inside the step's collectives once rank
    0 has sent it: a failure then is `RanksOutOfStep`, which stops the scheduler; one
    before the send (here: encoding) fails only the step's requests."""
    from iris_serve.scheduler.step.faults import RanksOutOfStep

    sent: list[object] = []

    class Followers:
        def send(self, plan, inputs) -> None:
            sent.append(plan)

    iris = cpu_engine(model_dir)
    iris.runner.followers = Followers()
    fail_call(monkeypatch, iris.runner, "forward", 1, RuntimeError("injected fault"))
    iris.add_request("a", text(10, 100), GREEDY)
    with pytest.raises(RanksOutOfStep):
        iris.step()
    assert len(sent) == 1

    iris = cpu_engine(model_dir, mm_encoder_placement="inline")  # a thread: never in one
    iris.runner.followers = Followers()
    image = chat_prompt(PromptBuilder(model_dir), "Look.", [make_image(40, 30, seed=1)])
    fail_call(monkeypatch, iris.model, "encode_images", 1, RuntimeError("injected fault"))
    iris.add_request("b", image, GREEDY)
    assert iris.step() == [] and [f.request_id for f in iris.pop_failed()] == ["b"]
    assert len(sent) == 1  # nothing was sent for the failed step
