"""M-RoPE positions of a video, laid out patch by patch (`models/mrope.py`), against
transformers' `get_rope_index`.

Qwen2-VL and Qwen2.5-VL give a video one block: its patches' positions equal
transformers' exactly, the temporal axis at `int(patch * tokens_per_second *
second_per_grid_t)` for Qwen2.5-VL. The text after the video resumes one past the block's
largest position, the models' own rule (and vLLM's); transformers 5.24 resumes at
`max(h', w')` past the block's start instead, ignoring how far time went, so the two
differ there and this test pins ours. Qwen3-VL splits a video into blocks of one patch,
separated by timestamp text: those equal transformers' whole.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from iris_serve.scheduler.models.mrope import mrope_positions

VIDEO, TEXT = 2, 0  # transformers' mm_token_type_ids
GRID = (4, 6)  # one patch's h, w in patches: 2 x 3 tokens after merging
PER_PATCH = 6


def reference(model_class, config, token_types: list[int], **grids) -> torch.Tensor:
    """transformers' positions `[3, N]` for a prompt of those token types."""
    model = SimpleNamespace(config=config)  # all `get_rope_index` reads of its model
    model.get_vision_position_ids = partial(model_class.get_vision_position_ids, model)
    types = torch.tensor([token_types])
    positions, _ = model_class.get_rope_index(model, torch.zeros_like(types), types, **grids)
    return positions[:, 0]


def test_a_qwen2_5_vl_video_is_one_block_at_scaled_times_and_text_resumes_past_it():
    config = Qwen2_5_VLConfig(vision_config={"tokens_per_second": 2, "spatial_merge_size": 2})
    second_per_grid = 2 / 1.5  # two frames per patch, sampled at 1.5 fps
    times = [int(j * 2 * second_per_grid) for j in range(3)]
    assert times == [0, 2, 5]
    types = [TEXT] * 3 + [VIDEO] * 3 * PER_PATCH + [TEXT] * 4
    spans = [(3 + j * PER_PATCH, PER_PATCH) for j in range(3)]
    blocks = [(time, j > 0) for j, time in enumerate(times)]
    ours, delta = mrope_positions(len(types), spans, [(1, *GRID)] * 3, 2, blocks)
    theirs = reference(
        Qwen2_5_VLModel,
        config,
        types,
        video_grid_thw=torch.tensor([[3, *GRID]]),
        second_per_grid_ts=torch.tensor([second_per_grid]),
    )
    video_end = 3 + 3 * PER_PATCH
    assert torch.equal(ours[:, :video_end], theirs[:, :video_end])
    # the block starts at 3 and its largest position is 3 + 5 (time): text resumes at 9
    assert ours[:, video_end:].tolist() == [[9, 10, 11, 12]] * 3
    assert theirs[0, video_end].item() == 3 + max(GRID) // 2  # transformers 5.24's rule
    assert delta == 13 - len(types)


def test_qwen3_vl_patches_are_blocks_of_their_own_between_timestamps():
    config = Qwen3VLConfig(vision_config={"spatial_merge_size": 2})
    timestamp = 4  # tokens of "<0.5 seconds>" and the patch's vision start, say
    types = []
    spans = []
    for _ in range(3):
        types += [TEXT] * timestamp
        spans.append((len(types), PER_PATCH))
        types += [VIDEO] * PER_PATCH
    types += [TEXT] * 2
    ours, _ = mrope_positions(len(types), spans, [(1, *GRID)] * 3, 2)
    theirs = reference(Qwen3VLModel, config, types, video_grid_thw=torch.tensor([[3, *GRID]]))
    assert torch.equal(ours, theirs)
