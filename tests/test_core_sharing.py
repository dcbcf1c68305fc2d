"""The cores of a CPU between the steps, the encoder thread and the tokenizer workers:
decodes share them with a running vision-tower call, prefill takes them all (the encoder
thread parks before its next block part while the steps hold it), and a worker decoding
media has one to itself. Policy tests on a stand-in encoder with a given clock; then the
parking itself on the tiny model's tower, and an engine whose prefill holds a running
call and still answers as transformers does."""

from __future__ import annotations

import threading

import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import CoreReady, MediaWork, Sampling
from iris_serve.scheduler.encoder.thread import EncoderThread
from iris_serve.scheduler.process import SchedulerLoop
from iris_serve.scheduler.step import core_sharing
from iris_serve.scheduler.step.core_sharing import MAX_HOLD_SECONDS, CoreSharing
from tests.reference import assert_parity, chat_prompt, cpu_engine, make_image

torch.set_num_threads(2)
CPU = torch.device("cpu")
WAIT_SECONDS = 60.0


class StandInEncoder:
    """What `CoreSharing` reads of an `EncoderThread`; the test parks it."""

    num_threads = 1

    def __init__(self) -> None:
        self.held = False
        self.parked = False
        self.steps_idle = False

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = self.parked = False

    def set_steps_idle(self, idle: bool) -> None:
        self.steps_idle = idle


def sharing(hold_for_prefill: bool = True) -> tuple[CoreSharing, StandInEncoder]:
    encoder = StandInEncoder()
    cores = CoreSharing(encoder, CPU, hold_for_prefill)  # type: ignore[arg-type]
    cores.cpu_threads = cores.cores = 4
    return cores, encoder


def test_decodes_share_the_cores_with_a_running_call_and_prefill_holds_it():
    cores, encoder = sharing()
    assert cores.begin_step(encoding=False, now=0.0) == 4  # no call: every core
    assert cores.after_plan(encoding=False, prefill_tokens=50, now=0.0) == 4
    assert not encoder.held

    assert cores.begin_step(encoding=True, now=1.0) == 3  # a call: the encoder's share out
    assert cores.after_plan(encoding=True, prefill_tokens=0, now=1.0) == 3  # decodes only
    assert not encoder.held and cores.lone_prefill_paced(encoding=True, now=1.0)

    assert cores.after_plan(encoding=True, prefill_tokens=16, now=1.1) == 3
    assert encoder.held and cores.awaiting_park and cores.holds == 1
    assert cores.begin_step(encoding=True, now=1.2) == 3  # not parked yet
    assert cores.after_plan(encoding=True, prefill_tokens=0, now=1.2) == 3  # deferred: kept
    assert encoder.held

    encoder.parked = True  # at its next block part
    assert cores.begin_step(encoding=True, now=1.3) == 4
    assert not cores.awaiting_park and not cores.lone_prefill_paced(encoding=True, now=1.3)
    assert cores.after_plan(encoding=True, prefill_tokens=400, now=1.3) == 4
    # the prefill is done: the step runs with the encoder's share given back
    assert cores.after_plan(encoding=True, prefill_tokens=0, now=1.5) == 3
    assert not encoder.held and not encoder.parked


def test_a_hold_ends_with_its_call():
    cores, encoder = sharing()
    cores.after_plan(encoding=True, prefill_tokens=16, now=0.0)
    encoder.parked = True
    assert cores.begin_step(encoding=False, now=0.1) == 4
    assert not encoder.held
    cores.after_plan(encoding=True, prefill_tokens=16, now=0.2)  # the next call: at once
    assert encoder.held and cores.holds == 2


def test_a_hold_lasts_at_most_its_limit_and_the_next_waits_as_long():
    cores, encoder = sharing()
    cores.after_plan(encoding=True, prefill_tokens=16, now=10.0)
    encoder.parked = True
    assert cores.begin_step(encoding=True, now=10.0 + MAX_HOLD_SECONDS / 2) == 4
    ended = 10.0 + MAX_HOLD_SECONDS
    assert cores.begin_step(encoding=True, now=ended) == 3
    assert not encoder.held
    # while the tower catches up, prefill beside it is paced as without holds
    assert not cores.lone_prefill_paced(encoding=True, now=ended)
    cores.after_plan(encoding=True, prefill_tokens=16, now=ended + MAX_HOLD_SECONDS * 0.99)
    assert not encoder.held
    assert cores.lone_prefill_paced(encoding=True, now=ended + MAX_HOLD_SECONDS)
    cores.after_plan(encoding=True, prefill_tokens=16, now=ended + MAX_HOLD_SECONDS)
    assert encoder.held and cores.holds == 2


