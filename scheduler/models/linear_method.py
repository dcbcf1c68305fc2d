"""How a linear layer holds and computes its weights: the seam every weight format plugs
into (dense, oneDNN-packed or packed in pairs on a CPU, the quantized checkpoints' formats).

A linear layer (`LinearLayer`, and its column-, row-parallel and replicated kinds in
`tensor_parallel`) owns no arithmetic of its own: its `LinearMethod` creates its weights
when the model is built, loads each checkpoint tensor into them (after the layer's
tensor-parallel slice, so a method with scales slices them alike), processes them once
loading is done (repacks, frees what it no longer needs) and applies them in the forward.
`quantization.select_linear_method` is the one place that picks the method a model's
layers are built with, from the settings and the checkpoint.

The method is read from `building_with` when a layer is constructed (the model classes
build their layers without knowing the weight format), so the selection reaches every
layer without being passed through each model class's constructor.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .loader import Weight, load_parameter

if TYPE_CHECKING:
    from .tensor_parallel import TPSplit


class LinearMethod:
    """Creates, loads, processes and applies one linear layer's weights. The base holds a
    dense `weight` `[out, in]` and an optional `bias` `[out]`, loaded as checkpoints store
    them; a method that stores something else overrides what differs."""

    name: ClassVar[str] = "dense"

    def create_weights(
        self, layer: LinearLayer, in_features: int, out_features: int, bias: bool
    ) -> None:
        """Registers the layer's parameters, uninitialised (the model is built on the meta
        device and filled by the loader)."""
        layer.weight = nn.Parameter(torch.empty(out_features, in_features))
        if bias:
            layer.bias = nn.Parameter(torch.empty(out_features))
        else:
            layer.register_parameter("bias", None)

    def load_weight(self, layer: LinearLayer, leaf: str, tensor: Weight, shard: int | None) -> int:
        """Copies checkpoint `tensor` into the parameter `leaf` (its `shard` of a fused layer),
        after the layer's tensor-parallel slice; returns the bytes written. Raises
        `loader.ShapeMismatch`."""
        return load_parameter(layer, leaf, tensor, shard)

    def process_after_loading(self, layer: LinearLayer) -> None:
        """Called once every weight is loaded; the dense method keeps them as they are."""

    def apply(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias` (`bias` passed apart: a row-parallel layer adds its own after the
        ranks' sum)."""
        return F.linear(x, layer.weight, bias)

    def resident_bytes(self, layer: LinearLayer) -> int:
        """The bytes the layer holds for its weights: its own parameters and buffers, and
        whatever else the method keeps on it."""
        tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def dense_bytes(self, layer: LinearLayer) -> int:
        """What the layer's weight and bias take held dense in the model's dtype: the
        yardstick for `resident_bytes`."""
        return self.resident_bytes(layer)


DENSE = LinearMethod()  # plain `F.linear` over the weight as loaded

_BUILDING_WITH: ContextVar[LinearMethod] = ContextVar("linear_method", default=DENSE)


@contextmanager
def building_with(method: LinearMethod) -> Iterator[None]:
    """Linear layers constructed inside take `method` (outside: the dense one)."""
    token = _BUILDING_WITH.set(method)
    try:
        yield
    finally:
        _BUILDING_WITH.reset(token)


def method_being_built() -> LinearMethod:
    """The method a linear layer constructed now takes (`building_with`)."""
    return _BUILDING_WITH.get()


def use_method(layer: LinearLayer, method: LinearMethod) -> None:
    """Re-creates `layer`'s weights with `method`, before any is loaded (on the meta device
    while the model is built): how a quantized checkpoint's layers take its format, once
    their tensor-parallel slices are set."""
    layer.method = method
    method.create_weights(layer, layer.in_features, layer.out_features, layer.has_bias)


def process_linears_after_loading(model: nn.Module) -> None:
    """Lets every linear layer's method process its loaded weights (`process_after_loading`)."""
    for layer in linear_layers(model):
        layer.method.process_after_loading(layer)


FUSABLE_METHODS = ("dense", "onednn", "pairs")  # plain weights as loaded, until processed


def fused_rows(layers: Sequence[LinearLayer]) -> LinearLayer | None:
    """One layer whose output is `layers`' outputs side by side (their weights' rows
    concatenated, `shard_sizes` their widths), for layers that read one input: where all
    are loaded, unprocessed, bias-free and under one plain method; else None."""
    method = layers[0].method
    if method.name not in FUSABLE_METHODS or any(
        layer.method is not method or layer.has_bias or layer.in_features != layers[0].in_features
        for layer in layers
    ):
        return None
    weights = [layer.weight for layer in layers]
    with torch.device("meta"):
        fused = LinearLayer(layers[0].in_features, sum(w.shape[0] for w in weights), False, method)
    fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
    fused.shard_sizes = tuple(w.shape[0] for w in weights)
    return fused


def linear_layers(model: nn.Module) -> Iterator[LinearLayer]:
    """The linear layers of `model`."""
    for module in model.modules():
        if isinstance(module, LinearLayer):
            yield module


def linear_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes `model`'s linear layers hold for their weights, bytes they would hold dense)."""
    layers = list(linear_layers(model))
    resident = sum(layer.method.resident_bytes(layer) for layer in layers)
    return resident, sum(layer.method.dense_bytes(layer) for layer in layers)


class LinearLayer(nn.Module):
    """`y = x @ W.T + b` whose weights its `method` holds (`LinearMethod`): replicated on
    every rank as it stands; `tensor_parallel`'s column- and row-parallel layers hold one
    rank's slice. `tp_splits` maps a parameter to the part of the checkpoint tensor it holds
    (`tensor_parallel.TPSplit`); a layer fused from several checkpoint tensors (`qkv_proj`)
    has `shard_sizes`, the output rows of each. `method` None: the one being built with
    (`building_with`); the LM head passes `DENSE`, as the logits read its weight."""

    weight: torch.Tensor  # while the method keeps it (the dense one does)
    bias: torch.Tensor | None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, method: LinearMethod | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.tp_splits: dict[str, TPSplit] = {}
        self.shard_sizes: tuple[int, ...] | None = None
        self.method = method_being_built() if method is None else method
        self.method.create_weights(self, in_features, out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def load_weight(self, leaf: str, tensor: Weight, shard: int | None) -> int:
        """The loader's way in: the method loads `tensor` into parameter `leaf`."""
        return self.method.load_weight(self, leaf, tensor, shard)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.has_bias}, method={self.method.name}"
        )
