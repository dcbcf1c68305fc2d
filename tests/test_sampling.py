"""The sampler: greedy, temperature, top-k, top-p, seeds and min_tokens, batched."""

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.sampling.sampler import (
    Sampler,
    SamplingFieldError,
    SamplingRow,
    check_sampling,
    check_token_ids,
)

torch.set_num_threads(2)


def rows(*params: Sampling, suppress=()) -> list[SamplingRow]:
    return [
        SamplingRow(
            p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None, suppress
        )
        for p in params
    ]


def test_greedy_takes_the_argmax_of_every_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    tokens = Sampler()(logits, rows(*[Sampling(temperature=0.0)] * 5))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy_even_at_high_temperature():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    params = [Sampling(temperature=5.0, top_k=1), Sampling(temperature=5.0, top_p=1e-6)]
    for p in params:
        tokens = Sampler()(logits, rows(*[p] * 4))
        assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_a_seeded_row_does_not_depend_on_its_batch_neighbours():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2))
    seeded = Sampling(temperature=1.0, seed=1234)
    alone = [Sampler()(logits, rows(seeded)).item() for _ in range(3)]
    neighbours = torch.randn(3, 1000)
    batch = torch.cat([neighbours[:2], logits, neighbours[2:]])
    in_batch = Sampler()(batch, rows(Sampling(), Sampling(temperature=0), seeded, Sampling(seed=9)))
    assert alone == [alone[0]] * 3
    assert in_batch[2].item() == alone[0]


def test_different_seeds_draw_different_sequences():
    """Twenty seeded requests decode eight steps together, each keeping its generator from
    step to step as the engine does: every sequence differs from every other, the
    generator moves on between steps, and the same seeds alone replay the same sequences."""
    seeds, steps = range(20), 8
    logits = torch.zeros(len(seeds), 1000)  # uniform

    def decode(batch: list[list[SamplingRow]]) -> dict[int, list[int]]:
        sequences: dict[int, list[int]] = {row.params.seed: [] for group in batch for row in group}
        for _ in range(steps):
            for group in batch:
                drawn = Sampler()(logits[: len(group)], group).tolist()
                for row, token in zip(group, drawn, strict=True):
                    sequences[row.params.seed].append(token)
        return sequences

    together = decode([rows(*[Sampling(seed=s) for s in seeds])])
    assert len({tuple(seq) for seq in together.values()}) == len(seeds)
    assert all(len(set(seq)) > 1 for seq in together.values()), "a generator did not advance"
    alone = decode([rows(Sampling(seed=s)) for s in seeds])
    assert alone == together


def test_sampling_frequencies_follow_the_softmax():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3).contiguous()
    tokens = Sampler()(logits, rows(*[Sampling(seed=i) for i in range(4000)]))
    frequencies = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(frequencies, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_top_k_never_draws_outside_the_k_best():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)).expand(500, 50)
    top3 = set(logits[0].topk(3).indices.tolist())
    tokens = Sampler()(logits.contiguous(), rows(*[Sampling(top_k=3, seed=i) for i in range(500)]))
    assert set(tokens.tolist()) <= top3
    assert len(set(tokens.tolist())) == 3


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().expand(1000, 4).contiguous()
    tokens = Sampler()(logits, rows(*[Sampling(top_p=0.75, seed=i) for i in range(1000)]))
    assert set(tokens.tolist()) == {0, 1}


def test_suppressed_tokens_are_never_drawn():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    greedy = Sampler()(logits, rows(Sampling(temperature=0), suppress=[0]))
    assert greedy.item() != 0
    # Sampled rows too, and only the rows that ask. Token 0 holds all but 4e-9 of the mass;
    # fresh logits, since the sampler suppresses in place.
    params = [Sampling(seed=i) for i in range(200)]
    batch = rows(*params, suppress=[0]) + rows(*params)
    fresh = torch.tensor([[20.0, 0.0, 0.0]]).expand(400, 3).contiguous()
    tokens = Sampler()(fresh, batch).tolist()
    assert 0 not in tokens[:200] and set(tokens[:200]) == {1, 2}
    assert tokens[200:] == [0] * 200


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(min_tokens=5, max_tokens=2),
        dict(repetition_penalty=0.0),
        dict(min_p=1.5),
    ],
)
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        check_sampling(Sampling(**bad))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (dict(stop_token_ids=(3, 64)), "stop_token_ids"),
        (dict(logit_bias=((-1, 2.0),)), "logit_bias"),
    ],
)
def test_a_token_id_outside_the_vocabulary_is_refused_naming_its_field(fields, param):
    """The sampler indexes the logits by stop and biased ids (min_tokens masks the stop
    ids): one outside the vocabulary is refused at admission, naming the field, however
    the request came (HTTP checks it too; a cluster frontend's request may not)."""
    check_token_ids(Sampling(stop_token_ids=(3, 63)), vocab_size=64)
    with pytest.raises(SamplingFieldError) as raised:
        check_token_ids(Sampling(**fields), vocab_size=64)
    assert raised.value.param == param and "out of the vocabulary" in str(raised.value)


