"""The tokenizer worker's prompt building equals transformers' own processor."""

from __future__ import annotations

import pytest
import torch

from iris_serve.scheduler.encoder.patches import PatchMaker
from iris_serve.tiny_checkpoint import reference_processor
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import make_image


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_token_ids_pixels_and_spans_match_the_hf_processor(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    builder = PromptBuilder(model_dir)
    images = [
        make_image(333, 517, "RGB", 1),
        make_image(40, 30, "L", 2),
        make_image(90, 64, "P", 3),
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First:"},
                {"type": "image"},
                {"type": "text", "text": "then two more"},
                {"type": "image"},
                {"type": "image"},
            ],
        },
    ]
    text = builder.render_chat(messages)
    prompt = builder.build(text, images)

    reference = reference_processor(model_dir)
    expected = reference(text=[text], images=images, return_tensors="pt")
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    # the uint8 pixels, made into rows as the scheduler makes them: the processor's, exactly
    patches = PatchMaker.from_checkpoint(model_dir, torch.device("cpu"), torch.float32)
    grids = [image.grid_thw for image in prompt.images]
    assert torch.equal(patches(prompt.pixels, grids), expected["pixel_values"])
    assert [image.grid_thw for image in prompt.images] == [
        tuple(g) for g in expected["image_grid_thw"].tolist()
    ]
    image_token = builder.image_token_id
    for image in prompt.images:
        span = prompt.token_ids[image.offset : image.end]
        assert span == [image_token] * image.length
        assert prompt.token_ids[image.offset - 1] != image_token
    assert sum(image.length for image in prompt.images) == prompt.token_ids.count(image_token)


def test_image_keys_differ_by_content_and_repeat_for_the_same_image(qwen2_vl_tiny):
    builder = PromptBuilder(qwen2_vl_tiny)
    text = builder.render_chat([{"role": "user", "content": [{"type": "image"}] * 3}])
    a, b = make_image(64, 64, seed=1), make_image(64, 64, seed=2)
    prompt = builder.build(text, [a, b, a])
    keys = [image.key for image in prompt.images]
    assert len(keys[0]) == 16  # full 128-bit keys, never truncated
    assert keys[0] == keys[2] != keys[1]


def test_placeholder_count_must_match_the_images(qwen2_vl_tiny):
    builder = PromptBuilder(qwen2_vl_tiny)
    text = builder.render_chat([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        builder.build(text, [make_image(30, 30), make_image(30, 30)])


def test_a_chat_template_replaces_the_checkpoints(qwen2_vl_tiny):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    custom = PromptBuilder(qwen2_vl_tiny, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    assert custom.render_chat(messages) == "<<hi>>"
    assert PromptBuilder(qwen2_vl_tiny).render_chat(messages) != "<<hi>>"
