"""The penalty state kept across steps (`scheduler/sampling/penalties.py`) gives the logits of the
state rebuilt from the token lists (the sampler's one-call path, itself checked against
transformers in test_sampling.py), and every ended request gives its row back."""

from __future__ import annotations

import torch

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.sampling.penalties import INITIAL_ROWS, INITIAL_WIDTH, PenaltyTable
from iris_serve.scheduler.sampling.sampler import Sampler, SamplingRow
from tests.reference import cpu_engine

torch.set_num_threads(2)
VOCAB = 700
PARAMS = [
    Sampling(temperature=0.0, repetition_penalty=1.3),
    Sampling(temperature=0.0, frequency_penalty=0.4, presence_penalty=0.2),
    Sampling(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.3),
    Sampling(temperature=0.0),  # unpenalised: holds no row
]


def test_kept_state_gives_the_rebuilt_logits_step_after_step():
    """More penalised requests than the first table holds, a prompt with more distinct
    tokens than its first width and outputs that widen it again, every penalty, and
    requests ending while new ones take their rows."""
    g = torch.Generator().manual_seed(0)
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    params: dict[str, Sampling] = {}

    def admit(index: int, length: int) -> None:
        request_id = f"r{index}"
        prompts[request_id] = torch.randint(VOCAB, (length,), generator=g).tolist()
        outputs[request_id] = []
        params[request_id] = PARAMS[index % len(PARAMS)]

    for i in range(INITIAL_ROWS + 4):
        admit(i, 2 * INITIAL_WIDTH if i == 0 else 5 + 7 * i)  # r0: ~2/3 of VOCAB distinct
    kept = Sampler()
    for step in range(INITIAL_WIDTH + 8):
        ids = list(prompts)
        rows = [SamplingRow(params[r], None, (), prompts[r], outputs[r], request_id=r) for r in ids]
        rebuilt = [SamplingRow(params[r], None, (), prompts[r], list(outputs[r])) for r in ids]
        logits = torch.randn(len(ids), VOCAB, generator=g) * 3
        expected = logits.clone()
        Sampler()._penalize(expected, rebuilt)
        tokens = kept(logits, rows)  # fp32 logits are penalised in place
        torch.testing.assert_close(logits, expected, rtol=0, atol=0, msg=f"step {step}")
        for r, token in zip(ids, tokens.tolist(), strict=True):
            outputs[r].append(token)
        if step == 5:  # two requests end, a new one arrives
            for r in ("r1", "r2"):
                kept.release(r)
                del prompts[r], outputs[r], params[r]
            admit(len(PARAMS) * 10, 40)
    assert kept.penalties is not None
    assert kept.penalties.seen_ids.shape[1] > 2 * INITIAL_WIDTH  # widened past the prompt
    assert len(kept.penalties) == sum(1 for r in prompts if params[r] is not PARAMS[3])


def test_finished_and_aborted_requests_give_their_rows_back(qwen2_5_vl_tiny):
    engine = cpu_engine(qwen2_5_vl_tiny)
    sampling = Sampling(temperature=0.0, max_tokens=4, ignore_eos=True, repetition_penalty=1.05)
    engine.add_request("finishes", PromptInput.text(range(100, 120)), sampling)
    engine.add_request("aborted", PromptInput.text(range(200, 230)), sampling)
    for _ in range(2):
        engine.step()
    penalties = engine.runner.sampler.penalties
    assert penalties is not None and len(penalties) == 2
    engine.abort("aborted")
    assert len(penalties) == 1
    list(engine.run_until_idle())
    assert len(penalties) == 0
    engine.close()


def test_the_rows_of_ended_requests_are_reused():
    table = PenaltyTable(VOCAB, torch.device("cpu"))
    for i in range(3 * INITIAL_ROWS):
        table.acquire([f"r{i}", None], [[1, 2], [3]], [[], [4]])
        table.release_unnamed()
        table.release(f"r{i}")
    assert len(table) == 0 and table.seen_ids.shape[0] == INITIAL_ROWS
