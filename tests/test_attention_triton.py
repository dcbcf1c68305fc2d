"""The `triton` backend equals the `sdpa` backend on the same cache, under Triton's
interpreter on the CPU (`TRITON_INTERPRET=1`); its KV write equals `KVCache.write`.

Triton reads `TRITON_INTERPRET` when `@triton.jit` decorates, and its own `tl.zeros`,
`tl.sum`, ... are decorated when triton is first imported, which torch may do early
(through torch._dynamo): `tests/conftest.py` sets the variable before any test module
imports torch, and the `kernels` fixture checks it took. Shapes stay tiny: the
interpreter runs every program of the grid in numpy.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time

import pytest
import torch

from iris_serve.scheduler.attention import SequenceChunk, resolve_backend_name
from iris_serve.scheduler.attention.sdpa import SdpaBackend
from iris_serve.scheduler.kv.kv_cache import KVCache, KVLayout

torch.set_num_threads(2)
CPU = torch.device("cpu")
PAGE = 4
NUM_PAGES = 128
KERNELS = "iris_serve.scheduler.attention.triton_kernels"  # `kernels`: tests/conftest.py


def triton_backend(cache: KVCache, split_decode: bool | None = None):
    from iris_serve.scheduler.attention.triton_backend import TritonBackend

    return TritonBackend(cache, CPU, split_decode=split_decode)


def make_cache(kv_heads: int, dim: int, seed: int = 0) -> KVCache:
    """Two layers (the tests use layer 1), every slot random: stands for the history."""
    cache = KVCache(KVLayout(2, kv_heads, dim, PAGE, torch.float32), NUM_PAGES, CPU)
    cache.slots.normal_(generator=torch.Generator().manual_seed(seed))
    return cache


def sequence_pages(layout: str, counts: list[int], seed: int = 1) -> list[list[int]]:
    """Each sequence's pages: one consecutive run each, or every page somewhere else."""
    order = list(range(NUM_PAGES))
    if layout == "scattered":
        order = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(seed)).tolist()
    pages, start = [], 0
    for count in counts:
        pages.append(order[start : start + count])
        start += count
    return pages


