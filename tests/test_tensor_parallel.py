"""Tensor parallelism on the CPU (gloo): a group of N ranks gives transformers' greedy
tokens, as one rank does, through chunked prefill, preemption and warm caches; what rank 0
sends the others per step is bounded by the step, never by an image's size.

The groups run in spawned processes (`tests/tp_harness.py`), as under `iris serve
--tensor-parallel-size N`; the server-level checks (an 8-round conversation, a rank killed
with SIGKILL) are in test_caches_e2e.py and test_server_e2e.py.
"""

from __future__ import annotations

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.models.tensor_parallel import AttentionHeads, TPShard, TPSplit
from iris_serve.tiny_checkpoint.configs import SHAPES
from tests.reference import assert_parity, chat_prompt, make_image
from tests.tp_harness import generate_tp

MAX_NEW = 16
GREEDY = Sampling(temperature=0.0, max_tokens=MAX_NEW)
PAGE = 8
BUDGET = 48  # tokens per step: chunk boundaries fall inside the images below


def test_heads_are_split_and_kv_heads_replicated_past_their_count():
    # 4 query heads, 2 KV heads (the tiny checkpoints): at 4 ranks each KV head serves two
    assert [AttentionHeads.of(4, 2, TPShard(r, 2)) for r in range(2)] == [
        AttentionHeads(2, 0, 1, 0),
        AttentionHeads(2, 2, 1, 1),
    ]
    assert [AttentionHeads.of(4, 2, TPShard(r, 4)).kv_start for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_attention_heads"):
        AttentionHeads.of(4, 2, TPShard(0, 3))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        AttentionHeads.of(12, 4, TPShard(0, 6))


def test_a_split_takes_its_rows_of_each_packed_piece_or_of_a_fused_tensor():
    fused = torch.arange(24).view(2, 6, 2)  # [experts, gate rows then up rows, hidden]
    gate_up = TPSplit(1, ((1, 1), (4, 1)))  # rank 1 of 3: one gate row and one up row
    assert gate_up.take(fused).tolist() == [[[2, 3], [8, 9]], [[14, 15], [20, 21]]]
    q_then_k = TPSplit(0, ((2, 2), (1, 1)))
    assert q_then_k.take(torch.arange(4), packed_piece=0).tolist() == [2, 3]
    assert q_then_k.take(torch.arange(2), packed_piece=1).tolist() == [1]
    row_parallel = TPSplit(1, ((0, 2),))
    assert row_parallel.take(torch.ones(5)).shape == (5,)  # a bias is not split


def _prompts(builder):
    long_text = " ".join(f"Line {i} is about rivers and {i * 3} stones." for i in range(8))
    return [
        chat_prompt(builder, "Write a short poem about the sea."),
        chat_prompt(builder, "What is in this picture?", [make_image(64, 48, seed=1)]),
        chat_prompt(
            builder,
            "Compare these three images.",
            [
                make_image(150, 100, "RGB", seed=2),
                make_image(120, 90, "L", seed=3),
                make_image(90, 120, "RGBA", seed=4),
            ],
        ),
        chat_prompt(builder, long_text, [make_image(200, 140, seed=5)]),
    ]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe"])
def test_two_ranks_give_the_reference_tokens_cold_preempted_and_warm(tiny_checkpoint, arch):
    """Round 1: four prompts at once in a pool too small for them (preemption), chunked
    at 48 tokens; round 2: the same prompts (embedding cache and prefix cache warm);
    round 3: one of them alone (its pages found in the prefix cache). On Qwen3.5-MoE
    each rank holds half of every linear layer's heads and their state, and every rank
    applies rank 0's slot clears and copies (the snapshots of round 2's and 3's hits)."""
    from iris_serve.tokenizer_worker.prompt import PromptBuilder

    model_dir = tiny_checkpoint(arch)
    prompts = _prompts(PromptBuilder(model_dir))
    longest = max(len(p.token_ids) for p in prompts) + MAX_NEW
    num_pages = -(-longest // PAGE) + 4
    run = generate_tp(
        model_dir,
        2,
        [prompts, prompts, prompts[2:3]],
        GREEDY,
        page_size=PAGE,
        num_kv_pages=num_pages,
        max_num_batched_tokens=BUDGET,
    )
    for outputs, round_prompts in zip(run.outputs, [prompts, prompts, prompts[2:3]], strict=True):
        assert_parity(model_dir, round_prompts, outputs, MAX_NEW)
    cold, warm, alone = run.stats
    assert cold.num_preemptions > 0, "the pool was meant to force preemption"
    assert warm.mm_embedding_cache_hits > cold.mm_embedding_cache_hits
    assert alone.prefix_cache_hit_tokens > warm.prefix_cache_hit_tokens
    assert alone.kv_pages_used == 0 and alone.pinned_images == 0

    # What rank 0 sends per step is bounded by the step, whatever the images: 16 bytes
    # per token (id, three positions), a page list per sequence, a little per chunk.
    per_sequence = 64 + 4 * num_pages
    bound = 16 * BUDGET + per_sequence * len(prompts) + 256
    assert run.max_message_bytes <= bound, (run.max_message_bytes, bound)


def test_four_ranks_with_replicated_kv_heads_give_the_reference_tokens(tiny_checkpoint):
    """Qwen3-VL's tiny checkpoint has 2 KV heads: at 4 ranks each is held by two."""
    from iris_serve.tokenizer_worker.prompt import PromptBuilder

    assert SHAPES["tiny"].kv_heads < 4 <= SHAPES["tiny"].heads
    model_dir = tiny_checkpoint("qwen3_vl")
    prompts = _prompts(PromptBuilder(model_dir))[:3]
    run = generate_tp(model_dir, 4, [prompts], GREEDY, max_num_batched_tokens=BUDGET)
    assert_parity(model_dir, prompts, run.outputs[0], MAX_NEW)


def test_a_large_image_does_not_grow_the_step_message(tiny_checkpoint):
    """One 64x48 image or one 900x700 image: the largest message is the same size (the
    step's tokens fill the budget either way); the pixels never travel."""
    from iris_serve.tokenizer_worker.prompt import PromptBuilder

    model_dir = tiny_checkpoint("qwen2_5_vl")
    builder = PromptBuilder(model_dir)
    text = "Describe every part of it. " * 12  # past the budget: the first steps are full
    small = chat_prompt(builder, text, [make_image(64, 48, seed=8)])
    large = chat_prompt(builder, text, [make_image(900, 700, seed=9)])
    sampling = Sampling(temperature=0.0, max_tokens=2)
    sizes = [
        generate_tp(model_dir, 2, [[p]], sampling, max_num_batched_tokens=BUDGET).max_message_bytes
        for p in (small, large)
    ]
    pixel_bytes = large.pixels[0].numel() * large.pixels[0].element_size()
    assert sizes[1] <= sizes[0] + 16, sizes  # as many tokens and pages per step
    assert pixel_bytes > 1000 * sizes[1]


def test_a_rank_reads_exactly_the_bytes_of_its_shard(tiny_checkpoint, monkeypatch):
    from iris_serve.scheduler.models import loader
    from iris_serve.scheduler.models.registry import load_model

    read: list[int] = []
    narrow, load = loader.CheckpointTensor.narrow, loader.CheckpointTensor.load

    def counted(method):
        def run(*args):
            tensor = method(*args)
            read.append(tensor.numel() * tensor.element_size())
            return tensor

        return run

    monkeypatch.setattr(loader.CheckpointTensor, "narrow", counted(narrow))
    monkeypatch.setattr(loader.CheckpointTensor, "load", counted(load))
    shard = load_model(tiny_checkpoint("qwen2_5_vl"), torch.float32, "cpu", tp=TPShard(1, 2))
    kept = sum(p.numel() * p.element_size() for p in shard.parameters())
    assert sum(read) == kept  # the vision tower whole, the decoder's half, nothing more


def test_a_shard_holds_its_heads_its_expert_width_and_its_vocabulary(tiny_checkpoint):
    from iris_serve.scheduler.models.registry import load_model

    model_dir = tiny_checkpoint("qwen3_vl_moe")
    full = load_model(model_dir, torch.float32, "cpu")
    shard = load_model(model_dir, torch.float32, "cpu", tp=TPShard(1, 2))
    tiny = SHAPES["tiny"]
    head_dim, width = tiny.hidden // tiny.heads, tiny.expert_intermediate
    attention, attention_shard = full.model.layers[0].self_attn, shard.model.layers[0].self_attn
    q, k, v = attention.qkv_proj.weight.split((4 * head_dim, 2 * head_dim, 2 * head_dim))
    expected_qkv = torch.cat([q[2 * head_dim :], k[head_dim:], v[head_dim:]])
    torch.testing.assert_close(attention_shard.qkv_proj.weight, expected_qkv, rtol=0, atol=0)
    torch.testing.assert_close(
        attention_shard.o_proj.weight, attention.o_proj.weight[:, 2 * head_dim :], rtol=0, atol=0
    )
    experts, experts_shard = full.model.layers[0].mlp.experts, shard.model.layers[0].mlp.experts
    half = width // 2
    gate_up = experts.gate_up_proj
    expected = torch.cat([gate_up[:, half:width], gate_up[:, width + half :]], dim=1)
    torch.testing.assert_close(experts_shard.gate_up_proj, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        experts_shard.down_proj, experts.down_proj[:, :, half:], rtol=0, atol=0
    )
    vocab = full.lm_head.weight.shape[0]
    torch.testing.assert_close(shard.lm_head.weight, full.lm_head.weight[vocab // 2 :])
    torch.testing.assert_close(
        shard.model.embed_tokens.weight, full.model.embed_tokens.weight[vocab // 2 :]
    )


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_5_moe"])
def test_two_ranks_with_a_host_tier_reload_their_own_shards(tiny_checkpoint, arch):
    """A pool that holds about one prompt (and on Qwen3.5-MoE two state snapshots), so
    round 2 finds most of round 1 in host memory: each rank copies its own shard of the
    pages (and snapshots) out and back as rank 0 tells it, in order, before its forward,
    and the tokens stay transformers'."""
    from iris_serve.tokenizer_worker.prompt import PromptBuilder

    model_dir = tiny_checkpoint(arch)
    prompts = _prompts(PromptBuilder(model_dir))
    longest = max(len(p.token_ids) for p in prompts) + MAX_NEW
    rounds = [prompts, prompts[::-1]]
    snapshots = {"linear_state_snapshots": 2} if arch == "qwen3_5_moe" else {}
    run = generate_tp(
        model_dir,
        2,
        rounds,
        GREEDY,
        page_size=PAGE,
        num_kv_pages=-(-longest // PAGE) + 2,
        max_num_batched_tokens=BUDGET,
        kv_offload_bytes=8 << 20,
        **snapshots,
    )
    for outputs, round_prompts in zip(run.outputs, rounds, strict=True):
        assert_parity(model_dir, round_prompts, outputs, MAX_NEW)
    first, second = run.stats
    assert second.prefix_cache_host_hit_tokens > first.prefix_cache_host_hit_tokens
