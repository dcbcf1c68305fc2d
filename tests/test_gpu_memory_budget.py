"""The KV cache's share of a GPU (`cuda_kv_budget`), from the numbers CUDA reports: the
arithmetic runs anywhere, so it is tested here without a GPU."""

from __future__ import annotations

import pytest

from iris_serve.scheduler.device_state import ACTIVATION_RESERVE_BYTES, cuda_kv_budget

GiB = 2**30
TOTAL = 80 * GiB
CONTEXT = GiB // 2  # the CUDA context: used on the device, not held by torch


def test_two_servers_at_045_share_one_gpu_and_get_the_same_kv_cache():
    weights, cache = 16 * GiB, 1 * GiB
    first = cuda_kv_budget(TOTAL, TOTAL - CONTEXT - weights, weights, 0.45, cache)
    used_by_first = CONTEXT + weights + first + cache + ACTIVATION_RESERVE_BYTES
    free = TOTAL - used_by_first - CONTEXT - weights  # the second server has loaded its model
    second = cuda_kv_budget(TOTAL, free, weights, 0.45, cache)
    assert first == second == int(0.45 * TOTAL) - weights - cache - ACTIVATION_RESERVE_BYTES
    assert used_by_first * 2 <= TOTAL


def test_the_kv_cache_never_takes_more_than_is_free():
    others = 60 * GiB  # another program on the GPU
    weights = 4 * GiB
    free = TOTAL - others - CONTEXT - weights
    budget = cuda_kv_budget(TOTAL, free, weights, 0.9, 0)
    assert budget == free - ACTIVATION_RESERVE_BYTES


def test_the_embedding_cache_is_counted_in_the_share():
    weights = 16 * GiB
    free = TOTAL - CONTEXT - weights
    with_cache = cuda_kv_budget(TOTAL, free, weights, 0.9, 4 * GiB)
    without = cuda_kv_budget(TOTAL, free, weights, 0.9, 0)
    assert without - with_cache == 4 * GiB


def test_a_share_smaller_than_the_model_is_refused_naming_the_flags():
    weights = 16 * GiB
    with pytest.raises(
        ValueError, match=r"--gpu-memory-utilization 0\.2 .*--mm-embedding-cache-gb"
    ):
        cuda_kv_budget(TOTAL, TOTAL - CONTEXT - weights, weights, 0.2, GiB)
