"""The latency budget of prefill pacing: prefill beside decodes sized from measured step
times (no model), then the engine planning with it."""

import pytest
import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.config import CPU_ITL_STRETCH
from iris_serve.scheduler.step.latency_budget import LatencyBudget
from tests.reference import assert_parity, cpu_engine, generate_joining_one_per_step

MS = 1e-3


def test_the_cap_keeps_a_step_with_decodes_within_the_stretch():
    """Decode steps take 20 ms and a prefill token 1 ms: at stretch 3 a step with decodes
    may carry (3 - 1) x 20 = 40 prefill tokens, at stretch 2 20 tokens."""
    for stretch, cap in [(3.0, 40), (2.0, 20)]:
        budget = LatencyBudget(stretch, min_tokens=8)
        budget.observe(num_decodes=3, num_prefill_tokens=0, seconds=20 * MS)
        budget.observe(num_decodes=0, num_prefill_tokens=500, seconds=520 * MS)
        assert budget.cap() == cap


def test_until_measured_a_step_carries_the_smallest_chunk_and_learns_from_it():
    budget = LatencyBudget(3.0, min_tokens=8)
    assert budget.cap() == 8  # nothing measured: the smallest chunk
    budget.observe(num_decodes=2, num_prefill_tokens=0, seconds=20 * MS)
    assert budget.cap() == 8  # the prefill cost is still unknown
    budget.observe(num_decodes=2, num_prefill_tokens=8, seconds=36 * MS)  # 2 ms a token
    assert budget.cap() == 20
    budget.observe(num_decodes=2, num_prefill_tokens=3, seconds=200 * MS)
    assert budget.cap() == 20  # too few tokens to tell from the step: not counted


def test_costs_follow_the_steps_as_they_change():
    """Moving averages: a slower machine (other work on it) shrinks the cap step by step."""
    budget = LatencyBudget(3.0, min_tokens=8)
    budget.observe(num_decodes=1, num_prefill_tokens=0, seconds=20 * MS)
    budget.observe(num_decodes=1, num_prefill_tokens=100, seconds=120 * MS)
    caps = [budget.cap()]
    for _ in range(20):
        budget.observe(num_decodes=1, num_prefill_tokens=100, seconds=420 * MS)  # 4 ms/token
        caps.append(budget.cap())
    assert caps[0] == 40 and caps == sorted(caps, reverse=True) and caps[-1] in (10, 11)


def test_each_key_has_its_own_prefill_cost_and_borrows_a_decode_time():
    """Keys are the steps' thread counts on a CPU: one thread prefills slower than two,
    while a decode step takes about as long on either."""
    budget = LatencyBudget(3.0, min_tokens=8)
    budget.observe(1, 0, 20 * MS, key=2)
    budget.observe(1, 100, 70 * MS, key=2)  # 0.5 ms a token with two threads
    budget.observe(1, 100, 120 * MS, key=1)  # 1 ms a token with one (decode time borrowed)
    assert (budget.cap(key=2), budget.cap(key=1)) == (80, 40)


def test_a_prefill_measured_before_any_decode_counts_its_whole_time():
    budget = LatencyBudget(3.0, min_tokens=8)
    budget.observe(num_decodes=0, num_prefill_tokens=100, seconds=200 * MS)  # 2 ms a token
    budget.observe(num_decodes=2, num_prefill_tokens=0, seconds=20 * MS)
    assert budget.cap() == 20


def test_free_prefill_is_not_capped_and_a_stretch_of_one_or_less_is_refused():
    budget = LatencyBudget(3.0, min_tokens=8)
    budget.observe(1, 0, 20 * MS)
    budget.observe(1, 64, 19 * MS)  # no slower than a decode step (a GPU, say)
    assert budget.cap() >= 1 << 20
    with pytest.raises(ValueError, match="above 1"):
        LatencyBudget(1.0, min_tokens=8)


class FixedCosts(LatencyBudget):
    """A latency budget whose measurements are given, not taken: the plans do not depend
    on the machine's speed."""

    def observe(self, *args: object, **kwargs: object) -> None:
        pass


def test_the_engine_plans_with_the_latency_budget_and_answers_do_not_change(qwen2_5_vl_tiny):
    """A 100-token prompt joins while another decodes: it goes in chunks of the latency
    budget's cap (16 here) while the other decodes, the whole token budget once alone,
    and both answer as transformers does."""
    engine = cpu_engine(qwen2_5_vl_tiny, max_itl_stretch=2.0, max_num_batched_tokens=64)
    budget = FixedCosts(2.0, min_tokens=16)
    for threads in (0, 1, 2, torch.get_num_threads()):
        LatencyBudget.observe(budget, 1, 0, 10 * MS, key=threads)
        LatencyBudget.observe(budget, 1, 100, 110 * MS, key=threads)  # 1 ms a token: cap 10 -> 16
    engine.pacing.latency = budget
    plans = record_plans(engine)
    prompts = [PromptInput.text(range(100, 105)), PromptInput.text(range(200, 300))]
    outputs = generate_joining_one_per_step(
        engine, prompts, Sampling(temperature=0.0, max_tokens=24)
    )
    assert_parity(qwen2_5_vl_tiny, prompts, outputs, 24)
    long_chunks = [(decodes, chunks.get("1")) for decodes, chunks in plans if "1" in chunks]
    assert long_chunks[:7] == [(1, 16)] * 6 + [(1, 4)], long_chunks


def test_steps_with_decodes_stay_within_the_measured_cap(qwen2_5_vl_tiny):
    """The default latency budget on a CPU (`CPU_ITL_STRETCH`), measuring this machine's steps: whatever it
    measured, a step with decodes carried no more prefill than its cap at that step."""
    engine = cpu_engine(qwen2_5_vl_tiny, max_num_batched_tokens=512, max_itl_stretch=None)
    budget = engine.pacing.latency
    assert budget is not None and budget.stretch == CPU_ITL_STRETCH
    caps: list[int | None] = []
    pacing_caps = engine.pacing.caps

    def caps_noted():
        given = pacing_caps()
        caps.append(given.with_decodes)
        return given

    engine.pacing.caps = caps_noted
    plans = record_plans(engine)
    prompts = [PromptInput.text(range(100 + 7 * i, 160 + 40 * i)) for i in range(6)]
    outputs = generate_joining_one_per_step(
        engine, prompts, Sampling(temperature=0.0, max_tokens=16)
    )
    assert_parity(qwen2_5_vl_tiny, prompts, outputs, 16)
    for cap, (decodes, chunks) in zip(caps, plans, strict=True):
        prefill = sum(chunks.values()) - decodes
        assert not decodes or (cap is not None and prefill <= cap), (cap, decodes, chunks)
    assert cpu_engine(qwen2_5_vl_tiny, max_itl_stretch=0).pacing.latency is None


def record_plans(engine) -> list[tuple[int, dict[str, int]]]:
    """Notes each planned step as (decodes, {request id: tokens})."""
    plans: list[tuple[int, dict[str, int]]] = []
    schedule = engine.planner.schedule

    def noting():
        plan = schedule()
        plans.append((plan.num_decodes, {c.request.request_id: c.num_tokens for c in plan.chunks}))
        return plan

    engine.planner.schedule = noting
    return plans
