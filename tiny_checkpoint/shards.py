"""Streaming safetensors shards: random tensors written one slice at a time.

A real-size checkpoint never exists in memory: each shard's header is computed from the
shapes alone, then every tensor is drawn in slices of at most `CHUNK_ELEMENTS` values and
appended. Each tensor has its own generator, seeded from (seed, name), so its values do
not depend on which other tensors are written (a depth-shrunk checkpoint's layer 0 is the
full one's) nor on the shard layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
CHUNK_ELEMENTS = 1 << 24  # 16M values: 64 MB of float32 scratch per slice
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its checkpoint name, shape and how to fill it."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal" | "ones" | "zeros"
    std: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def plan_shards(
    specs: list[TensorSpec], itemsize: int, max_shard_bytes: int
) -> list[list[TensorSpec]]:
    """Greedy, in order: a new shard starts when the next tensor would overflow this one.
    A tensor larger than `max_shard_bytes` gets a shard of its own, as transformers does."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_sharded(
    specs: list[TensorSpec],
    out_dir: Path,
    dtype: torch.dtype,
    seed: int,
    max_shard_bytes: int,
    progress: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> Path:
    """Writes `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`. `device`
    draws the random values there; each device's generator gives other values for one seed."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(specs, itemsize, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        if progress is not None:
            progress(f"{filename}: {len(shard)} tensors")
        total += _write_file(out_dir / filename, shard, dtype, seed, device)
        weight_map.update({spec.name: filename for spec in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    path = out_dir / INDEX_FILE
    path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return path


def _write_file(
    path: Path, specs: list[TensorSpec], dtype: torch.dtype, seed: int, device: str
) -> int:
    """One safetensors file: 8-byte header length, JSON header, then the raw tensors."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        end = offset + spec.numel * itemsize
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors writes
    with path.open("wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for spec in specs:
            for chunk in _values(spec, dtype, seed, device):
                f.write(chunk.view(torch.uint8).numpy().data)
    return offset


def _values(spec: TensorSpec, dtype: torch.dtype, seed: int, device: str) -> Iterable[torch.Tensor]:
    """The tensor's values, flat, in slices of at most `CHUNK_ELEMENTS`."""
    if spec.init != "normal":
        fill = 1.0 if spec.init == "ones" else 0.0
        for start in range(0, spec.numel, CHUNK_ELEMENTS):
            yield torch.full((min(CHUNK_ELEMENTS, spec.numel - start),), fill, dtype=dtype)
        return
    generator = torch.Generator(device).manual_seed(tensor_seed(seed, spec.name))
    for start in range(0, spec.numel, CHUNK_ELEMENTS):
        n = min(CHUNK_ELEMENTS, spec.numel - start)
        values = torch.randn(n, generator=generator, device=device).mul_(spec.std)
        yield values.to(dtype).cpu()


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one tensor, from the checkpoint's seed and the tensor's name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
