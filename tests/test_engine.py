"""Engine behaviour a caller relies on: stops, seeds, aborts, limits, bad input."""

from __future__ import annotations

import pytest
import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.engine import Engine

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def engine(qwen2_5_vl_tiny) -> Engine:
    return Engine(EngineConfig(model=str(qwen2_5_vl_tiny), device="cpu", max_model_len=256))


def prompt(n: int = 12, start: int = 100) -> PromptInput:
    return PromptInput.text(range(start, start + n))


def run(engine: Engine, request_id: str, p: PromptInput, params: Sampling):
    engine.add_request(request_id, p, params)
    tokens, last = [], None
    for out in engine.run_until_idle():
        if out.request_id == request_id:
            tokens += out.new_token_ids
            last = out
    return tokens, last


def test_max_tokens_ends_with_length(engine):
    tokens, last = run(
        engine, "a", prompt(), Sampling(temperature=0, max_tokens=7, ignore_eos=True)
    )
    assert len(tokens) == 7 and last.finished and last.finish_reason == "length"
    assert last.prompt_tokens == 12 and last.completion_tokens == 7


def test_a_stop_token_id_ends_the_request_and_is_returned(engine):
    greedy = Sampling(temperature=0, max_tokens=10, ignore_eos=True)
    tokens, _ = run(engine, "b", prompt(), greedy)
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    stopped, last = run(
        engine,
        "c",
        prompt(),
        Sampling(temperature=0, max_tokens=10, stop_token_ids=[stop_at]),
    )
    assert stopped == tokens[: first + 1]
    assert last.finish_reason == "stop"


def test_min_tokens_holds_back_stop_tokens(engine):
    greedy = Sampling(temperature=0, max_tokens=10, ignore_eos=True)
    tokens, _ = run(engine, "d", prompt(), greedy)
    stop = tokens[0]
    held, _ = run(
        engine,
        "e",
        prompt(),
        Sampling(temperature=0, max_tokens=10, stop_token_ids=[stop], min_tokens=4),
    )
    assert len(held) >= 4 and stop not in held[:4]


def test_the_same_seed_gives_the_same_tokens_whatever_the_batch(engine):
    seeded = Sampling(temperature=1.0, max_tokens=12, seed=42, ignore_eos=True)
    alone, _ = run(engine, "f", prompt(), seeded)
    engine.add_request("g", prompt(), seeded)
    engine.add_request("noise", prompt(30, 300), Sampling(temperature=1.0, max_tokens=12))
    together = []
    for out in engine.run_until_idle():
        if out.request_id == "g":
            together += out.new_token_ids
    assert together == alone
    other_seed, _ = run(
        engine,
        "h",
        prompt(),
        Sampling(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True),
    )
    assert other_seed != alone


def test_generation_stops_at_the_context_length(engine):
    p = prompt(250)
    tokens, last = run(engine, "i", p, Sampling(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(p.token_ids) + len(tokens) == engine.max_model_len
    assert last.finish_reason == "length"


def test_abort_mid_generation_returns_every_page(engine):
    pool = engine.kv_cache.pool
    engine.add_request("j", prompt(40), Sampling(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert pool.num_free < pool.num_pages
    engine.abort("j")
    assert pool.num_free == pool.num_pages and not engine.has_unfinished_requests()
    engine.abort("j")  # twice is harmless


@pytest.mark.parametrize(
    ("bad_prompt", "message"),
    [
        (PromptInput.text([]), "empty"),
        (PromptInput.text(range(256)), "context length"),
        (PromptInput.text([1, 2, 10**7]), "token ids"),
    ],
)
def test_bad_prompts_are_rejected_and_cost_nothing(engine, bad_prompt, message):
    pool = engine.kv_cache.pool
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", bad_prompt, Sampling())
    assert pool.num_free == pool.num_pages and not engine.has_unfinished_requests()
    tokens, _ = run(engine, "after-bad", prompt(), Sampling(temperature=0, max_tokens=3))
    assert len(tokens) >= 1


def test_duplicate_request_ids_are_rejected(engine):
    engine.add_request("dup", prompt(), Sampling(max_tokens=2))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", prompt(), Sampling(max_tokens=2))
    list(engine.run_until_idle())
