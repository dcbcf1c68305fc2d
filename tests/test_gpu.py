"""On a GPU: greedy tokens against transformers on the same GPU in fp32 and bf16, per
attention backend, and every backend against `sdpa` on random mixed batches.

    pytest -m gpu        # on a machine with CUDA (skipped elsewhere, see conftest.py)

bf16 sums in a different order than transformers' eager attention, so two correct
implementations may part ways after a near-tie; the assertion reports where.
"""

from __future__ import annotations

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.attention import SequenceChunk, create_backend
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.kv.kv_cache import KVCache, KVLayout
from iris_serve.scheduler.step.engine import Engine
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, hf_prompt_pixel_values, make_image

pytestmark = pytest.mark.gpu
MAX_NEW = 12
# How far below transformers' top logit Iris's greedy token may be where the two part ways.
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.25}


def _backends() -> list[str]:
    from iris_serve.scheduler.attention import BACKEND_NAMES

    return [name for name in BACKEND_NAMES if name != "auto"]


@pytest.fixture(scope="module")
def small_bf16(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen2_5_vl", size="small", dtype="bfloat16"))


def _transformers_greedy(
    model_dir: str, prompt, dtype: torch.dtype
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for the prompt on the GPU, and its logits at each."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
    model = model.to("cuda").eval()
    input_ids = torch.tensor([prompt.token_ids], device="cuda")
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if prompt.images:
        inputs["pixel_values"] = hf_prompt_pixel_values(model_dir, prompt).to("cuda", dtype)
        inputs["image_grid_thw"] = torch.tensor(
            [image.grid_thw for image in prompt.images], device="cuda"
        )
        inputs["mm_token_type_ids"] = (input_ids == model.config.image_token_id).int()
    with torch.inference_mode():
        output = model.generate(
            **inputs,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            num_beams=1,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = output.sequences[0, input_ids.shape[1] :].tolist()
    return tokens, [step[0].float().cpu() for step in output.logits]


def assert_greedy_agrees(
    got: list[int], expected: list[int], logits: list[torch.Tensor], dtype: torch.dtype, label: str
) -> None:
    """Iris's greedy tokens equal transformers', or equal up to a step where transformers'
    own logits put Iris's token within the dtype's rounding of its top one: a near-tie
    that the order of the sums decides (the generated weights are random, so their
    logits are close: on `small`, bf16 moves them by up to ~0.2 against fp32, and the top
    two are often nearer than that). Nothing is compared after such a step; a wrong
    computation picks a token far below the top."""
    tolerance = NEAR_TIE[dtype]
    for i, (mine, theirs) in enumerate(zip(got, expected, strict=False)):
        if mine != theirs:
            gap = (logits[i].max() - logits[i][mine]).item()
            assert gap <= tolerance, (
                f"{label}: token {i} is {mine} where transformers gives {theirs}, and its "
                f"logit there is {gap:.3g} below the top (a near-tie is <= {tolerance}): "
                f"{got} vs {expected}"
            )
            return
    assert len(got) == len(expected), f"{label}: {got} vs {expected}"


@pytest.fixture
def no_tf32():
    """fp32 means fp32: cuDNN's TF32 would round transformers' patch-embedding conv."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", _backends())
def test_greedy_tokens_agree_with_transformers_on_the_gpu(small_bf16, backend, dtype):
    builder = PromptBuilder(small_bf16)
    prompts = [
        chat_prompt(builder, "Describe the weather in three words."),
        chat_prompt(builder, "What is in the picture?", [make_image(320, 240, seed=3)]),
    ]
    engine = Engine(
        EngineConfig(
            model=small_bf16,
            device="cuda",
            dtype=str(dtype).removeprefix("torch."),
            attention_backend=backend,
            num_kv_pages=1024,  # leave the GPU to the transformers reference too
        )
    )
    for n, prompt in enumerate(prompts):
        [got] = engine.generate([prompt], Sampling(temperature=0.0, max_tokens=MAX_NEW))
        expected, logits = _transformers_greedy(small_bf16, prompt, dtype)
        assert_greedy_agrees(got, expected, logits, dtype, f"{backend} {dtype} prompt {n}")
    graphs = engine.runner.decode_graphs
    assert (graphs is not None and graphs.replays[1] > 0) == (backend == "triton")


@pytest.mark.usefixtures("no_tf32")
def test_a_padded_decode_graph_gives_each_sequence_transformers_tokens(small_bf16):
    """Three prompts decode together in the graph of 4 (one padding row); each sequence's
    greedy tokens agree with transformers' for that prompt alone (fp32: exact but for a
    near-tie of the order of sums)."""
    builder = PromptBuilder(small_bf16)
    prompts = [
        chat_prompt(builder, "Describe the weather in three words."),
        chat_prompt(builder, "What is in the picture?", [make_image(320, 240, seed=3)]),
        chat_prompt(builder, "Name a colour."),
    ]
    engine = Engine(
        EngineConfig(
            model=small_bf16, device="cuda", dtype="float32", max_num_seqs=8, num_kv_pages=1024
        )
    )
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    greedy = Sampling(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = engine.generate(prompts, greedy)
    assert graphs.replays[4] > 0
    for n, (prompt, got) in enumerate(zip(prompts, outputs, strict=True)):
        expected, logits = _transformers_greedy(small_bf16, prompt, torch.float32)
        # transformers stops at EOS; Iris ignored it, so compare what transformers made
        assert_greedy_agrees(got[: len(expected)], expected, logits, torch.float32, f"prompt {n}")


@pytest.mark.parametrize("backend", _backends())
def test_backends_match_sdpa_on_random_mixed_batches(backend):
    """Decodes and chunks after cached prefixes, over scattered pages, in bf16."""
    device = torch.device("cuda")
    heads, kv_heads, dim, page = 28, 4, 128, 16  # Qwen2.5-VL-7B's attention shape
    cache = KVCache(KVLayout(1, kv_heads, dim, page, torch.bfloat16), 512, device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    cache.slots.normal_(generator=torch.Generator(device="cuda").manual_seed(1))
    scattered = torch.randperm(512, generator=generator).tolist()  # disjoint slices
    chunks = []
    for num_cached, num_new in [(700, 1), (33, 1), (16, 40), (0, 57), (2047, 1), (129, 128)]:
        count = -(-(num_cached + num_new) // page)
        pages, scattered = scattered[:count], scattered[count:]
        chunks.append(SequenceChunk.of(pages, num_cached, num_new))
    tokens = sum(c.num_new for c in chunks)
    q, k, v = (
        torch.randn(tokens, h, dim, device=device, dtype=torch.bfloat16)
        for h in (heads, kv_heads, kv_heads)
    )
    reference_cache = KVCache(KVLayout(1, kv_heads, dim, page, torch.bfloat16), 512, device)
    reference_cache.slots.copy_(cache.slots)
    expected = create_backend("sdpa", reference_cache, device).prepare(chunks).attend(0, q, k, v)
    got = create_backend(backend, cache, device).prepare(chunks).attend(0, q, k, v)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache.slots, reference_cache.slots)  # the same K/V written


def test_the_start_up_profile_reads_the_activations_peak_on_the_gpu(small_bf16):
    """The KV cache is sized after this profile (`kv.sizing.kv_budget_bytes`): on CUDA
    both passes must report their peak, and free what they took."""
    from iris_serve.scheduler.kv.memory_profile import profile_activations
    from iris_serve.scheduler.models.registry import load_model

    config = EngineConfig(model=small_bf16, device="cuda", max_num_batched_tokens=1024)
    device = torch.device("cuda")
    model = load_model(small_bf16, dtype=torch.bfloat16, device=device)
    layout = KVLayout.of(model.config, config.page_size, torch.bfloat16)
    before = torch.cuda.memory_allocated(device)
    profile = profile_activations(model, config, layout, device)
    assert profile.prefill_bytes > 0 and profile.encoder_bytes > 0
    assert torch.cuda.memory_allocated(device) == before


def test_arena_segments_are_pinned_so_pixels_go_to_the_gpu_by_dma():
    """The scheduler's reader registers each worker segment with CUDA: a view of an
    image is pinned host memory and its non-blocking copy arrives intact."""
    import numpy as np

    from iris_serve.ipc.shm_arena import ShmArena, ShmReader
    from iris_serve.ipc.shm_names import instance_prefix, new_instance_id
    from iris_serve.scheduler.kv.pinned_host import cuda_host_registrar

    pixels = np.random.default_rng(0).integers(0, 256, (720, 1280, 3), dtype=np.uint8)
    with (
        ShmArena(instance_prefix(new_instance_id()) + "w0", 8 << 20) as arena,
        ShmReader(on_map=cuda_host_registrar(torch.device("cuda"))) as reader,
    ):
        view = reader.view(arena.put(None, pixels))
        assert view.is_pinned()
        copied = view.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(copied.cpu(), torch.from_numpy(pixels))
        del view


def test_a_segment_cuda_refuses_stays_pageable_and_the_next_step_runs():
    """A refused registration is logged, not raised; its error must not surface at the
    next kernel launch of the thread (the step's)."""
    from iris_serve.scheduler.kv.pinned_host import cuda_host_registrar

    register = cuda_host_registrar(torch.device("cuda"))
    assert register is not None
    undo = register(0, 4096)  # no memory there: refused
    undo()
    assert (torch.ones(4, device="cuda") + 1).sum().item() == 8
