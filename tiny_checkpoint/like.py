"""Real-size random checkpoints: `iris tiny-model --like Qwen2.5-VL-7B-Instruct`.

The config.json is the published one (`known_configs.KNOWN_CONFIGS`), the weights random
and streamed to shards (`shards.py`), the tokenizer, chat template and image processor
the tiny checkpoint's, with the vocabulary padded so that the special tokens sit at
Qwen's real ids, the ids the config names.

Tensor names and shapes come from transformers' own model class built on the meta device,
in the hub's layout (Qwen2/2.5-VL: renamed to `model.layers.*`, `visual.*`; Qwen3-VL and
Qwen3.5 keep `model.language_model.*`; Qwen3-VL-MoE's fused experts transposed to the
hub's `[E, H, 2I]` and `[E, I, H]`; Qwen3.5-MoE's split into one `experts.{e}.*_proj`
per expert, as its hub files and transformers' `save_pretrained` have them), so
transformers and Iris's loader read the files exactly as they read a downloaded
checkpoint. `num_layers` / `vision_depth` shrink the depth for quick checks (the stamp
file then says `"exact": false`).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import row_of
from .known_configs import KNOWN_CONFIGS
from .shards import TensorSpec, write_sharded

LIKE_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_MAX_SHARD_SIZE = "4GB"
# Every matrix is N(0, (INIT_GAIN / sqrt(fan_in))^2), so each linear keeps the scale of its
# input times 1.6; this is `configs.SHAPES[...].init_std * sqrt(hidden)` of the tiny models
# (varied greedy text, moderate activations), applied per tensor. Norms are at identity,
# biases 0 (`_constant_init`).
INIT_GAIN = 1.6
# transformers' in-memory names -> the hub's checkpoint names (what save_pretrained writes)
_HUB_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
# How the hub files of each kind of experts (an architecture's `experts`) hold what
# transformers fuses into `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I].
_EXPERT_LAYOUTS = {"routed": "fused_transposed", "routed_shared": "per_expert"}
# Norms that scale by (1 + w) rather than w, so that transformers starts w at 0: Qwen3.5's
# decoder RMSNorms. Its gated norm after linear attention (`Qwen3_5RMSNormGated`) scales by w.
_ZERO_CENTRED_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")


def resolve_name(name: str) -> str:
    """The table's key for `name`: `Qwen/` prefix and `-Instruct` suffix optional, any case."""
    wanted = name.strip().lower().removeprefix("qwen/").removesuffix("-instruct")
    for known in KNOWN_CONFIGS:
        if known.lower().removesuffix("-instruct") == wanted:
            return known
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(KNOWN_CONFIGS)}")


