"""The vision encoder beside the steps (the default): a request waits for its image's
embedding alone, while the others' decodes and prefills go on, and answers as
transformers does. Asserted by step accounting: the encoder thread is held at a gate
while the test counts what each step produced."""

from __future__ import annotations

import threading

import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.encoder import thread as encoder_thread
from iris_serve.scheduler.encoder.thread import EncoderThread
from iris_serve.scheduler.step.engine import Engine
from tests.reference import (
    assert_parity,
    chat_prompt,
    cpu_engine,
    generate_joining_one_per_step,
    make_image,
    numbered_prompts,
)

torch.set_num_threads(2)
GREEDY = Sampling(temperature=0.0, max_tokens=8)
GATE_TIMEOUT_SECONDS = 60.0


class Gate:
    """Holds every vision-tower call of `engine` (in the encoder thread) until `open()`."""

    def __init__(self, engine: Engine) -> None:
        self.opened = threading.Event()
        self.calls = 0
        self._called = threading.Condition()
        encode_images = engine.model.encode_images

        def gated(*args, **kwargs):
            with self._called:
                self.calls += 1
                self._called.notify_all()
            if not self.opened.wait(GATE_TIMEOUT_SECONDS):
                raise TimeoutError("the test never opened the encoder's gate")
            return encode_images(*args, **kwargs)

        engine.model.encode_images = gated

    def open(self) -> None:
        self.opened.set()

    def reached_by(self, calls: int) -> bool:
        """Waits (bounded) until `calls` calls have reached the gate; True if exactly so."""
        with self._called:
            self._called.wait_for(lambda: self.calls >= calls, GATE_TIMEOUT_SECONDS)
            return self.calls == calls


def run(engine: Engine, tokens: dict[str, list[int]]) -> None:
    for out in engine.run_until_idle():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def test_a_request_waiting_for_its_image_does_not_delay_another_s_decode(model_dir, builder):
    iris = cpu_engine(model_dir)
    gate = Gate(iris)
    text = chat_prompt(builder, "Count from one to twenty.")
    image = chat_prompt(builder, "Describe it.", [make_image(120, 90, seed=1)])
    [span] = image.images
    longer = Sampling(temperature=0.0, max_tokens=12)
    iris.add_request("text", text, longer)
    iris.add_request("image", image, GREEDY)
    tokens: dict[str, list[int]] = {}
    try:
        for step in range(1, longer.max_tokens + 1):
            for out in iris.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            # one token per step for "text" (its prefill gave the first), none for "image"
            assert len(tokens["text"]) == step and "image" not in tokens, step
            # "image" prefilled the text before its image and stopped there
            assert iris.requests["image"].page_table.num_computed_tokens == span.offset
        assert "text" not in iris.requests and gate.reached_by(1)
    finally:
        gate.open()
    run(iris, tokens)
    assert_parity(model_dir, [text], [tokens["text"]], longer.max_tokens)
    assert_parity(model_dir, [image], [tokens["image"]], GREEDY.max_tokens)
    assert iris.pixels.num_pinned == 0 and iris.embedding_cache.num_held == 0


def test_answers_equal_transformers_with_requests_joining_every_step(model_dir, builder):
    prompts = numbered_prompts(builder, 6, 3, 2, seed=40)
    iris = cpu_engine(model_dir, max_num_batched_tokens=32)
    outputs = generate_joining_one_per_step(iris, prompts, GREEDY)
    assert_parity(model_dir, prompts, outputs, GREEDY.max_tokens)
    assert iris.stats().images_encoded == sum(len(p.images) for p in prompts)


def test_an_image_being_encoded_serves_a_second_request_without_a_second_call(model_dir, builder):
    picture = make_image(96, 64, seed=2)
    first = chat_prompt(builder, "What is it?", [picture])
    second = chat_prompt(builder, "And the colours?", [picture])
    iris = cpu_engine(model_dir, enable_prefix_caching=False)
    gate = Gate(iris)
    try:
        iris.add_request("first", first, GREEDY)
        iris.step()  # its call starts and waits at the gate
        assert gate.reached_by(1)
        iris.add_request("second", second, GREEDY)
        iris.step()  # a hit on the entry being encoded: a waiter, no call
    finally:
        gate.open()
    tokens: dict[str, list[int]] = {}
    run(iris, tokens)
    assert gate.calls == 1 and iris.stats().images_encoded == 1
    assert_parity(model_dir, [first, second], [tokens["first"], tokens["second"]], 8)


def test_an_abort_during_the_encoding_releases_the_pin_at_once_and_keeps_nothing(
    model_dir, builder
):
    prompt = chat_prompt(builder, "Describe it.", [make_image(80, 80, seed=3)])
    iris = cpu_engine(model_dir)
    gate = Gate(iris)
    try:
        iris.add_request("gone", prompt, GREEDY, pins=["pin-0"])
        iris.step()
        assert gate.reached_by(1) and iris.pop_released_pins() == []
        iris.abort("gone")  # the encoder thread works on a copy of the pixels
        assert iris.pop_released_pins() == ["pin-0"]
    finally:
        gate.open()
    while iris.encoder_manager.encoding:
        iris.encoder_manager.wait(GATE_TIMEOUT_SECONDS)
        iris.step()
    assert len(iris.embedding_cache) == 0 and iris.encoder_manager.tokens_ahead() == 0
    assert iris.pixels.num_pinned == 0 and not iris.has_unfinished_requests()
    [again] = iris.generate([prompt], GREEDY)  # encoded anew, right
    assert_parity(model_dir, [prompt], [again], GREEDY.max_tokens)