def new_tokens(chunks: list[SequenceChunk], heads: int, kv_heads: int, dim: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    n = sum(c.num_new for c in chunks)
    return (
        torch.randn(n, heads, dim, generator=g),
        torch.randn(n, kv_heads, dim, generator=g),
        torch.randn(n, kv_heads, dim, generator=g),
    )


def assert_matches_sdpa(chunks, heads, kv_heads, dim, split_decode=None) -> torch.Tensor:
    """Runs both backends from the same cache contents; outputs and caches must agree."""
    q, k, v = new_tokens(chunks, heads, kv_heads, dim)
    sdpa_cache, triton_cache = make_cache(kv_heads, dim), make_cache(kv_heads, dim)
    want = SdpaBackend(sdpa_cache, CPU).prepare(chunks).attend(1, q, k, v)
    got = triton_backend(triton_cache, split_decode).prepare(chunks).attend(1, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(triton_cache.slots, sdpa_cache.slots)
    return got


# -- KV write ----------------------------------------------------------------------------


def test_kv_write_is_bit_exact_and_skips_negative_slots(kernels):
    cache, reference = make_cache(2, 80), make_cache(2, 80)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(6, 2, 80, generator=g), torch.randn(6, 2, 80, generator=g)
    slots = torch.tensor([5, 6, 7, 8, 200, 3], dtype=torch.int32)
    kernels.write_kv(k, v, *cache.layer(1), slots)
    reference.write(1, slots.long(), k, v)
    assert torch.equal(cache.slots, reference.slots)

    padded = torch.tensor([9, -1, 10, -1, -1, 11], dtype=torch.int32)  # -1: padding rows
    kernels.write_kv(k, v, *cache.layer(0), padded)
    real = padded >= 0
    reference.write(0, padded[real].long(), k[real], v[real])
    assert torch.equal(cache.slots, reference.slots)


# -- unified kernel: any mix of chunks ---------------------------------------------------


RAGGED = [  # (num_cached, num_new), PAGE = 4
    (7, 1),  # decode whose context ends exactly at a page boundary (8)
    (8, 1),  # decode one past a page boundary (9)
    (4, 5),  # prefill chunk after a cached page, crossing into a third page
    (0, 37),  # fresh prefill: several q-blocks and KV tiles
    (13, 1),  # decode
    (6, 10),  # chunk after a cached prefix that ends mid-page
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "layout"),
    [
        (4, 2, 8, "contiguous"),
        (4, 2, 8, "scattered"),
        (4, 4, 16, "scattered"),
        (6, 2, 80, "scattered"),
    ],
    ids=["gqa4-2-dim8-contiguous", "gqa4-2-dim8-scattered", "mha4-dim16", "gqa6-2-dim80"],
)
def test_ragged_batch_matches_sdpa(kernels, heads, kv_heads, dim, layout):
    """Decodes and prefill chunks in one launch; group 3 leaves unused packed rows and
    head_dim 80 is padded to 128."""
    counts = [-(-(c + n) // PAGE) + 1 for c, n in RAGGED]  # one spare page each
    pages = sequence_pages(layout, counts)
    chunks = [SequenceChunk.of(p, c, n) for p, (c, n) in zip(pages, RAGGED, strict=True)]
    assert_matches_sdpa(chunks, heads, kv_heads, dim)


def test_a_fresh_prefill_alone_matches_sdpa(kernels):
    chunks = [SequenceChunk.of(sequence_pages("scattered", [6])[0], 0, 21)]
    assert_matches_sdpa(chunks, 4, 2, 16)


# -- split-K decode ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 2, 16), (6, 2, 80)], ids=["gqa4-2", "gqa6-2-dim80"]
)
def test_split_decode_equals_unified_decode_equals_sdpa(kernels, heads, kv_heads, dim):
    """Contexts of 300 (two tiles a segment), 64 (segments past 4 empty) and 9 (one
    past a page boundary), on scattered pages."""
    contexts = [300, 64, 9]
    pages = sequence_pages("scattered", [-(-n // PAGE) for n in contexts])
    chunks = [SequenceChunk.of(p, n - 1, 1) for p, n in zip(pages, contexts, strict=True)]
    split = assert_matches_sdpa(chunks, heads, kv_heads, dim, split_decode=True)
    unified = assert_matches_sdpa(chunks, heads, kv_heads, dim, split_decode=False)
    torch.testing.assert_close(split, unified, atol=1e-6, rtol=1e-6)


def test_split_rule_takes_few_long_decodes_only(kernels):
    from iris_serve.scheduler.attention.triton_backend import (
        SPLIT_MIN_CONTEXT,
        max_split_seqs,
        use_split_decode,
    )

    def decodes(*contexts: int) -> list[SequenceChunk]:
        return [SequenceChunk.of(list(range(-(-n // PAGE))), n - 1, 1) for n in contexts]

    long = SPLIT_MIN_CONTEXT
    assert max_split_seqs(8) == 16 and max_split_seqs(2) == 64
    assert use_split_decode(decodes(long, 5), num_kv_heads=8)
    assert not use_split_decode(decodes(long - 1, 5), num_kv_heads=8)  # all short
    assert not use_split_decode(decodes(*[long] * 17), num_kv_heads=8)  # enough programs
    mixed = [*decodes(long), SequenceChunk.of([0, 1], 0, 5)]
    assert not use_split_decode(mixed, num_kv_heads=8)  # a prefill in the step
    cache = make_cache(2, 8)
    assert triton_backend(cache).prepare(decodes(long, 5)).split
    assert not triton_backend(cache, split_decode=True).prepare(mixed).split


# -- fixed buffers for CUDA graphs ---------------------------------------------------------


@pytest.mark.parametrize("split_decode", [True, False], ids=["split", "unified"])
def test_static_decode_refilled_for_each_step_matches_sdpa(kernels, split_decode):
    """One context per graph size, built once: two steps of a size-4 graph refill its
    buffers (3 long decodes, then 2 short ones on other pages: stale, wider table rows
    behind them) and each equals `sdpa`; the padding rows write no KV."""
    heads, kv_heads, dim = 4, 2, 16
    cache = make_cache(kv_heads, dim)
    backend = triton_backend(cache, split_decode)
    static = backend.static_decode(max_seqs=8, max_pages=80)
    context = static.context(4)
    assert static.context(4) is context and context.split == split_decode
    pages = sequence_pages("scattered", [75, 3, 16, 2, 5])
    steps = [
        [SequenceChunk.of(p, n - 1, 1) for p, n in zip(pages[:3], [300, 9, 64], strict=True)],
        [SequenceChunk.of(p, n - 1, 1) for p, n in zip(pages[3:], [5, 17], strict=True)],
    ]
    for seed, chunks in enumerate(steps):
        q, k, v = new_tokens(chunks, heads, kv_heads, dim, seed=seed)
        padded = [torch.cat([t, torch.randn(4 - len(chunks), *t.shape[1:])]) for t in (q, k, v)]
        reference = KVCache(cache.layout, NUM_PAGES, CPU)
        reference.slots.copy_(cache.slots)
        expected = SdpaBackend(reference, CPU).prepare(chunks).attend(1, q, k, v)
        static.fill(chunks, 4)
        got = context.attend(1, *padded)
        torch.testing.assert_close(got[: len(chunks)], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache.slots, reference.slots)


# -- choosing the backend ----------------------------------------------------------------


def test_backend_resolution(monkeypatch):
    cuda = torch.device("cuda")
    assert resolve_backend_name("auto", CPU) == "sdpa"
    assert resolve_backend_name("auto", cuda) == "triton"
    assert resolve_backend_name("triton", cuda) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("triton", CPU) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend_name("triton", CPU)

    real_find_spec = importlib.util.find_spec

    def without_triton(name, *args, **kwargs):
        return None if name == "triton" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_triton)
    assert resolve_backend_name("auto", cuda) == "sdpa"
    with pytest.raises(ValueError, match="triton package"):
        resolve_backend_name("triton", cuda)


def test_the_cpu_path_imports_no_triton():
    """`sdpa` and the backend registry never import triton (lazy, so the CPU path needs no triton)."""
    import subprocess

    code = (
        "import sys, torch;"
        "from iris_serve.scheduler.attention import create_backend;"
        "from iris_serve.scheduler.kv.kv_cache import KVCache, KVLayout;"
        "c = KVCache(KVLayout(1, 1, 8, 4, torch.float32), 2, torch.device('cpu'));"
        "create_backend('auto', c, torch.device('cpu'));"
        "assert 'triton' not in sys.modules and "
        f"'{KERNELS}' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the engine --------------------------------------------------------------------------


def test_engine_greedy_tokens_equal_sdpa(kernels, qwen2_5_vl_tiny):
    from iris_serve.ipc.local import PromptInput
    from iris_serve.ipc.messages import Sampling
    from tests.reference import cpu_engine

    prompt = PromptInput.text(range(100, 119))  # 19 tokens: prefill crosses pages
    greedy = Sampling(temperature=0.0, max_tokens=6)
    started = time.monotonic()
    outputs = {
        name: cpu_engine(qwen2_5_vl_tiny, attention_backend=name, page_size=8).generate(
            [prompt], greedy
        )
        for name in ("sdpa", "triton")
    }
    assert outputs["triton"] == outputs["sdpa"]
    assert len(outputs["triton"][0]) == 6
    assert time.monotonic() - started < 60