# --- penalties, bias and min_p --------------------------------------------------------


def penalized_logits(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The logits the greedy argmax sees after the sampler's bias and penalties."""
    out = logits.clone().float()
    Sampler._add_bias(out, [row])
    Sampler()._penalize(out, [row])
    return out


def test_repetition_penalty_equals_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)) * 4
    prompt, output = [3, 5, 5, 60], [7, 3, 11]
    row = SamplingRow(Sampling(repetition_penalty=1.7), None, (), prompt, output)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits)
    torch.testing.assert_close(penalized_logits(logits, row), expected, rtol=0, atol=0)


def test_frequency_and_presence_penalties_follow_openai_on_output_tokens_only():
    logits = torch.zeros(1, 16)
    params = Sampling(frequency_penalty=0.5, presence_penalty=0.25)
    row = SamplingRow(params, None, (), prompt_token_ids=[1, 2], output_token_ids=[2, 4, 4, 4])
    expected = torch.zeros(1, 16)
    expected[0, 2] = -(0.5 * 1 + 0.25)
    expected[0, 4] = -(0.5 * 3 + 0.25)  # prompt token 1 untouched: output only
    torch.testing.assert_close(penalized_logits(logits, row), expected)


def test_logit_bias_moves_the_greedy_choice_and_min_p_keeps_transformers_set():
    from transformers import MinPLogitsWarper

    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    biased = Sampling(temperature=0.0, logit_bias=((17, 100.0),))
    assert Sampler()(logits, rows(biased, Sampling(temperature=0.0))).tolist() == [
        17,
        logits[1].argmax().item(),
    ]
    probs = torch.softmax(logits, dim=-1)
    kept = Sampler._apply_min_p(probs, rows(*[Sampling(min_p=0.2)] * 2)) > 0
    reference = MinPLogitsWarper(0.2)(torch.zeros(2, 1, dtype=torch.long), logits) > float("-inf")
    assert torch.equal(kept, reference)


def test_a_penalty_in_the_engine_gives_transformers_tokens(qwen2_5_vl_tiny):
    """Greedy with repetition_penalty over prompt and output, as `generate` applies it."""
    from iris_serve.tokenizer_worker.prompt import PromptBuilder
    from tests.reference import (
        chat_prompt,
        cpu_engine,
        hf_model,
        hf_prompt_pixel_values,
        make_image,
    )

    builder = PromptBuilder(qwen2_5_vl_tiny)
    prompt = chat_prompt(builder, "Say it again and again.", [make_image(48, 40, seed=5)])
    sampling = Sampling(temperature=0.0, max_tokens=16, repetition_penalty=1.5)
    [ours] = cpu_engine(qwen2_5_vl_tiny).generate([prompt], sampling)
    model = hf_model(str(qwen2_5_vl_tiny))
    input_ids = torch.tensor([prompt.token_ids])
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=hf_prompt_pixel_values(qwen2_5_vl_tiny, prompt),
            image_grid_thw=torch.tensor([image.grid_thw for image in prompt.images]),
            mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.5,
        )
    assert ours == output[0, input_ids.shape[1] :].tolist()
    plain = cpu_engine(qwen2_5_vl_tiny).generate([prompt], Sampling(temperature=0.0, max_tokens=16))
    assert ours != plain[0], "the penalty was meant to change the answer"


