"""Engine behaviour a caller relies on: stops, seeds, aborts, limits, bad input."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.step.engine import Engine
from tests.reference import cpu_engine, reference_tokens

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


def test_min_tokens_holds_back_stop_tokens_and_eos_then_lets_them_stop(
    engine, qwen2_5_vl_tiny, tmp_path
):
    """A stop token (or EOS) the model would emit inside the first `min_tokens` is not
    drawn there, and once `min_tokens` are out the first one drawn ends the request."""
    k = 4
    free, _ = run(engine, "d", prompt(), Sampling(temperature=0, max_tokens=16, ignore_eos=True))
    stop = free[k - 1]  # greedy's k-th token: without min_tokens the request ends right there
    assert stop not in free[: k - 1], "choose a prompt whose k-th token is new"
    held_params = Sampling(temperature=0, max_tokens=16, stop_token_ids=[stop], min_tokens=k)
    held, _ = run(engine, "e", prompt(), held_params)
    assert held[: k - 1] == free[: k - 1]  # nothing else is suppressed
    assert held[k - 1] != stop and stop not in held[:k]
    # A second stop token that greedy draws after the first k (and not within them, so
    # banning it there changes nothing): the request must end on the first of the two.
    later = next(t for t in held[k:] if t not in held[:k])
    end = next(j for j in range(k, len(held)) if held[j] in (stop, later))
    both = Sampling(temperature=0, max_tokens=16, stop_token_ids=[stop, later], min_tokens=k)
    stopped, last = run(engine, "e2", prompt(), both)
    assert stopped == held[: end + 1] and len(stopped) > k
    assert last.finish_reason == "stop"
    # The same two tokens as EOS ids of the checkpoint: the same suppression, the same stop.
    checkpoint = shutil.copytree(qwen2_5_vl_tiny, tmp_path / "eos")
    generation_config = checkpoint / "generation_config.json"
    config = json.loads(generation_config.read_text())
    config["eos_token_id"] = [*config["eos_token_id"], stop, later]
    generation_config.write_text(json.dumps(config))
    eos_engine = cpu_engine(checkpoint, max_model_len=256)
    by_eos, last = run(
        eos_engine, "e3", prompt(), Sampling(temperature=0, max_tokens=16, min_tokens=k)
    )
    assert by_eos == stopped and last.finish_reason == "stop"
    # ignore_eos lifts both: greedy runs on past them to max_tokens.
    ignored, last = run(
        eos_engine,
        "e4",
        prompt(),
        Sampling(temperature=0, max_tokens=16, min_tokens=k, ignore_eos=True),
    )
    assert ignored == free and last.finish_reason == "length"


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
def test_bad_prompts_are_rejected_and_cost_nothing(engine, qwen2_5_vl_tiny, bad_prompt, message):
    pool = engine.kv_cache.pool
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", bad_prompt, Sampling())
    assert pool.num_free == pool.num_pages and not engine.has_unfinished_requests()
    tokens, _ = run(engine, "after-bad", prompt(), Sampling(temperature=0, max_tokens=3))
    assert tokens == reference_tokens(qwen2_5_vl_tiny, prompt(), 3)  # the next one is served right


def test_duplicate_request_ids_are_rejected(engine):
    engine.add_request("dup", prompt(), Sampling(max_tokens=2))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", prompt(), Sampling(max_tokens=2))
    list(engine.run_until_idle())


def test_the_queue_time_is_the_wait_for_a_batch_slot(qwen2_5_vl_tiny):
    """With one sequence at a time, the second request waits in the scheduler until the
    first has finished: its queue time (on its first output only) spans at least the
    first's last step, while the first waited for nothing but the step it came in."""
    one_at_a_time = Engine(
        EngineConfig(model=str(qwen2_5_vl_tiny), device="cpu", max_model_len=256, max_num_seqs=1)
    )
    params = Sampling(max_tokens=4, temperature=0.0)
    one_at_a_time.add_request("first", prompt(), params)
    one_at_a_time.add_request("second", prompt(start=200), params)
    added_by = time.monotonic()
    queue_times: dict[str, list[float | None]] = {"first": [], "second": []}
    last_step_of_first = None
    while one_at_a_time.has_unfinished_requests():
        started = time.monotonic()
        for out in one_at_a_time.step():
            queue_times[out.request_id].append(out.queue_seconds)
            if out.request_id == "first" and out.finished:
                last_step_of_first = started
    assert last_step_of_first is not None
    for outputs in queue_times.values():
        assert outputs[0] is not None and outputs[0] >= 0 and outputs[1:] == [None] * 3
    # admitted after the step that finished the first began; added before `added_by`
    assert queue_times["second"][0] >= last_step_of_first - added_by > 0
