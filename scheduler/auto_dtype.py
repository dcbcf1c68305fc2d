"""What `--dtype auto` computes in: bfloat16 on CUDA; on a CPU the checkpoint's own half
dtype where the CPU computes bfloat16 natively (AVX512-BF16 or AMX: oneDNN's bf16 GEMMs
then run at about twice fp32's rate and the weights take half the memory), float32
otherwise. A float16 checkpoint runs in bfloat16 there (CPUs have no fast fp16 GEMM;
vLLM's CPU build does the same); a float32 checkpoint stays float32, so the tiny
checkpoints the tests generate keep the fp32 parity suite's arithmetic."""

from __future__ import annotations

import torch

HALF = ("bfloat16", "float16")


def native_bf16_cpu() -> str | None:
    """The instruction set this CPU computes bf16 with (None: it has none)."""
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return None


def auto_dtype(device: torch.device, checkpoint_dtype: str | None) -> tuple[torch.dtype, str]:
    """(the dtype, why) for a checkpoint stored in `checkpoint_dtype` (config.json's
    `torch_dtype`/`dtype`; None: not said) on `device`."""
    if device.type != "cpu":
        return torch.bfloat16, f"bfloat16 on {device.type}"
    if checkpoint_dtype not in HALF:
        return torch.float32, f"the checkpoint is {checkpoint_dtype or 'of no stated dtype'}"
    isa = native_bf16_cpu()
    if isa is None:
        return torch.float32, f"a {checkpoint_dtype} checkpoint; this CPU has no native bf16"
    return torch.bfloat16, f"a {checkpoint_dtype} checkpoint; this CPU computes bf16 ({isa})"
