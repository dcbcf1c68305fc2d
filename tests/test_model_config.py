"""`VLModelConfig` reads the hub's flat config.json and transformers-5's nested one alike."""

from __future__ import annotations

import json

import pytest

from iris_serve.scheduler.models.config import VLModelConfig

# Shapes of the real hub files (Qwen/Qwen2-VL-2B-Instruct, Qwen/Qwen2.5-VL-3B-Instruct).
QWEN2_VL_2B = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2_vl",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 1536,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}

QWEN2_5_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}


def test_hub_flat_qwen2_vl_2b():
    c = VLModelConfig.from_dict(QWEN2_VL_2B)
    assert c.architecture == "Qwen2VLForConditionalGeneration"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (151936, 1536, 8960)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (28, 12, 2, 128)
    assert c.rms_norm_eps == 1e-6 and c.rope_theta == 1e6
    assert c.mrope_section == (16, 24, 24)
    assert c.tie_word_embeddings
    assert c.eos_token_ids == (151645,) and c.dtype == "bfloat16"
    assert (c.image_token_id, c.vision_start_token_id, c.vision_end_token_id) == (
        151655,
        151652,
        151653,
    )
    v = c.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.head_dim) == (32, 1280, 16, 80)
    assert (v.intermediate_size, v.out_hidden_size, v.hidden_act) == (5120, 1536, "quick_gelu")
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size) == (14, 2, 2)
    assert v.in_channels == 3 and v.patch_dim == 1176
    assert v.window_size == 0 and v.fullatt_block_indexes == ()


def test_hub_flat_qwen2_5_vl_3b():
    c = VLModelConfig.from_dict(QWEN2_5_VL_3B)
    assert c.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (2048, 36, 16, 2)
    assert c.head_dim == 128 and c.max_position_embeddings == 128000
    v = c.vision
    assert (v.depth, v.hidden_size, v.intermediate_size, v.out_hidden_size) == (
        32,
        1280,
        3420,
        2048,
    )
    assert v.hidden_act == "silu" and v.window_size == 112
    assert v.fullatt_block_indexes == (7, 15, 23, 31) and v.tokens_per_second == 2


@pytest.mark.parametrize("raw", [QWEN2_VL_2B, QWEN2_5_VL_3B], ids=["qwen2_vl", "qwen2_5_vl"])
def test_transformers_reads_the_same_numbers(raw):
    """Our reading of a flat file agrees with transformers' own, and with the nested file
    transformers writes back from it."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**raw)
    ours = VLModelConfig.from_dict(raw)
    nested = VLModelConfig.from_dict(json.loads(hf.to_json_string()))
    assert "text_config" in json.loads(hf.to_json_string())
    t, v = hf.text_config, hf.vision_config
    assert ours.hidden_size == t.hidden_size and ours.vocab_size == t.vocab_size
    assert ours.num_kv_heads == t.num_key_value_heads and ours.num_layers == t.num_hidden_layers
    assert list(ours.mrope_section) == t.rope_parameters["mrope_section"]
    assert ours.rope_theta == t.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.vision.depth == v.depth and ours.vision.num_heads == v.num_heads
    assert ours.vision.rope_theta == v.rope_parameters["rope_theta"]
    for field in ("architecture", "hidden_size", "mrope_section", "rope_theta", "vision"):
        assert getattr(nested, field) == getattr(ours, field), field
    assert nested.tie_word_embeddings == ours.tie_word_embeddings


def test_eos_ids_follow_generate_generation_config_first(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_VL_2B))
    assert VLModelConfig.from_pretrained(tmp_path).eos_token_ids == (151645,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert VLModelConfig.from_pretrained(tmp_path).eos_token_ids == (151645, 151643)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
    assert VLModelConfig.from_pretrained(tmp_path).eos_token_ids == (151643,)  # not merged
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert VLModelConfig.from_pretrained(tmp_path).eos_token_ids == (151645,)


def test_tie_word_embeddings_inside_text_config_is_honoured():
    raw = {"architectures": ["Qwen2VLForConditionalGeneration"], "text_config": {}}
    raw["text_config"] = {k: v for k, v in QWEN2_VL_2B.items() if k != "tie_word_embeddings"}
    raw["text_config"]["tie_word_embeddings"] = True
    raw["vision_config"] = QWEN2_VL_2B["vision_config"]
    assert VLModelConfig.from_dict(raw).tie_word_embeddings


def test_bad_mrope_section_and_rope_type_fail():
    with pytest.raises(ValueError, match="mrope_section"):
        VLModelConfig.from_dict(QWEN2_VL_2B | {"rope_scaling": {"mrope_section": [16, 24, 16]}})
    with pytest.raises(NotImplementedError, match="yarn"):
        VLModelConfig.from_dict(QWEN2_VL_2B | {"rope_scaling": {"type": "yarn", "factor": 4}})
