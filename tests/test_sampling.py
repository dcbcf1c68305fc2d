"""The sampler: greedy, temperature, top-k, top-p, seeds and min_tokens, batched."""

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.sampling import Sampler, SamplingRow, check_sampling

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
    ],
)
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        check_sampling(Sampling(**bad))
