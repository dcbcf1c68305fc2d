"""Shared fixtures: random-weight checkpoints written by `tiny_checkpoint`.

`tiny_checkpoint(arch, **kwargs)` returns the folder of a checkpoint generated with
`generate_checkpoint(arch, out_dir, **kwargs)`, once per distinct argument set per session.
`qwen2_vl_tiny` (tied embeddings), `qwen2_5_vl_tiny` (untied), `qwen3_vl_tiny` (tied,
DeepStack), `qwen3_vl_moe_tiny` (untied, DeepStack, routed experts), `qwen3_5_tiny` and
`qwen3_5_moe_tiny` (hybrid linear attention; the MoE with a shared expert) are the fp32
seed-0 ones.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

os.environ["HF_HUB_OFFLINE"] = "1"
# The triton attention backend's tests run its kernels under Triton's interpreter on the
# CPU. Triton reads TRITON_INTERPRET when it decorates a kernel, its own `tl.zeros`,
# `tl.sum`, ... included, and those are decorated when triton is first imported, which
# torch does on its own (torch._dynamo, pulled in by some modules): so it is set here,
# before any test module imports torch. Not where an NVIDIA GPU is: the kernels compile.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path

import pytest

TinyCheckpoint = Callable[..., Path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need CUDA: where there is none they are reported as skipped, so
    `pytest -m gpu` on a GPU machine is the one command that runs them."""
    if not any("gpu" in item.keywords for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs CUDA: run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


@pytest.fixture(scope="session")
def kernels() -> ModuleType:
    """`scheduler.attention.triton_kernels`, its kernels and triton's own helpers
    interpreted (see TRITON_INTERPRET above): the triton backend's tests on the CPU."""
    import torch
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        if torch.cuda.is_available():
            pytest.skip("triton compiles here (a GPU): these tests run its interpreter")
        pytest.fail("triton was imported before TRITON_INTERPRET=1 (see tests/conftest.py)")
    module = importlib.import_module("iris_serve.scheduler.attention.triton_kernels")
    assert isinstance(module._unified_attention_kernel, InterpretedFunction)
    return module


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    import torch

    from iris_serve.tiny_checkpoint import generate_checkpoint

    torch.set_num_threads(min(2, torch.get_num_threads()))
    made: dict[tuple, Path] = {}

    def make(arch: str, **kwargs: object) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}-ckpt")
            made[key] = generate_checkpoint(arch, out, **kwargs)  # type: ignore[arg-type]
        return made[key]

    return make


@pytest.fixture(scope="session")
def qwen2_vl_tiny(tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint("qwen2_vl")


@pytest.fixture(scope="session")
def qwen2_5_vl_tiny(tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint("qwen2_5_vl")


@pytest.fixture(scope="session")
def qwen3_vl_tiny(tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint("qwen3_vl")


@pytest.fixture(scope="session")
def qwen3_vl_moe_tiny(tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint("qwen3_vl_moe")


@pytest.fixture(scope="session")
def qwen3_5_tiny(tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="session")
def qwen3_5_moe_tiny(tiny_checkpoint: TinyCheckpoint) -> Path:
    return tiny_checkpoint("qwen3_5_moe")


@pytest.fixture(
    scope="module",
    params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"],
)
def each_arch_dir(request) -> str:
    """Each architecture's tiny checkpoint in turn: a test using it runs once per arch."""
    return str(request.getfixturevalue(f"{request.param}_tiny"))


@pytest.fixture(scope="module")
def each_arch_builder(each_arch_dir: str):
    """`PromptBuilder` of `each_arch_dir`'s checkpoint."""
    from iris_serve.tokenizer_worker.prompt import PromptBuilder

    return PromptBuilder(each_arch_dir)


@pytest.fixture(scope="module")
def model_dir(qwen2_5_vl_tiny: Path) -> str:
    """The engine tests' default checkpoint: Qwen2.5-VL's tiny one (a module that needs
    another declares its own `model_dir`)."""
    return str(qwen2_5_vl_tiny)


@pytest.fixture(scope="module")
def builder(model_dir: str):
    """`PromptBuilder` of `model_dir`'s checkpoint."""
    from iris_serve.tokenizer_worker.prompt import PromptBuilder

    return PromptBuilder(model_dir)
