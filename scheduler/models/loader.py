"""Reading safetensors checkpoints and copying them into a module by parameter name."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger("iris.loader")
PROGRESS_SECONDS = 5.0  # a progress line at most this often while weights load

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, else `model.safetensors`,
    else every `*.safetensors` in the folder."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


class CheckpointTensor:
    """A tensor of an open safetensors file, not read yet: `narrow` reads only the part
    asked for (a tensor-parallel rank's shard), `load` the whole. Valid until the
    iteration that yielded it moves on (the file is then closed)."""

    def __init__(self, file: Any, name: str) -> None:
        self._file = file
        self._name = name
        self._slice = file.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * dim + [slice(start, start + length)]
        return self._slice[tuple(index)]

    def load(self) -> torch.Tensor:
        return self._file.get_tensor(self._name)


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yields `(name, CheckpointTensor)` for every tensor of the checkpoint, nothing read:
    the loader reads what the model keeps (`load_named_weights`)."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, CheckpointTensor(f, name)


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """Every tensor name of the checkpoint, no tensor read (the index, else each file's
    header)."""
    index = Path(model_dir) / INDEX_FILE
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names += f.keys()
    return names


Weight = torch.Tensor | CheckpointTensor  # what a weight stream yields


def materialized(tensor: Weight) -> torch.Tensor:
    """The whole tensor, read if it was not yet."""
    return tensor.load() if isinstance(tensor, CheckpointTensor) else tensor


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, Weight]],
    *,
    rename: Callable[[str], str | None],
    packed: dict[str, tuple[str, int]],
) -> None:
    """Copies checkpoint tensors into `module`'s parameters, casting to their dtype and device.

    `rename` maps a checkpoint name to the module's name (None = skip the tensor).
    `packed` maps a checkpoint module name (`q_proj`) to a fused module of ours and the
    shard it fills (`("qkv_proj", 0)`); a fused linear layer carries `shard_sizes`. A
    tensor-parallel shard's module carries `tp_splits` (`tensor_parallel.TPSplit`), and a
    `CheckpointTensor` is read only as far as it is kept. A module with a `load_weight`
    (a linear layer: its `LinearMethod`'s) is asked to load each of its tensors; the others
    take `load_parameter`'s copy. Raises naming every missing, unexpected or mis-shaped
    weight."""
    params = dict(module.named_parameters())
    modules = dict(module.named_modules())
    needed: set[tuple[str, int]] = set()
    for name in params:
        owner, _, _ = name.rpartition(".")
        shards = getattr(modules[owner], "shard_sizes", None)
        needed.update((name, i) for i in range(len(shards) if shards else 1))

    unexpected: list[str] = []
    bad_shape: list[str] = []
    progress = _Progress(sum(p.numel() * p.element_size() for p in params.values()))
    for ckpt_name, tensor in weights:
        renamed = rename(ckpt_name)
        if renamed is None:
            continue
        target, shard = unpack_name(renamed, packed)
        if target not in params:
            unexpected.append(ckpt_name)
            continue
        owner_name, _, leaf = target.rpartition(".")
        owner = modules[owner_name]
        # a linear layer loads through its method (linear_method.LinearLayer.load_weight)
        load: Callable[[str, Weight, int | None], int] | None
        load = getattr(owner, "load_weight", None)
        try:
            if load is not None:
                written = load(leaf, tensor, shard)
            else:
                written = load_parameter(owner, leaf, tensor, shard)
        except ShapeMismatch as error:
            bad_shape.append(f"{ckpt_name}: {error}")
            continue
        needed.discard((target, shard or 0))
        progress.add(written)
    progress.done()

    problems = []
    if unexpected:
        problems.append(f"unexpected weights: {_names(unexpected)}")
    if bad_shape:
        problems.append(f"shape mismatches: {_names(bad_shape)}")
    if needed:
        missing = sorted(_checkpoint_name(n, s, packed, modules) for n, s in needed)
        problems.append(f"missing weights: {_names(missing)}")
    if problems:
        raise ValueError("checkpoint does not match the model; " + "; ".join(problems))


class ShapeMismatch(ValueError):
    """A checkpoint tensor (this rank's part of it) whose shape is not its parameter's."""


def load_parameter(owner: nn.Module, leaf: str, tensor: Weight, shard: int | None) -> int:
    """Copies checkpoint `tensor` into `owner`'s parameter `leaf`, casting to its dtype and
    device; returns the bytes written. `owner.tp_splits[leaf]` (`tensor_parallel.TPSplit`),
    if any, picks this rank's part first, reading no more of a `CheckpointTensor`; `shard`
    is the part of a fused parameter it fills (rows `owner.shard_sizes[shard]`). Raises
    `ShapeMismatch`."""
    destination = getattr(owner, leaf).data
    split = getattr(owner, "tp_splits", {}).get(leaf)
    if split is not None:
        tensor = split.take(tensor, shard)
    tensor = materialized(tensor)
    if shard is not None:
        sizes: Any = owner.shard_sizes  # a fused linear layer's tuple of ints
        destination = destination.narrow(0, sum(sizes[:shard]), sizes[shard])
    if destination.shape != tensor.shape:
        raise ShapeMismatch(f"{tuple(tensor.shape)} vs {tuple(destination.shape)}")
    with torch.no_grad():
        destination.copy_(tensor)
    return destination.numel() * destination.element_size()


def unpack_name(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """(our parameter, its shard) that the renamed checkpoint tensor `name` fills."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in packed:
        fused, shard = packed[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return name, None


def _checkpoint_name(
    name: str, shard: int, packed: dict[str, tuple[str, int]], modules: dict[str, nn.Module]
) -> str:
    """The checkpoint-side name of one (possibly fused) parameter shard, for error messages."""
    owner, _, leaf = name.rpartition(".")
    if getattr(modules[owner], "shard_sizes", None) is None:
        return name
    prefix, _, fused = owner.rpartition(".")
    for source, (target, index) in packed.items():
        if target == fused and index == shard:
            return f"{prefix}.{source}.{leaf}"
    return f"{name}[shard {shard}]"


def _names(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


class _Progress:
    """Logs how far loading is, at most every `PROGRESS_SECONDS` (a silent start-up looks
    hung), then once at the end if it took that long."""

    def __init__(self, total_bytes: int) -> None:
        self.total, self.loaded = total_bytes, 0
        self.started = self.logged = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.loaded += nbytes
        now = time.monotonic()
        if now - self.logged >= PROGRESS_SECONDS:
            self.logged = now
            logger.info(
                "loading weights: %.0f%% (%.2f of %.2f GiB)",
                100 * self.loaded / max(self.total, 1), self.loaded / 2**30, self.total / 2**30,
            )  # fmt: skip

    def done(self) -> None:
        seconds = time.monotonic() - self.started
        if seconds >= PROGRESS_SECONDS:
            logger.info("loaded %.2f GiB of weights in %.0f s", self.loaded / 2**30, seconds)
