"""`--dtype auto`: a bf16 (or fp16) checkpoint computes in bf16 on a CPU that has native
bf16, as vLLM's CPU build runs it, and then answers as transformers does in bf16 wherever
transformers' own choice is clear of bf16's rounding; float32 checkpoints (every tiny
checkpoint the parity suite uses) stay float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler import auto_dtype
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.step.engine import Engine
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.reference import chat_prompt, hf_generate_with_margins, make_image

CPU = torch.device("cpu")
MAX_NEW = 10
CLEAR_MARGIN = 0.05  # logits apart by more than bf16's rounding through the tiny model


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's CPU computes bf16 natively, whatever the machine running it has."""
    monkeypatch.setattr(auto_dtype, "native_bf16_cpu", lambda: "AVX512-BF16")


def test_auto_takes_the_checkpoints_half_dtype_only_where_the_cpu_computes_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    auto = EngineConfig(model="m")
    monkeypatch.setattr(auto_dtype, "native_bf16_cpu", lambda: "AMX")
    assert auto.resolved_dtype(CPU, "bfloat16") is torch.bfloat16
    assert auto.resolved_dtype(CPU, "float16") is torch.bfloat16  # no fast fp16 GEMM on CPUs
    assert auto.resolved_dtype(CPU, "float32") is torch.float32
    assert auto.resolved_dtype(CPU, None) is torch.float32
    assert "AMX" in auto_dtype.auto_dtype(CPU, "bfloat16")[1]
    monkeypatch.setattr(auto_dtype, "native_bf16_cpu", lambda: None)
    assert auto.resolved_dtype(CPU, "bfloat16") is torch.float32
    assert "no native bf16" in auto_dtype.auto_dtype(CPU, "bfloat16")[1]
    assert auto.resolved_dtype(torch.device("cuda"), "float32") is torch.bfloat16
    pinned = EngineConfig(model="m", dtype="float32")
    monkeypatch.setattr(auto_dtype, "native_bf16_cpu", lambda: "AMX")
    assert pinned.resolved_dtype(CPU, "bfloat16") is torch.float32


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_5"])
def test_a_bf16_checkpoint_answers_as_transformers_in_bf16_where_its_choice_is_clear(
    arch: str, native_bf16: None, tiny_checkpoint, caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy tokens with an image, prefill chunked: equal to transformers' in bf16 up to
    the first step where transformers' top two logits are within bf16's rounding (after
    it the two may rightly part); the engine says why it took bf16. Qwen3.5: its linear
    attention's decode steps fused in bf16 (`gated_delta_decode_step`)."""
    checkpoint: Path = tiny_checkpoint(arch, dtype="bfloat16")
    caplog.set_level("INFO")
    engine = Engine(
        EngineConfig(
            model=str(checkpoint), device="cpu", kv_cache_memory=16 << 20, max_itl_stretch=0,
            max_num_batched_tokens=32,
        )
    )  # fmt: skip
    assert engine.model.model.embed_tokens.weight.dtype is torch.bfloat16
    assert "--dtype auto: a bfloat16 checkpoint; this CPU computes bf16" in caplog.text
    prompt = chat_prompt(PromptBuilder(checkpoint), "What is here?", [make_image(56, 56, seed=5)])
    greedy = Sampling(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    [ours] = engine.generate([prompt], greedy)
    theirs, margins = hf_generate_with_margins(checkpoint, prompt, MAX_NEW, torch.bfloat16)
    clear = next((i for i, m in enumerate(margins) if m < CLEAR_MARGIN), len(margins))
    assert clear >= 3, f"too few clear steps to compare: margins {margins}"
    assert ours[:clear] == theirs[:clear], (ours, theirs, margins)
