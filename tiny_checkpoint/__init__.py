"""Deterministic random-weight Qwen2-VL / 2.5-VL / 3-VL / 3.5 checkpoints in the Hugging Face
layout (`docs/design.md`, "Models without a hub"). Every file is written by transformers itself
except `iris_tiny_checkpoint.json`, a stamp of the arguments; only the sizes, the
tokenizer's vocabulary and the init std are ours.

Sizes (see `configs.SHAPES`): `tiny` (text 64 wide x 2 layers, 4 heads / 2 KV heads,
head_dim 16, ViT 32 wide x 3 blocks; 0.3-0.4M parameters) and `small` (text 512 x 8 layers,
4 / 2 heads of 128, ViT 320 x 8 blocks; ~40M). Vocabulary: 1536 (1522 BPE + 14 specials).
Qwen2-VL and Qwen3-VL checkpoints tie lm_head to the input embeddings; Qwen2.5-VL ones do
not. Qwen3-VL ones have 2 (tiny) or 3 (small) DeepStack levels; Qwen3-VL-MoE ones are
Qwen3-VL with routed experts (tiny: 8 experts, top-2, in layer 0 of 2; small: 16, top-4,
in every layer) and an untied lm_head. Qwen3.5 ones (`qwen3_5`, `qwen3_5_moe`) have Qwen3-VL's
ViT without DeepStack and a hybrid decoder (tiny: 4 layers, linear and full attention
alternating; small: 8, every 4th full, as the real models), untied; Qwen3.5-MoE routes
every layer and adds a shared expert. Real-size checkpoints (`--like`) are `like.py`'s.

Heavy imports (torch, transformers) happen inside the functions, so importing this package
for its CLI entry point is cheap.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.architectures import Architecture, by_model_type, model_types

if TYPE_CHECKING:
    from transformers import ProcessorMixin

__all__ = [
    "ARCHS",
    "DTYPES",
    "SIZES",
    "builtin_checkpoint",
    "generate_checkpoint",
    "main_tiny_model",
    "reference_processor",
]

ARCHS = model_types()  # `--arch`: the `model_type` of each row of common/architectures.py
SIZES = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")
# Bump when the generator's output changes, so `builtin_checkpoint` rebuilds stale caches.
GENERATOR_VERSION = 3
STAMP_FILE = "iris_tiny_checkpoint.json"


def generate_checkpoint(
    arch: str,
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
) -> Path:
    """Write a random-weight checkpoint of `arch` (one of `ARCHS`) into `out_dir`.

    Same arguments give byte-identical files (for given library versions). Weights are drawn
    in float32 under `torch.manual_seed(seed)`, then cast to `dtype`. `max_shard_size`
    (e.g. "200KB") writes shards plus model.safetensors.index.json, as hub repos do."""
    import torch
    from transformers import GenerationConfig

    from .configs import build_config
    from .processor import save_image_processor, save_video_processor
    from .tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, build_tokenizer, token_id

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    config = build_config(arch, size)  # validates arch and size
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    model_cls = _model_class(arch)
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            model = model_cls(config)
        finally:
            torch.set_default_dtype(previous_dtype)
    model.to(getattr(torch, dtype))
    # Token ids as in Qwen2-VL-Instruct's generation_config.json, but none of its sampling
    # defaults (do_sample, top_k=1, ...): a plain `generate` is greedy, as parity tests want.
    model.generation_config = GenerationConfig(
        bos_token_id=token_id(BOS_TOKEN),
        eos_token_id=[token_id(EOS_TOKEN), token_id(PAD_TOKEN)],
        pad_token_id=token_id(PAD_TOKEN),
    )
    # save_pretrained leaves a previous run's model.safetensors / index behind, and a loader
    # would then read the stale layout; start the weights from a clean slate.
    for stale in [*out.glob("model-*-of-*.safetensors"), *out.glob("model.safetensors*")]:
        stale.unlink()
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save_kwargs)

    build_tokenizer(row_of(arch).processor).save_pretrained(out)
    save_image_processor(out, arch)
    save_video_processor(out, arch)
    stamp = {
        "arch": arch,
        "size": size,
        "seed": seed,
        "dtype": dtype,
        "max_shard_size": max_shard_size,
        "generator_version": GENERATOR_VERSION,
    }
    (out / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
    return out


def _model_class(arch: str) -> type:
    """transformers' model class of `arch`: the one its row names."""
    import transformers

    return getattr(transformers, row_of(arch).name)


def row_of(arch: str) -> Architecture:
    """The row of common/architectures.py whose `model_type` is `arch`; ValueError if none."""
    row = by_model_type(arch)
    if row is None:
        raise ValueError(f"unknown arch {arch!r}; expected one of {model_types()}")
    return row


def cache_root() -> Path:
    """Folder of the built-in checkpoints: `$IRIS_CACHE_DIR/models` or `~/.cache/iris/models`."""
    base = os.environ.get("IRIS_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "iris") / "models"


def builtin_checkpoint(
    arch: str = "qwen2_5_vl", size: str = "tiny", progress: Callable[[str], None] | None = None
) -> Path:
    """Path of the seed-0 fp32 checkpoint of `arch`/`size`, generated on first use;
    `progress` hears where and how long when it is generated (nothing when it is cached).

    Generation goes to a temporary folder renamed into place, so a crash never leaves a
    half-written checkpoint and concurrent callers (pytest-xdist workers) each end up with a
    complete one. A cache written by an older generator version is replaced."""
    root = cache_root()
    target = root / f"{arch}-{size}-seed0"
    expected = {"arch": arch, "size": size, "seed": 0, "dtype": "float32"}
    if _stamp_matches(target, expected):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    say = progress or (lambda line: None)
    say(f"generating the built-in checkpoint into {target} (once; $IRIS_CACHE_DIR moves it)")
    started = time.monotonic()
    try:
        generate_checkpoint(arch, tmp, size=size, seed=0)
        if target.exists() and not _stamp_matches(target, expected):
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=root))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _stamp_matches(target, expected):  # lost a race to a valid checkpoint?
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"generated {target.name} in {time.monotonic() - started:.1f} s")
    return target


def _stamp_matches(path: Path, expected: dict[str, object]) -> bool:
    try:
        stamp = json.loads((path / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    wanted = {**expected, "generator_version": GENERATOR_VERSION}
    return all(stamp.get(k) == v for k, v in wanted.items())


def reference_processor(model_dir: str | Path) -> ProcessorMixin:
    """transformers' processor for `model_dir`, without video (`processor.reference_processor`)."""
    from .processor import reference_processor as _reference_processor

    return _reference_processor(model_dir)


def main_tiny_model(argv: list[str] | None = None) -> int:
    """`iris tiny-model`: write a random-weight checkpoint; prints its path."""
    from .cli import main

    return main(argv)
