"""The KV cache's share of a GPU (`cuda_kv_budget`), from the numbers CUDA reports and
the profiled activations (`memory_profile`): the arithmetic and the profile's passes run
anywhere, so they are tested here without a GPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.kv.kv_cache import KVLayout
from iris_serve.scheduler.kv.memory_profile import largest_encoder_call, profile_activations
from iris_serve.scheduler.kv.sizing import HEADROOM_BYTES, cuda_kv_budget, readable_bytes
from iris_serve.scheduler.models.registry import load_model

GiB = 2**30
TOTAL = 80 * GiB
CONTEXT = GiB // 2  # the CUDA context: used on the device, not held by torch
ACTIVATIONS = 3 * GiB  # as profiled


def test_two_servers_at_045_share_one_gpu_and_get_the_same_kv_cache():
    weights, cache = 16 * GiB, 1 * GiB
    first = cuda_kv_budget(TOTAL, TOTAL - CONTEXT - weights, weights, 0.45, cache, ACTIVATIONS)
    used_by_first = CONTEXT + weights + first + cache + (ACTIVATIONS + HEADROOM_BYTES)
    free = TOTAL - used_by_first - CONTEXT - weights  # the second server has loaded its model
    second = cuda_kv_budget(TOTAL, free, weights, 0.45, cache, ACTIVATIONS)
    assert first == second == int(0.45 * TOTAL) - weights - cache - (ACTIVATIONS + HEADROOM_BYTES)
    assert used_by_first * 2 <= TOTAL


def test_the_kv_cache_never_takes_more_than_is_free():
    others = 60 * GiB  # another program on the GPU
    weights = 4 * GiB
    free = TOTAL - others - CONTEXT - weights
    budget = cuda_kv_budget(TOTAL, free, weights, 0.9, 0, ACTIVATIONS)
    assert budget == free - (ACTIVATIONS + HEADROOM_BYTES)


def test_the_embedding_cache_is_counted_in_the_share():
    weights = 16 * GiB
    free = TOTAL - CONTEXT - weights
    with_cache = cuda_kv_budget(TOTAL, free, weights, 0.9, 4 * GiB, ACTIVATIONS)
    without = cuda_kv_budget(TOTAL, free, weights, 0.9, 0, ACTIVATIONS)
    assert without - with_cache == 4 * GiB


def test_a_share_smaller_than_the_model_is_refused_naming_the_flags():
    weights = 16 * GiB
    with pytest.raises(
        ValueError, match=r"--gpu-memory-utilization 0\.2 .*--mm-embedding-cache-gb"
    ):
        cuda_kv_budget(TOTAL, TOTAL - CONTEXT - weights, weights, 0.2, GiB, ACTIVATIONS)


def test_the_profiled_activations_come_out_of_the_kv_cache_byte_for_byte():
    weights = 16 * GiB
    free = TOTAL - CONTEXT - weights
    small = cuda_kv_budget(TOTAL, free, weights, 0.9, GiB, 1 * GiB)
    large = cuda_kv_budget(TOTAL, free, weights, 0.9, GiB, 5 * GiB)
    assert small - large == 4 * GiB


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_the_profile_runs_the_largest_step_and_vision_call_each_architecture_takes(
    tiny_checkpoint, arch
):
    """The passes run at start-up on a GPU, where a dummy input that does not fit the
    model would stop the server: here they run on the CPU (which reports no peak)."""
    model_dir = tiny_checkpoint(arch)
    config = EngineConfig(
        model=str(model_dir), device="cpu", max_num_batched_tokens=48, max_num_encoder_tokens=8
    )
    model = load_model(model_dir, dtype=torch.float32, device="cpu")
    layout = KVLayout.of(model.config, config.page_size, torch.float32)
    rows: list[int] = []
    encode = model.encode_images
    model.encode_images = lambda *a: rows.append(len(out := encode(*a))) or out  # type: ignore[method-assign]
    profile = profile_activations(model, config, layout, torch.device("cpu"))

    processor = json.loads((model_dir / "preprocessor_config.json").read_text())
    side = processor["patch_size"] * processor["merge_size"]  # pixels per token, each way
    largest = processor["size"]["longest_edge"] // side**2  # over the budget of 8
    assert profile.prefill_tokens == 48
    assert profile.image_tokens == largest == largest_encoder_call(config)
    assert len(rows) == 1 and largest - math.isqrt(largest) < rows[0] <= largest
    assert profile.total_bytes == 0


def test_start_up_sizes_read_in_mib_below_a_gib():
    """A small KV cache (a test's, a CPU's) reads as MiB, not "0.00 GiB"."""
    assert readable_bytes(8 << 20) == "8.00 MiB"
    assert readable_bytes(1.5 * GiB) == "1.50 GiB"
