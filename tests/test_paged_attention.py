"""Paged attention equals dense causal attention, for any mix of chunks and decodes."""

import pytest
import torch
import torch.nn.functional as F

from iris_serve.scheduler import cpu_kernels
from iris_serve.scheduler.attention import SequenceChunk, sdpa
from iris_serve.scheduler.attention.sdpa import SdpaBackend
from iris_serve.scheduler.kv.kv_cache import KVCache, KVLayout
from iris_serve.scheduler.kv.page_table import page_runs

torch.set_num_threads(2)
HEADS, KV_HEADS, DIM, PAGE = 4, 2, 8, 4


def dense_causal(q, k, v):
    """Reference: one sequence, all tokens at once. q [L, H, D], k/v [L, KVH, D]."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("layout", ["scattered pages", "gathered", "one run per sequence"])
@pytest.mark.parametrize("after_history", ["masked", "split", "bf16 kernel"])
def test_chunked_prefill_and_batched_decode_match_dense_attention(
    layout, after_history, monkeypatch
):
    """`split`: every chunk after history (of 2 tokens or more) attends to its own tokens
    and to each run of its history apart, the parts merged by log-sum-exps. `bf16 kernel`:
    a bfloat16 cache, where every chunk after history splits and its history runs through
    our kernel (`history_attention`), to bf16's rounding of the float32 reference over
    the same values. `gathered`: scattered pages, and every decode over two runs or more
    gathers its pages first."""
    threshold = 2 if after_history == "split" else 1 << 30
    monkeypatch.setattr(sdpa, "SPLIT_MIN_NEW_TOKENS", threshold)
    monkeypatch.setattr(sdpa, "GATHER_MIN_RUNS", 2 if layout == "gathered" else 1 << 30)
    dtype = torch.bfloat16 if after_history == "bf16 kernel" else torch.float32
    kernel_calls = _counted_history_kernel(monkeypatch)
    g = torch.Generator().manual_seed(0)
    lengths = [11, 5, 17]
    seqs = [
        (
            torch.randn(n, HEADS, DIM, generator=g).to(dtype),
            torch.randn(n, KV_HEADS, DIM, generator=g).to(dtype),
            torch.randn(n, KV_HEADS, DIM, generator=g).to(dtype),
        )
        for n in lengths
    ]
    cache = KVCache(
        KVLayout(1, KV_HEADS, DIM, PAGE, dtype), num_pages=32, device=torch.device("cpu")
    )
    if layout != "one run per sequence":  # every page its own run: the copy path
        pages = [cache.pool.allocate(5)[::-1] for _ in lengths]
    else:  # the views read in place
        pages = [cache.pool.allocate(5) for _ in lengths]
        assert all(len(page_runs(p)) == 1 for p in pages)
    # Feed each sequence in uneven steps; sequences share steps.
    schedules = [[3, 4, 1, 1, 1, 1], [5], [8, 1, 6, 1, 1]]
    done = [0, 0, 0]
    outputs = [[] for _ in lengths]
    for step in range(max(len(s) for s in schedules)):
        members = [i for i, s in enumerate(schedules) if step < len(s)]
        chunks = [SequenceChunk.of(pages[i], done[i], schedules[i][step]) for i in members]
        q = torch.cat([seqs[i][0][done[i] : done[i] + schedules[i][step]] for i in members])
        k = torch.cat([seqs[i][1][done[i] : done[i] + schedules[i][step]] for i in members])
        v = torch.cat([seqs[i][2][done[i] : done[i] + schedules[i][step]] for i in members])
        out = SdpaBackend(cache, torch.device("cpu")).prepare(chunks).attend(0, q, k, v)
        row = 0
        for i in members:
            outputs[i].append(out[row : row + schedules[i][step]])
            row += schedules[i][step]
            done[i] += schedules[i][step]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (q, k, v) in enumerate(seqs):
        got = torch.cat(outputs[i]).float()
        expected = dense_causal(q.float(), k.float(), v.float())
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert (len(kernel_calls) > 0) == (dtype == torch.bfloat16)


def _counted_history_kernel(monkeypatch) -> list[int]:
    """The query rows of each call to `history_attention`."""
    assert cpu_kernels.load("segment_attention")
    calls: list[int] = []
    kernel = torch.ops.iris_vision.history_attention

    def counted(q, k, v, scale):
        calls.append(q.shape[0])
        return kernel(q, k, v, scale)

    monkeypatch.setattr(torch.ops.iris_vision, "history_attention", counted)
    return calls


def test_each_decode_reads_its_own_context_in_place(monkeypatch):
    """A long context does not pad the batch: each decode's SDPA sees exactly its own
    context, as a view of the cache (no gather, no copy)."""
    cache = KVCache(
        KVLayout(1, KV_HEADS, DIM, PAGE, torch.float32), num_pages=64, device=torch.device("cpu")
    )
    lengths = [3, 41]  # contexts after this step: 4 and 42 tokens
    pages = [cache.pool.allocate(-(-(n + 1) // PAGE)) for n in lengths]
    chunks = [SequenceChunk.of(p, n, 1) for p, n in zip(pages, lengths, strict=True)]
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append((k.shape[-2], k.untyped_storage().data_ptr()))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    step = SdpaBackend(cache, torch.device("cpu")).prepare(chunks)
    step.attend(0, *(torch.randn(2, h, DIM) for h in (HEADS, KV_HEADS, KV_HEADS)))
    cache_storage = cache.slots.untyped_storage().data_ptr()
    assert seen == [(4, cache_storage), (42, cache_storage)]