def test_logprobs_are_the_log_softmax_of_transformers_logits(qwen3_vl_tiny):
    """Each sampled token's logprob and the top 3 equal transformers' log-softmax at that
    position (teacher-forced on the same tokens), whatever the sampler did after."""
    from iris_serve.tokenizer_worker.prompt import PromptBuilder
    from tests.reference import (
        chat_prompt,
        cpu_engine,
        hf_model,
        hf_prompt_pixel_values,
        make_image,
    )

    builder = PromptBuilder(qwen3_vl_tiny)
    prompt = chat_prompt(builder, "Describe it.", [make_image(48, 40, seed=6)])
    sampling = Sampling(temperature=0.0, max_tokens=6, logprobs=3, repetition_penalty=1.3)
    engine = cpu_engine(qwen3_vl_tiny)
    engine.add_request("r", prompt, sampling)
    outputs = list(engine.run_until_idle())
    tokens = [t for out in outputs for t in out.new_token_ids]
    logprobs = [lp for out in outputs for lp in out.logprobs or []]
    assert [lp.token_id for lp in logprobs] == tokens and len(tokens) == 6

    model = hf_model(str(qwen3_vl_tiny))
    ids = torch.tensor([list(prompt.token_ids) + tokens])
    with torch.inference_mode():
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=hf_prompt_pixel_values(qwen3_vl_tiny, prompt),
            image_grid_thw=torch.tensor([image.grid_thw for image in prompt.images]),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        ).logits[0, len(prompt.token_ids) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for step, (ours, expected) in enumerate(zip(logprobs, reference, strict=True)):
        assert ours.logprob == pytest.approx(expected[ours.token_id].item(), abs=1e-4), step
        top = expected.topk(3)
        assert [t for t, _ in ours.top] == top.indices.tolist(), step
        assert [v for _, v in ours.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_the_engine_seed_makes_unseeded_sampling_repeat(qwen2_5_vl_tiny):
    from iris_serve.ipc.local import PromptInput
    from tests.reference import cpu_engine

    prompt = PromptInput.text(range(100, 140))
    sampling = Sampling(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed: int) -> list[int]:
        return cpu_engine(qwen2_5_vl_tiny, seed=seed).generate([prompt], sampling)[0]

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


# --- the edges of every parameter: the greedy answer or a valid sample, never a NaN's --


# Token 0 masked (a NaN's argmax is 0), token 4 all but impossible.
EDGE_LOGITS = torch.tensor([[float("-inf"), 3.0, 1.0, 2.5, -50.0, 0.5]])
GREEDY_TOKEN = 1
KEPT = {1, 2, 3, 4, 5}  # the tokens with any probability at all


def edge_draws(count: int = 64, logits: torch.Tensor = EDGE_LOGITS, **params) -> list[int]:
    """`count` seeded draws of one row under `params`."""
    batch = logits.expand(count, -1).contiguous()
    return Sampler()(batch, rows(*[Sampling(seed=i, **params) for i in range(count)])).tolist()


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1e-40),  # a float32 denormal: the logits over it overflow
        dict(temperature=1e-300),  # 0 in float32
        dict(temperature=5e-324),  # the smallest double
        dict(temperature=9.9e-6),  # just below vLLM's threshold
        dict(top_p=1e-300),
        dict(top_p=5e-324),
        dict(top_p=1e-45),
        dict(min_p=1.0),
        dict(top_k=1, temperature=1e6),
        dict(temperature=5.0, top_p=1e-300, min_p=1e-300),
    ],
)
def test_a_vanishing_temperature_top_p_or_full_min_p_is_greedy(params):
    """The issue's reproduction picked token 0 at every step; the greedy token it is."""
    assert set(edge_draws(**params)) == {GREEDY_TOKEN}


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1e30),
        dict(temperature=1e300),  # past float32: uniform over what the masks keep
        dict(temperature=float("inf")),
        dict(min_p=1e-300),
        dict(top_k=10**9),
        dict(top_p=1.0, min_p=0.0, temperature=1e-5),  # at the threshold: still a sample
        dict(frequency_penalty=-2.0, presence_penalty=2.0),
        dict(logit_bias=((4, 100.0), (1, -100.0))),
    ],
)
def test_extreme_parameters_sample_only_tokens_the_masks_keep(params):
    draws = edge_draws(**params)
    assert set(draws) <= KEPT, draws
    if params.get("temperature", 1.0) >= 1e30:  # a flat distribution: not one token
        assert len(set(draws)) > 1


def test_a_vanishing_repetition_penalty_keeps_the_sample_among_the_seen_tokens():
    """A penalty of 1e-300 is 0 in float32: seen tokens with positive logits overflow to
    +inf. They win, as in transformers, and the draw stays among them (no NaN)."""
    logits = EDGE_LOGITS.expand(64, -1).contiguous()
    params = [Sampling(seed=i, repetition_penalty=1e-300) for i in range(64)]
    batch = [
        SamplingRow(p, torch.Generator().manual_seed(i), (), (2, 5), ())
        for i, p in enumerate(params)
    ]
    assert set(Sampler()(logits, batch).tolist()) <= {2, 5}
    greedy = SamplingRow(Sampling(temperature=0, repetition_penalty=1e-300), None, (), (2, 5), ())
    assert Sampler()(EDGE_LOGITS.clone(), [greedy]).item() in {2, 5}


def test_a_zero_from_the_exponential_noise_never_draws_a_masked_token(monkeypatch):
    """Exp(1) draws 0 now and then (about once per 2**24 values); over a masked token's zero
    probability that made 0 / 0 = NaN, which argmax takes."""

    def zeros(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.zero_()

    monkeypatch.setattr(torch.Tensor, "exponential_", zeros)
    tokens = Sampler()(EDGE_LOGITS.clone(), rows(Sampling(top_k=2)))
    assert tokens.item() in {1, 3}
