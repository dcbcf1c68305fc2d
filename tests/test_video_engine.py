"""A video through the engine, as the worker hands it over: one item per temporal patch
of two frames (`ipc.ImageRef`, `frames=2`), each with its own key and pixels. Greedy fp32
against transformers: Qwen3-VL and Qwen3.5 (a video is blocks of one patch between
timestamps) token for token through `generate`, at chunk budgets that cut the patches;
Qwen2.5-VL (one block at scaled times) on the logits of a forward given Iris's positions,
since transformers 5.24 places the text after a video elsewhere
(tests/test_video_positions.py). A second question about the video encodes no patch."""

from __future__ import annotations

import msgspec
import pytest
import torch
import xxhash

from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import ImageRef, Prompt, Sampling
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import (
    chat_prompt,
    cpu_engine,
    hf_generate,
    hf_model,
    hf_video_block_logits,
    make_image,
)

torch.set_num_threads(2)
MAX_NEW = 8
GREEDY = Sampling(temperature=0.0, max_tokens=MAX_NEW)
NUM_PATCHES = 3
GRID = (1, 4, 6)  # per temporal patch: 2 x 3 tokens after merging


def frames(builder: PromptBuilder, seed: int) -> list[torch.Tensor]:
    """`NUM_PATCHES` temporal patches of two different frames each, uint8 `[2, H, W, 3]`."""
    patch = builder.image_processor.patch_size
    shape = (2, GRID[1] * patch, GRID[2] * patch, 3)
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        for _ in range(NUM_PATCHES)
    ]


def video_prompt(
    builder: PromptBuilder, question: str, pixels: list[torch.Tensor], one_block: bool
) -> PromptInput:
    """A chat turn holding the video then `question`: Qwen2/2.5-VL's one block of pads, or
    Qwen3-VL's blocks of one patch each after its timestamp."""
    encode = builder.encode
    config = hf_model(str(builder.model_dir)).config
    per_patch = GRID[1] * GRID[2] // 4
    tokens = encode("<|im_start|>user\n")
    images = []

    def patch(index: int, rope_time: int, continues: bool) -> None:
        key = xxhash.xxh3_128_digest(pixels[index].numpy().tobytes())
        images.append(
            ImageRef(key, len(tokens), per_patch, GRID, None, False, 2, rope_time, continues)
        )
        tokens.extend([config.video_token_id] * per_patch)

    if one_block:
        tokens.append(config.vision_start_token_id)
        for index in range(NUM_PATCHES):
            patch(index, 2 * index, index > 0)
        tokens.append(config.vision_end_token_id)
    else:
        for index in range(NUM_PATCHES):
            tokens.extend(encode(f"<{index + 0.5:.1f} seconds>"))
            tokens.append(config.vision_start_token_id)
            patch(index, 0, False)
            tokens.append(config.vision_end_token_id)
    tokens.extend(encode(f"{question}<|im_end|>\n<|im_start|>assistant\n"))
    return PromptInput(Prompt(tokens, images), list(pixels))


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def blocks_dir(request, tiny_checkpoint) -> str:
    return str(tiny_checkpoint(request.param))


@pytest.mark.parametrize("budget", [16, 2048])
def test_a_video_of_timestamped_patches_gives_transformers_tokens(blocks_dir, budget):
    builder = PromptBuilder(blocks_dir)
    prompt = video_prompt(builder, "What happens?", frames(builder, seed=1), one_block=False)
    iris = cpu_engine(blocks_dir, max_num_batched_tokens=budget)
    assert iris.generate([prompt], GREEDY) == [hf_generate(blocks_dir, prompt, MAX_NEW)]


def test_an_image_then_a_video_give_transformers_tokens(qwen3_vl_tiny):
    builder = PromptBuilder(qwen3_vl_tiny)
    video = video_prompt(builder, "Same place?", frames(builder, seed=4), one_block=False)
    image = chat_prompt(builder, "", [make_image(64, 48, seed=5)])
    shift = len(image.token_ids)
    moved = [msgspec.structs.replace(i, offset=i.offset + shift) for i in video.images]
    prompt = PromptInput(
        Prompt(image.token_ids + video.token_ids, image.images + moved),
        [*image.pixels, *video.pixels],
    )
    iris = cpu_engine(qwen3_vl_tiny, max_num_batched_tokens=32)
    assert iris.generate([prompt], GREEDY) == [hf_generate(qwen3_vl_tiny, prompt, MAX_NEW)]


def test_a_second_question_about_the_video_encodes_no_patch(qwen3_vl_tiny):
    builder = PromptBuilder(qwen3_vl_tiny)
    pixels = frames(builder, seed=2)
    iris = cpu_engine(qwen3_vl_tiny, page_size=4)
    first = video_prompt(builder, "What happens?", pixels, one_block=False)
    iris.generate([first], GREEDY)
    assert iris.stats().images_encoded == NUM_PATCHES
    second = video_prompt(builder, "And then, in the end?", pixels, one_block=False)
    [tokens] = iris.generate([second], GREEDY)
    assert iris.stats().images_encoded == NUM_PATCHES  # every patch from the caches
    assert iris.stats().prefix_cache_hit_tokens >= second.images[-1].end // 4 * 4
    assert tokens == hf_generate(qwen3_vl_tiny, second, MAX_NEW)


def test_a_qwen2_5_vl_video_block_gives_transformers_logits_at_iris_positions(qwen2_5_vl_tiny):
    model_dir = str(qwen2_5_vl_tiny)
    builder = PromptBuilder(model_dir)
    prompt = video_prompt(builder, "What happens?", frames(builder, seed=3), one_block=True)
    iris = cpu_engine(model_dir, max_num_batched_tokens=16)  # chunks cut the patches
    iris.add_request("video", prompt, msgspec.structs.replace(GREEDY, max_tokens=1, logprobs=1))
    [output] = list(iris.run_until_idle())
    logits = hf_video_block_logits(model_dir, prompt)
    assert output.new_token_ids == [int(logits.argmax())]
    assert output.logprobs is not None
    top = output.logprobs[0]
    expected = torch.log_softmax(logits.float(), -1)[top.token_id]
    assert abs(top.logprob - float(expected)) < 1e-4