def test_without_pacing_the_steps_never_hold_the_encoder():
    cores, encoder = sharing(hold_for_prefill=False)
    assert cores.after_plan(encoding=True, prefill_tokens=500, now=0.0) == 3
    assert not encoder.held and not cores.lone_prefill_paced(encoding=True, now=0.0)


def test_a_worker_decoding_media_has_a_core_the_steps_leave_it():
    cores, _ = sharing()
    cores.media_work(0, busy=True)
    assert cores.begin_step(encoding=False, now=0.0) == 3
    assert cores.begin_step(encoding=True, now=0.0) == 2  # the tower's share out too
    cores.media_work(1, busy=True)
    cores.media_work(1, busy=True)  # told twice, one core
    assert cores.step_threads(encoding=False) == 2
    cores.media_work(0, busy=False)
    cores.media_work(1, busy=False)
    assert cores.step_threads(encoding=False) == 4
    for worker in range(6):
        cores.media_work(worker, busy=True)
    assert cores.step_threads(encoding=True) == 1  # the steps always keep one


def test_fewer_step_threads_than_cores_leave_a_worker_its_core_already():
    cores, _ = sharing()
    cores.cores = 8  # --scheduler-threads 4 on 8 cores
    cores.media_work(0, busy=True)
    assert cores.step_threads(encoding=False) == 4


def test_without_an_encoder_thread_a_busy_worker_still_takes_a_core():
    """The inline placement: no encoder thread, yet the steps' threads follow the workers."""
    cores = CoreSharing(None, CPU)
    cores.cpu_threads = cores.cores = 2
    try:
        cores.media_work(3, busy=True)
        cores.share(cores.after_plan(encoding=False, prefill_tokens=0), idle=False)
        assert torch.get_num_threads() == 1
        cores.media_work(3, busy=False)
        cores.share(cores.after_plan(encoding=False, prefill_tokens=0), idle=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(2)


class SentToWorker:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)


def test_the_scheduler_answers_media_work_between_steps_and_its_steps_follow(model_dir):
    """`MediaWork(busy)` arrives between steps: the scheduler answers `CoreReady` with its
    seq, and the next step runs on one core fewer; the end gives the core back."""
    loop = object.__new__(SchedulerLoop)
    loop.engine = cpu_engine(model_dir)
    loop.to_workers = [SentToWorker(), SentToWorker()]
    cores = loop.engine.pacing.cores
    every = max(1, min(cores.cpu_threads, cores.cores))
    loop.engine.add_request("r", PromptInput.text(range(100, 120)), Sampling(max_tokens=8))
    try:
        loop.engine.step()
        assert torch.get_num_threads() == every
        loop._handle(MediaWork(1, busy=True, seq=7))
        assert loop.to_workers[1].sent == [CoreReady(7)] and loop.to_workers[0].sent == []
        loop.engine.step()
        assert torch.get_num_threads() == max(1, min(cores.cpu_threads, cores.cores - 1))
        loop._handle(MediaWork(1, busy=False, seq=7))
        assert loop.to_workers[1].sent == [CoreReady(7)]  # an end is not answered
        loop.engine.step()
        assert torch.get_num_threads() == every
    finally:
        loop.engine.close()
        torch.set_num_threads(2)


def test_on_cuda_there_is_nothing_to_share():
    cores = CoreSharing(StandInEncoder(), torch.device("cuda"))  # type: ignore[arg-type]
    assert cores.encoder is None and cores.begin_step(encoding=True) == 0
    cores.media_work(0, busy=True)
    assert cores.after_plan(encoding=True, prefill_tokens=500) == 0


# --- the encoder thread parks ------------------------------------------------------------


class PartLog:
    """Which vision-block parts have started, in the encoder thread (a pre-hook that runs
    after the encoder's own, so a part is logged only once the thread went past parking)."""

    def __init__(self, blocks) -> None:
        self.started: list[str] = []
        self.paused_at: str | None = None
        self.go_on = threading.Event()
        self.reached = threading.Event()
        for i, block in enumerate(blocks):
            for name, part in block.named_children():
                part.register_forward_pre_hook(self._hook(f"{i}.{name}"))

    def _hook(self, label: str):
        def log(*_: object) -> None:
            self.started.append(label)
            if label == self.paused_at:
                self.reached.set()
                if not self.go_on.wait(WAIT_SECONDS):
                    raise TimeoutError("the test never let the tower go on")

        return log


