"""Our Triton GEMMs for quantized weights on the GPU: block FP8 (e4m3 weights with a scale
per 128×128 block, `block_fp8`) and 4-bit (every 4-bit format in one layout,
`int4_kernel`), each `y = x @ W.T` with the weight dequantized tile by tile in registers,
never in memory. Tested on the CPU under `TRITON_INTERPRET=1` against the dequantized
reference.

Weight-only: activations stay in the model's dtype, dots accumulate in fp32 (`ieee` for
fp32 inputs, as "exact" means there). One program computes a `BLOCK_M × BLOCK_N` tile of
`y`, walking K in `BLOCK_K` steps:

- **Block FP8**: the held weight `[N, K]` (this rank's slice) with its grid expanded along
  the rows, `scales[n, b]` for the b-th 128-column block this rank's columns fall in; a
  row-parallel slice may start `k_shift` columns into its first block, so column k's
  block is `(k_shift + k) // 128`, gathered per element (a tile may straddle two).
- **4-bit**: eight values to an int32 along K (word r holds inputs 8r..8r+7, nibble i
  input 8r+i), a scale and a zero point per group of `group` inputs and output column:
  `W[k, n] = (q - z[k // group, n]) · s[k // group, n]`.

Block FP8 also runs with its activations in e4m3 (`block_fp8_linear_fp8_activations`, the
format's `activation_scheme` "dynamic", as vLLM and SGLang run it on FP8 tensor cores):
each row quantized per group of 128 inputs along the weight's blocks (`quantize_activations`,
a scale per row and block: its largest magnitude over e4m3's), then e4m3 × e4m3 dots per
block, scaled by both scales into an fp32 sum.

The MoE variant (`GROUPED`) multiplies rows sorted by expert, each group of rows by its
expert's weight (`[E, N, K]` held alike), in one launch: a table built on the device
(`_row_blocks`, no count read back, so a CUDA graph records it) gives each program's
`BLOCK_M` rows and their expert; a table sized for the most blocks any routing needs
leaves its spare programs nothing to do.
"""