def test_the_encoder_works_at_most_its_budget_ahead_of_the_prefills(model_dir, builder):
    pictures = [make_image(112, 112, seed=10 + i) for i in range(5)]  # 16 tokens each
    prompt = chat_prompt(builder, "Tell their story.", pictures)
    iris = cpu_engine(model_dir, max_num_encoder_tokens=32, max_num_batched_tokens=24)
    prefetch, ahead = iris.encoder_manager.prefetch, []

    def recording_prefetch(wanted) -> None:
        prefetch(wanted)
        ahead.append(iris.encoder_manager.tokens_ahead())

    iris.encoder_manager.prefetch = recording_prefetch  # type: ignore[method-assign]
    [tokens] = iris.generate([prompt], GREEDY)
    largest = max(image.length for image in prompt.images)
    assert 0 < max(ahead) <= 32 + largest, ahead  # the budget, passed by one image at most
    assert iris.stats().images_encoded == 5
    assert_parity(model_dir, [prompt], [tokens], GREEDY.max_tokens)


def test_a_cached_prefix_that_ends_inside_an_image_waits_for_it_then_splices(model_dir, builder):
    """The prefix cache holds the pages of half an image; the embedding cache is off, so
    the resumed request must have the image encoded again: it waits for it, then its
    first chunk starts inside the image."""
    page = 4
    prompt = chat_prompt(builder, "Look closely.", [make_image(112, 112, seed=50)])
    [image] = prompt.images
    half = image.length // 2
    iris = cpu_engine(
        model_dir, page_size=page, max_num_batched_tokens=half, enable_mm_embedding_cache=False
    )
    iris.add_request("cut", prompt, GREEDY)
    request = iris.requests["cut"]
    while request.page_table.num_computed_tokens <= image.offset:
        iris.step()  # the text before the image, then half the image once it is ready
    assert image.offset < request.page_table.num_computed_tokens < image.end
    iris.abort("cut")  # its full pages stay cached; its embedding goes
    tokens: dict[str, list[int]] = {}
    iris.add_request("resumed", prompt, GREEDY)
    cached = iris.planner.cached_prefix_tokens(iris.requests["resumed"])
    assert image.offset < cached < image.end
    run(iris, tokens)
    assert iris.stats().images_encoded == 2
    assert_parity(model_dir, [prompt], [tokens["resumed"]], GREEDY.max_tokens)


def test_the_encoder_thread_ends_when_idle_and_the_next_image_starts_another(model_dir, builder):
    """An idle encoder thread would keep its OpenMP workers, which slow every later step
    (encoder_thread.py); it ends once nothing is queued, and a later image still gets
    encoded, in a thread of its own."""
    iris = cpu_engine(model_dir)
    workers: list[threading.Thread] = []
    encode_images = iris.model.encode_images

    def noting_the_thread(*args, **kwargs):
        workers.append(threading.current_thread())
        return encode_images(*args, **kwargs)

    iris.model.encode_images = noting_the_thread
    prompts = [
        chat_prompt(builder, "Describe it.", [make_image(120, 90, seed=21)]),
        chat_prompt(builder, "And this one?", [make_image(90, 120, seed=22)]),
    ]
    outputs = []
    for prompt in prompts:
        outputs += iris.generate([prompt], GREEDY)
        workers[-1].join(GATE_TIMEOUT_SECONDS)
        assert not workers[-1].is_alive(), "the idle encoder thread lingers"
    assert len(workers) == 2 and workers[0] is not workers[1]
    assert all(worker is not threading.main_thread() for worker in workers)
    assert_parity(model_dir, prompts, outputs, GREEDY.max_tokens)


def test_on_a_cpu_each_tower_call_takes_images_up_to_its_call_size_only(
    model_dir, builder, monkeypatch
):
    """A CPU tower call is compute-bound at one image's size: batching more only makes the
    first image's request wait for the others' (encoder_thread.CPU_CALL_TOKENS)."""
    pictures = [make_image(112, 112, seed=60 + i) for i in range(3)]  # 16 tokens each
    prompt = chat_prompt(builder, "Compare them.", pictures)
    monkeypatch.setattr(encoder_thread, "CPU_CALL_TOKENS", 32)
    iris = cpu_engine(model_dir, max_num_encoder_tokens=4096)
    calls: list[int] = []
    encode_images = iris.model.encode_images

    def counting(pixel_values, grids):
        calls.append(len(grids))
        return encode_images(pixel_values, grids)

    iris.model.encode_images = counting
    [tokens] = iris.generate([prompt], GREEDY)
    assert calls == [2, 1]  # within the budget, in calls of at most 32 image tokens
    assert_parity(model_dir, [prompt], [tokens], GREEDY.max_tokens)


def test_a_kept_alive_encoder_thread_serves_every_call_and_ends_on_close():
    """On CUDA one thread serves every call (torch keeps cuDNN's attention graphs per
    thread: a thread per call rebuilt them each time); closing the encoder ends it."""
    threads: list[threading.Thread] = []

    def call(pixels, grids):
        threads.append(threading.current_thread())
        return torch.stack(pixels).sum(0)

    encoder = EncoderThread(call, torch.device("cpu"), 1, 1, keep_alive=True)
    pixels = [torch.ones(2, 2)]
    for _ in range(2):  # one after the other: the thread waits in between
        result = encoder.submit(pixels, [(1, 1, 1)]).result(GATE_TIMEOUT_SECONDS)
        assert torch.equal(result, torch.ones(2, 2))
    assert len(threads) == 2 and threads[0] is threads[1]
    assert threads[0].is_alive() and threads[0] is not threading.main_thread()
    encoder.close()
    threads[0].join(GATE_TIMEOUT_SECONDS)
    assert not threads[0].is_alive(), "a closed encoder's thread lingers"