def wait_until(condition, what: str) -> None:
    done = threading.Event()
    for _ in range(int(WAIT_SECONDS / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"not within {WAIT_SECONDS} s: {what}")


def test_a_held_encoder_parks_before_its_next_block_part_and_goes_on_when_released(
    model_dir, builder
):
    iris = cpu_engine(model_dir)
    encoder = iris.encoder_executor
    assert isinstance(encoder, EncoderThread)
    blocks = iris.model.visual.blocks
    parts = PartLog(blocks)
    parts.paused_at = "0.norm2"
    prompt = chat_prompt(builder, "Describe it.", [make_image(96, 64, seed=5)])
    [image] = prompt.images
    future = encoder.submit([prompt.pixels[0]], [image.grid_thw])
    try:
        assert parts.reached.wait(WAIT_SECONDS), "the call never reached block 0"
        encoder.hold()
    finally:
        parts.go_on.set()
    wait_until(lambda: encoder.parked, "the encoder parks")
    assert parts.started[-1] == "0.norm2" and not future.done()  # block 0's MLP waits
    encoder.release()
    embedding = future.result(WAIT_SECONDS)
    assert parts.started[-1] == f"{len(blocks) - 1}.mlp" and not encoder.parked
    alone = iris.tower([prompt.pixels[0]], [image.grid_thw])
    assert torch.allclose(embedding, alone, rtol=1e-4, atol=1e-5)  # threads may differ


def test_a_held_encoder_parks_before_its_next_call_and_close_lets_it_go(model_dir, builder):
    iris = cpu_engine(model_dir)
    encoder = iris.encoder_executor
    assert isinstance(encoder, EncoderThread)
    prompt = chat_prompt(builder, "Describe it.", [make_image(64, 96, seed=6)])
    [image] = prompt.images
    encoder.hold()
    future = encoder.submit([prompt.pixels[0]], [image.grid_thw])
    wait_until(lambda: encoder.parked, "the encoder parks before the call")
    assert not future.done()
    with encoder._hold:  # released and held again before the parked thread could wake
        encoder.release()
        assert not encoder.parked
        encoder.hold()
    wait_until(lambda: encoder.parked, "the woken encoder parks again")
    assert not future.done()
    encoder.close()  # a closing engine never leaves its thread parked
    assert future.result(WAIT_SECONDS).shape[0] == image.length


def test_prefill_beside_a_running_call_holds_it_takes_every_core_and_answers_right(
    model_dir, builder, monkeypatch
):
    """A text request arrives while an image is in the tower: its prefill asks for the
    cores, the tower parks, the prefill runs on every core, the tower goes on once no
    step has prefill; both answers equal transformers'."""
    monkeypatch.setattr(core_sharing, "MAX_HOLD_SECONDS", WAIT_SECONDS)  # a slow machine
    iris = cpu_engine(model_dir, max_itl_stretch=2.5)
    parts = PartLog(iris.model.visual.blocks)
    parts.paused_at = "0.mlp"
    threads: list[int] = []
    share = iris.pacing.cores.share

    def noting_threads(step_threads: int, idle: bool) -> None:
        threads.append(step_threads)
        share(step_threads, idle)

    iris.pacing.cores.share = noting_threads  # type: ignore[method-assign]
    image = chat_prompt(builder, "Describe it.", [make_image(120, 90, seed=7)])
    text = chat_prompt(builder, "Count from one to twenty, slowly, " + "please " * 20)
    greedy = Sampling(temperature=0.0, max_tokens=8)
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in iris.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    encoder = iris.encoder_executor
    assert isinstance(encoder, EncoderThread)
    try:
        # no holds while the call starts (its template tokens would race it for one)
        iris.pacing.cores.hold_for_prefill = False
        iris.add_request("image", image, greedy)
        wait_until(lambda: step() or parts.reached.is_set(), "the call reaches block 0")
        iris.pacing.cores.hold_for_prefill = True
        iris.add_request("text", text, greedy)
        step()  # a paced chunk of it beside the call: the steps ask for the cores
        assert iris.pacing.cores.holds == 1 and iris.pacing.cores.awaiting_park
        assert threads[-1] == 1  # the encoder's share is still its own
        asked = len(threads)
    finally:
        parts.go_on.set()
    wait_until(lambda: encoder.parked, "the encoder parks")
    for out in iris.run_until_idle():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert threads[asked] == 2  # the text's prefill on every core while the tower waited
    assert not encoder.held and iris.stats().images_encoded == 1
    assert_parity(model_dir, [image, text], [tokens["image"], tokens["text"]], 8)
    assert iris.pixels.num_pinned == 0 and iris.embedding_cache.num_held == 0
