"""Quantized checkpoints from a full-precision one, and their dequantized twins: what the
per-format writers (`fp8`, `awq`) share.

Which tensors a release stores quantized is the same for every format here: each decoder
layer's 2-D projection weight and each MoE expert's, per expert (as Qwen's FP8 MoE
releases and the community's 4-bit ones store them: `experts`); the vision tower,
embeddings, norms, `lm_head`, MoE routers and Gated DeltaNet's `in_proj_a`/`in_proj_b`
stay in full precision, as Qwen's releases keep them. A twin (`write_dequantized`) holds
float32 weights equal to what the quantized checkpoint stores, without
`quantization_config`, its experts fused again where transformers reads them fused:
transformers on the twin is the reference a parity test compares Iris on the quantized
checkpoint with.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.architectures import by_model_type
from . import experts

if TYPE_CHECKING:
    import torch

Tensors = dict[str, "torch.Tensor"]
Change = Callable[[str, "torch.Tensor"], Tensors]
KEPT_DENSE = ("visual", ".experts.", "mlp.gate.", "shared_expert_gate", "in_proj_a", "in_proj_b")
INDEX_FILE = "model.safetensors.index.json"


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a release stores tensor `name` quantized: a decoder layer's 2-D projection
    weight, not one of `KEPT_DENSE`."""
    return (
        len(shape) == 2
        and ".layers." in name
        and name.endswith("proj.weight")
        and not any(kept in name for kept in KEPT_DENSE)
    )


def write_quantized(
    src: str | Path,
    out: str | Path,
    quantize: Callable[[str, torch.Tensor], Tensors],
    config: dict[str, object],
    stamp: str,
    skip_list: str = "modules_to_not_convert",
) -> Path:
    """`src` with every weight `is_quantized` picks and every MoE expert's projection (per
    expert, `experts.split`) replaced by `quantize(name, weight)`'s tensors, `config` as its
    `quantization_config` (with the `modules_to_not_convert` of the linear layers kept
    dense, under the format's `skip_list` key), and `stamp` in the generator's stamp."""
    dense: list[str] = []
    text = _text_config(Path(src))
    hidden, intermediate = text["hidden_size"], text.get("moe_intermediate_size")

    def change(name: str, tensor: torch.Tensor) -> Tensors:
        if intermediate is not None and experts.is_expert_weight(name):
            pieces = experts.split(name, tensor, hidden, intermediate).items()
            return {k: v for piece, weight in pieces for k, v in quantize(piece, weight).items()}
        if is_quantized(name, tuple(tensor.shape)):
            return quantize(name, tensor)
        if tensor.dim() == 2 and name.endswith(".weight") and "embed" not in name:
            dense.append(name.removesuffix(".weight"))
        return {name: tensor}

    out = rewrite(src, out, change)
    edit_config(
        out,
        lambda c: c | {"quantization_config": {**config, skip_list: sorted(dense)}},
    )
    add_to_stamp(out, stamp)
    return out


def write_dequantized(
    src: str | Path, out: str | Path, restore: Callable[[Tensors], Tensors]
) -> Path:
    """The float32 twin of the quantized checkpoint in `src`: `restore(tensors)` maps the
    tensors to full-precision ones; per-expert weights are fused where the architecture's
    hub files hold them fused (its row's `experts`), as transformers reads them."""
    from safetensors.torch import load_file

    src, out = Path(src), _copy_files(src, out)
    everything: Tensors = {}
    files: dict[str, str] = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors = load_file(path)
        everything |= tensors
        files |= dict.fromkeys(tensors, path.name)
    restored = restore(everything)
    row = by_model_type(json.loads((src / "config.json").read_text())["model_type"])
    if row is not None and row.experts == "routed":
        restored = experts.fuse(restored)
    _save(out, restored, {name: files[_source(name, files)] for name in restored})
    edit_config(out, lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    add_to_stamp(out, "dequantized")
    return out


def rewrite(src: str | Path, out: str | Path, change: Change) -> Path:
    """`src` copied to `out`, every tensor passed through `change(name, tensor)` (the tensors
    it returns are written), one safetensors file per source file."""
    from safetensors.torch import load_file

    src, out = Path(src), _copy_files(src, out)
    tensors: Tensors = {}
    files: dict[str, str] = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            for new_name, new in change(name, tensor).items():
                tensors[new_name], files[new_name] = new, path.name
    _save(out, tensors, files)
    return out


def _copy_files(src: str | Path, out: str | Path) -> Path:
    """Every file of `src` but its weights, into `out` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(src).iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != INDEX_FILE:
            shutil.copy2(item, out / item.name)
    return out


def edit_config(folder: Path, edit: Callable[[dict], dict]) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text())), indent=2) + "\n")


def add_to_stamp(folder: Path, quant: str) -> None:
    """Adds `quant` to a generated checkpoint's stamp (its arguments), if it has one."""
    from . import STAMP_FILE

    path = folder / STAMP_FILE
    if path.exists():
        stamp = json.loads(path.read_text())
        stamp["quant"] = f"{stamp['quant']}, {quant}" if "quant" in stamp else quant
        path.write_text(json.dumps(stamp, indent=2) + "\n")


def _text_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    return config.get("text_config", config)


def _source(name: str, files: dict[str, str]) -> str:
    """The source tensor a restored one stands for (`X.weight` for `X.qweight`'s)."""
    if name in files:
        return name
    stem = name.removesuffix(".weight")
    same = next((k for k in files if k.rpartition(".")[0] == stem), None)
    # a fused experts tensor (`experts.fuse`) stands for its experts' own
    return same or next(k for k in files if k.startswith(stem.rpartition(".")[0] + "."))


def _save(out: Path, tensors: Tensors, files: dict[str, str]) -> None:
    from safetensors.torch import save_file

    by_file: dict[str, Tensors] = {}
    for name, tensor in tensors.items():
        by_file.setdefault(files[name], {})[name] = tensor.contiguous()
    for file, group in by_file.items():
        save_file(group, out / file, {"format": "pt"})
    if len(by_file) > 1:
        index = {"metadata": {}, "weight_map": {n: files[n] for n in sorted(tensors)}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