def like_config(
    name: str,
    dtype: str = "bfloat16",
    num_layers: int | None = None,
    vision_depth: int | None = None,
) -> dict[str, Any]:
    """The config.json of `name` (hub layout), with `torch_dtype` set to `dtype` and, when
    asked, fewer text layers / vision blocks (layer kinds, full-attention and DeepStack
    blocks past the new depth drop)."""
    if dtype not in LIKE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {LIKE_DTYPES}")
    config = copy.deepcopy(KNOWN_CONFIGS[resolve_name(name)])
    config["torch_dtype"] = dtype
    text = text_config(config)
    if "dtype" in text:
        text["dtype"] = dtype
    if num_layers is not None:
        text["num_hidden_layers"] = _depth(num_layers, text["num_hidden_layers"], "layers")
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:num_layers]
    vision = config["vision_config"]
    if vision_depth is not None:
        vision["depth"] = _depth(vision_depth, vision["depth"], "vision blocks")
        for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            if key in vision:
                vision[key] = [i for i in vision[key] if i < vision["depth"]]
    if "deepstack_visual_indexes" in vision:  # one DeepStack level per decoder layer at most
        vision["deepstack_visual_indexes"] = vision["deepstack_visual_indexes"][
            : text["num_hidden_layers"]
        ]
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the text keys: `text_config` (nested layout) or the config itself."""
    return config["text_config"] if row_of(config["model_type"]).hub_nested else config


def _depth(value: int, full: int, what: str) -> int:
    if not 1 <= value <= full:
        raise ValueError(f"{what} must be between 1 and {full}, got {value}")
    return value


def generate_like_checkpoint(
    name: str,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    seed: int = 0,
    num_layers: int | None = None,
    vision_depth: int | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    progress: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> Path:
    """Writes a random-weight checkpoint with `name`'s config into `out_dir`; see the module."""
    import torch
    from transformers import GenerationConfig
    from transformers.utils.hub import convert_file_size_to_int

    from . import GENERATOR_VERSION, STAMP_FILE
    from .processor import save_image_processor, save_video_processor
    from .tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, build_tokenizer, token_id

    config = like_config(name, dtype, num_layers, vision_depth)
    model_type = config["model_type"]
    row = row_of(model_type)
    first_special_id = row.first_special_token_id
    max_shard_bytes = convert_file_size_to_int(max_shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model-*-of-*.safetensors"), *out.glob("model.safetensors*")]:
        stale.unlink()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    def special(token: str) -> int:
        return token_id(token, first_special_id)

    # The ids config.json names must be the tokenizer's; fails loudly if the table drifts.
    # Qwen3.5's text_config ends text with <|endoftext|>, not <|im_end|>, and names no BOS.
    text = text_config(config)
    for key, tokens in [
        ("image_token_id", ("<|image_pad|>",)),
        ("video_token_id", ("<|video_pad|>",)),
        ("vision_start_token_id", ("<|vision_start|>",)),
        ("vision_end_token_id", ("<|vision_end|>",)),
        ("eos_token_id", (EOS_TOKEN, PAD_TOKEN)),
        ("bos_token_id", (BOS_TOKEN, None)),
    ]:
        value = config.get(key, text.get(key))
        if value not in [special(token) if token else None for token in tokens]:
            raise RuntimeError(f"{key} {value} is not the tokenizer's id of any of {tokens}")
    # As the tiny checkpoints: Qwen's EOS ids, none of the hub's sampling defaults (greedy).
    GenerationConfig(
        bos_token_id=special(BOS_TOKEN),
        eos_token_id=[special(EOS_TOKEN), special(PAD_TOKEN)],
        pad_token_id=special(PAD_TOKEN),
    ).save_pretrained(out)
    build_tokenizer(row.processor, first_special_id=first_special_id).save_pretrained(out)
    save_image_processor(out, model_type, published=True)
    save_video_processor(out, model_type, published=True)

    specs = tensor_specs(out)
    write_sharded(specs, out, getattr(torch, dtype), seed, max_shard_bytes, progress, device)
    stamp = {
        "like": resolve_name(name),
        "exact": num_layers is None and vision_depth is None,
        "num_layers": text["num_hidden_layers"],
        "vision_depth": config["vision_config"]["depth"],
        "seed": seed,
        "device": device,
        "dtype": dtype,
        "max_shard_size": max_shard_size,
        "init_gain": INIT_GAIN,
        "generator_version": GENERATOR_VERSION,
    }
    (out / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
    return out


def tensor_specs(model_dir: Path) -> list[TensorSpec]:
    """Every tensor a hub checkpoint with `model_dir`'s config.json holds, hub-named, with its
    init: transformers' model built on the meta device (no memory) says names and shapes.
    Qwen3.5's multi-token-prediction layer (`mtp.*`) is left out: transformers has no
    module for it, and vLLM reads it only for speculative decoding."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    tied = bool(config.tie_word_embeddings)
    row = row_of(config.model_type)
    nested = row.hub_nested
    zero_centred = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if type(module).__name__ in _ZERO_CENTRED_NORMS
    }
    specs = []
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # hub checkpoints of tied models store the embedding once
        shape = tuple(tensor.shape)
        hub_name = name if nested else _hub_name(name)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert row.experts is not None  # transformers built experts for it
            specs += _expert_specs(hub_name, shape, _EXPERT_LAYOUTS[row.experts])
        elif name in zero_centred:
            specs.append(TensorSpec(hub_name, shape, "zeros"))
        else:
            specs.append(_spec(hub_name, shape))
    return specs


def _expert_specs(name: str, shape: tuple[int, ...], layout: str) -> list[TensorSpec]:
    """The hub's tensors for transformers' fused `experts.gate_up_proj` ([E, 2I, H], gate
    rows first) or `experts.down_proj` ([E, H, I]): transposed to [E, in, out] as one tensor
    (`fused_transposed`), or one [out, in] matrix per expert and projection (`per_expert`)."""
    experts, rows, columns = shape
    if layout == "fused_transposed":
        return [_spec(name, (experts, columns, rows), fan_in=columns)]
    prefix = name.removesuffix("gate_up_proj").removesuffix("down_proj")
    if name.endswith("down_proj"):
        parts = [("down_proj", rows)]
    else:
        parts = [("gate_proj", rows // 2), ("up_proj", rows // 2)]
    return [
        _spec(f"{prefix}{e}.{part}.weight", (part_rows, columns))
        for e in range(experts)
        for part, part_rows in parts
    ]


def _hub_name(name: str) -> str:
    for old, new in _HUB_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _spec(name: str, shape: tuple[int, ...], fan_in: int | None = None) -> TensorSpec:
    if len(shape) == 1:
        return TensorSpec(name, shape, _constant_init(name))
    fan_in = fan_in or math.prod(shape[1:])
    return TensorSpec(name, shape, "normal", INIT_GAIN / math.sqrt(fan_in))


def _constant_init(name: str) -> str:
    """A vector's fill: biases 0, norm scales and Gated DeltaNet's `dt_bias` 1 (as
    transformers starts them), its `A_log` 0: a decay rate A of 1, within the range
    transformers draws A from, the same for every head."""
    return "zeros" if name.endswith((".bias", ".A_log")) else "ones"