# Triton's DSL, which its annotations do not express (see attention/triton_kernels.py).
# pyright: reportArgumentType=false, reportAttributeAccessIssue=false, reportOperatorIssue=false

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_BLOCK = 128
E4M3_MAX = 448.0
NIBBLES = 8  # 4-bit values per int32 word


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): a decode's few rows in one 16-row tile."""
    return (16 if m <= 16 else 64), 64, 64


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _dequantizing_gemm_kernel(
    x, w, scales, zeros, y, M, N, K, k_shift,
    stride_xm, stride_w, stride_s, stride_ym,
    block_expert, block_start, block_end, stride_we, stride_se,
    INT4: tl.constexpr, GROUP: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One `BLOCK_M × BLOCK_N` tile of `y = x @ W.T`, W dequantized a `BLOCK_K` step at a
    time: block FP8 (`INT4` false: `w` e4m3 `[N, K]`, `scales` its grid) or 4-bit; with
    `GROUPED`, the rows `block_start..block_end` of program 0's index times its expert's
    W (`stride_we`, `stride_se` apart: the zeros are laid out as the scales)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if GROUPED:
        expert = tl.load(block_expert + pid_m).to(tl.int64)
        rows = tl.load(block_start + pid_m) + tl.arange(0, BLOCK_M)
        rows_end = tl.load(block_end + pid_m)
        w += expert * stride_we
        scales += expert * stride_se
        zeros += expert * stride_se
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_end = M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_tile = tl.load(
            x + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=(rows[:, None] < rows_end) & (ks[None, :] < K), other=0.0,
        )  # fmt: skip
        inside = (ks[:, None] < K) & (cols[None, :] < N)
        if INT4:
            w_tile = _int4_tile(w, scales, zeros, ks, cols, inside, stride_w, stride_s, GROUP)
        else:
            w_tile = _fp8_tile(w, scales, ks, cols, inside, stride_w, stride_s, k_shift)
        acc += tl.dot(x_tile, w_tile.to(x_tile.dtype), input_precision=DOT_PRECISION)
    tl.store(
        y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
        acc.to(y.dtype.element_ty), mask=(rows[:, None] < rows_end) & (cols[None, :] < N),
    )  # fmt: skip


@triton.jit
def _fp8_tile(w, scales, ks, cols, inside, stride_w, stride_s, k_shift):
    """`W.T[ks, cols]` in fp32: e4m3 codes times their block's scale (column k's block is
    `(k_shift + k) // 128`, gathered per element: a tile may straddle two)."""
    codes = tl.load(w + cols[None, :].to(tl.int64) * stride_w + ks[:, None], mask=inside, other=0.0)
    block = (k_shift + ks) // 128
    scale = tl.load(
        scales + cols[None, :].to(tl.int64) * stride_s + block[:, None], mask=inside, other=0.0
    )
    return codes.to(tl.float32) * scale


@triton.jit
def _int4_tile(w, scales, zeros, ks, cols, inside, stride_w, stride_s, GROUP: tl.constexpr):
    """`W.T[ks, cols]` in fp32 from the int32 words `[K/8, N]`: `(q - z) · s` per group."""
    words = tl.load(
        w + (ks[:, None] // 8).to(tl.int64) * stride_w + cols[None, :], mask=inside, other=0
    )
    values = (words >> ((ks[:, None] % 8) * 4)) & 0xF
    group = (ks[:, None] // GROUP).to(tl.int64) * stride_s + cols[None, :]
    scale = tl.load(scales + group, mask=inside, other=0.0).to(tl.float32)
    zero = tl.load(zeros + group, mask=inside, other=0.0).to(tl.float32)
    return (values.to(tl.float32) - zero) * scale


@triton.jit
def _fp8_activation_gemm_kernel(
    xq, xs, w, ws, y, M, N, K, k_shift,
    stride_xm, stride_xs, stride_w, stride_ws, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One `BLOCK_M × BLOCK_N` tile of `y = x @ W.T` from e4m3 activations `xq` with their
    scales `xs` `[M, blocks]` and e4m3 weights with their row-expanded grid `ws`, one
    128-column block a step (the first starting `k_shift` columns before column 0)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(0, tl.cdiv(k_shift + K, 128)):
        ks = block * 128 - k_shift + tl.arange(0, 128)
        inside = (ks >= 0) & (ks < K)
        x_tile = tl.load(
            xq + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
            mask=(rows[:, None] < M) & inside[None, :], other=0.0,
        )  # fmt: skip
        w_tile = tl.load(
            w + cols[None, :].to(tl.int64) * stride_w + ks[:, None],
            mask=inside[:, None] & (cols[None, :] < N), other=0.0,
        )  # fmt: skip
        x_scale = tl.load(xs + rows.to(tl.int64) * stride_xs + block, mask=rows < M, other=0.0)
        w_scale = tl.load(ws + cols.to(tl.int64) * stride_ws + block, mask=cols < N, other=0.0)
        acc += tl.dot(x_tile, w_tile) * x_scale[:, None] * w_scale[None, :]
    tl.store(
        y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
        acc.to(y.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N),
    )  # fmt: skip


def quantize_activations(x: torch.Tensor, k_shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]`, fp32 scales `[M, blocks]`) of rows `x` `[M, K]`, per group of the
    inputs falling in one 128-column block of the weight (the first `128 - k_shift` wide):
    each group divided by its largest magnitude over 448, so that one maps to e4m3's largest.
    Torch ops on the device (CUDA-graph safe)."""
    m, k = x.shape
    blocks = triton.cdiv(k_shift + k, FP8_BLOCK)
    padded = x.new_zeros(m, blocks, FP8_BLOCK, dtype=torch.float32)
    padded.view(m, -1)[:, k_shift : k_shift + k] = x
    scales = padded.abs().amax(dim=-1).clamp(min=1e-10) / E4M3_MAX
    codes = (padded / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, -1)[:, k_shift : k_shift + k], scales


def block_fp8_linear_fp8_activations(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, k_shift: int = 0
) -> torch.Tensor:
    """`block_fp8_linear` with the activations quantized to e4m3 per row and block (see the
    module): what FP8 tensor cores compute."""
    rows = x.reshape(-1, x.shape[-1])
    m, n = rows.shape[0], weight.shape[0]
    out = rows.new_empty(m, n)
    if m:
        codes, row_scales = quantize_activations(rows, k_shift)
        grid = scales.float().contiguous()
        block_m, block_n, _ = _tiles(m)
        _fp8_activation_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            codes, row_scales, weight, grid, out, m, n, rows.shape[1], k_shift,
            codes.stride(0), row_scales.stride(0), weight.stride(0), grid.stride(0),
            out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def block_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, k_shift: int = 0
) -> torch.Tensor:
    """`x @ W.T` for e4m3 `weight` `[N, K]` with its row-expanded grid `scales` `[N, blocks]`
    (fp32), the slice starting `k_shift` columns into its first block; `x` `[..., K]`."""
    grid = scales.float().contiguous()
    return _launch(x, weight.shape[0], weight, grid, grid, k_shift, weight.stride(0), int4=False)


def grouped_block_fp8_linear(
    x: torch.Tensor,
    rows_per_expert: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    k_shift: int = 0,
) -> torch.Tensor:
    """`x` `[M, K]` sorted by expert, `rows_per_expert` `[E]` -> `[M, N]`: expert e's rows
    times its e4m3 `weight[e]` `[N, K]` with its row-expanded grid `scales[e]`, the
    slice starting `k_shift` columns into its first block (as `block_fp8_linear`)."""
    grid = scales.float().contiguous()
    return _launch(
        x, weight.shape[1], weight, grid, grid, k_shift, weight.stride(1), int4=False,
        rows_per_expert=rows_per_expert,
    )  # fmt: skip


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
) -> torch.Tensor:
    """`x @ W.T` for 4-bit `qweight` int32 `[K/8, N]` (see the module) with `scales` and
    `zeros` `[K/group, N]` (contiguous alike); `x` `[..., K]`."""
    n = qweight.shape[1]
    return _launch(x, n, qweight, scales, zeros, 0, qweight.stride(0), int4=True, group=group)


def grouped_int4_linear(
    x: torch.Tensor,
    rows_per_expert: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
) -> torch.Tensor:
    """`x` `[M, K]` sorted by expert, `rows_per_expert` `[E]` -> `[M, N]`: expert e's rows
    times its 4-bit `qweight[e]` `[K/8, N]` with `scales[e]`, `zeros[e]` `[K/group, N]`
    (as `int4_linear`, stacked; the zeros laid out as the scales)."""
    return _launch(
        x, qweight.shape[2], qweight, scales, zeros, 0, qweight.stride(1), int4=True,
        group=group, rows_per_expert=rows_per_expert,
    )  # fmt: skip


def _launch(
    x: torch.Tensor,
    n: int,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    k_shift: int,
    stride_w: int,
    *,
    int4: bool,
    group: int = 1,
    rows_per_expert: torch.Tensor | None = None,
) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    out = rows.new_empty(m, n)
    if not m:
        return out.view(*x.shape[:-1], n)
    grouped = rows_per_expert is not None
    per_program = m if rows_per_expert is None else triton.cdiv(m, rows_per_expert.numel())
    block_m, block_n, block_k = _tiles(per_program)
    if rows_per_expert is None:
        blocks = triton.cdiv(m, block_m)
        table = (rows, rows, rows)  # not read
        stride_we = stride_se = 0
    else:
        table = _row_blocks(rows_per_expert, block_m, m)
        blocks = table[0].numel()
        stride_we, stride_se = weight.stride(0), scales.stride(0)
        scales = scales[0]  # an expert's, for its row stride
    _dequantizing_gemm_kernel[(blocks, triton.cdiv(n, block_n))](
        rows, weight, scales, zeros, out, m, n, k, k_shift,
        rows.stride(0), stride_w, scales.stride(0), out.stride(0),
        *table, stride_we, stride_se,
        INT4=int4, GROUP=group, GROUPED=grouped,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=_precision(x.dtype),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def _row_blocks(
    rows_per_expert: torch.Tensor, block_m: int, total_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end of its rows) per block of `block_m` rows, for rows sorted by
    expert, computed on the device. Sized for the most blocks any routing of `total_rows`
    rows can need (`cdiv(total, block_m) + E`); the spare blocks are empty (start = end)."""
    counts = rows_per_expert.to(torch.int64)
    experts = counts.numel()
    blocks = (counts + block_m - 1) // block_m
    block_ends, row_ends = torch.cumsum(blocks, 0), torch.cumsum(counts, 0)
    index = torch.arange(triton.cdiv(total_rows, block_m) + experts, device=counts.device)
    expert = torch.searchsorted(block_ends, index, right=True).clamp(max=experts - 1)
    used = index < block_ends[-1]
    first = (
        row_ends[expert]
        - counts[expert]
        + (index - (block_ends[expert] - blocks[expert])) * block_m
    )
    start = torch.where(used, first, 0).to(torch.int32)
    end = torch.where(used, row_ends[expert], 0).to(torch.int32)
    return expert.to(torch.int32), start, end


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int values `[N, K]` in 0..15 -> the kernel's int32 words `[K/8, N]`."""
    n, k = values.shape
    nibbles = values.t().to(torch.int64).reshape(k // NIBBLES, NIBBLES, n)
    shifts = torch.arange(0, 32, 4, device=values.device, dtype=torch.int64)[None, :, None]
    words = (nibbles << shifts).sum(dim=1)  # disjoint bits: the sum is their OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
