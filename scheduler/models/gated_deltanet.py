"""Gated DeltaNet, Qwen3.5's linear attention: the torch ops and the layer.

Per value head, each token updates a matrix state S `[key_head_dim, value_head_dim]` and
reads it with its query:

    S ← exp(g)·S                  decay (g ≤ 0, learned per token and head)
    u = β·(v − Sᵀk)               the delta rule: write only what S mispredicts
    S ← S + k·uᵀ
    o = Sᵀq

Before that, the raw q/k/v projections pass a causal depthwise conv (and SiLU), and q, k
are L2-normalised, q also scaled by key_head_dim^-½. A sequence therefore carries two
states from one token to the next: the conv's last `kernel − 1` input columns and S, kept
in fp32 (rounding S to bf16 token after token drifts). Both live in a `LinearStates` pool
owned by the scheduler; the layer reads and writes the slots its `LinearStepContext`
names.

A prefill runs the recurrence in chunks of `CHUNK_SIZE` tokens counted from the call's
first token (`chunked_delta_rule`): within a chunk the delta updates form one unit
lower-triangular system, solved at once, so only the passage from chunk to chunk is
sequential. A decode step applies the recurrence itself (`recurrent_delta_step`), batched
over the step's sequences; on a CPU through our C++ kernel instead, in place on the state
slots (`cpu_kernels/gated_delta.cpp`: two passes over each S, no gather or scatter), and
in bfloat16 from the input projections on, the conv, norms, g and β included, in one call
(`gated_delta_decode_step`). The forms agree up to fp rounding, so a prompt prefilled
over several calls matches one call up to rounding too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels
from ..hybrid.linear_state import LinearStates, LinearStepContext
from .config import VLModelConfig
from .layers import rms_normalized
from .linear_method import LinearLayer, fused_rows
from .tensor_parallel import RowParallelLinear, TPSplit, column_slices

CHUNK_SIZE = 64
L2_NORM_EPS = 1e-6

# ------------------------------------------------------------------------ the ops


def causal_conv(
    columns: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of a causal depthwise conv over one sequence's new columns `[T, C]`, after the
    `K − 1` columns of `state` `[C, K − 1]`; `weight` `[C, 1, K]`. Returns the output
    `[T, C]` and the conv's whole input `[C, K − 1 + T]`, whose columns `k .. k + K − 2`
    are the state after the first k new tokens."""
    history = torch.cat([state, columns.t()], dim=1)
    out = F.conv1d(history.unsqueeze(0).to(weight.dtype), weight, groups=weight.shape[0])[0]
    return F.silu(out).t().to(columns.dtype), history


def causal_conv_step(
    column: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of B sequences: `column` `[B, C]`, `state` `[B, C, K − 1]` ->
    (SiLU of the conv `[B, C]`, the new state `[B, C, K − 1]`)."""
    window = torch.cat([state, column.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window.to(weight.dtype) * weight[:, 0]).sum(-1)
    return F.silu(out).to(column.dtype), window[..., 1:]


def recurrent_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences, fp32: q/k `[B, H, Dk]`, v `[B, H, Dv]`, g/beta
    `[B, H]`, state `[B, H, Dk, Dv]` -> (output `[B, H, Dv]`, the new state). As batched
    matrix products over the B·H heads: a decode step is a few kernels, not one per
    broadcast."""
    batch, heads, dk, dv = state.shape
    state = (state * g.exp()[..., None, None]).view(batch * heads, dk, dv)
    k_rows = k.reshape(batch * heads, 1, dk)
    predicted = torch.bmm(k_rows, state).view(batch, heads, dv)  # Sᵀk
    update = (v - predicted) * beta[..., None]
    state = state.baddbmm(k_rows.transpose(1, 2), update.view(batch * heads, 1, dv))
    out = torch.bmm(q.reshape(batch * heads, 1, dk), state)
    return out.view(batch, heads, dv), state.view(batch, heads, dk, dv)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    snapshots_at: Sequence[int] = (),
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The recurrence over one sequence's T tokens, chunk by chunk, fp32: q/k `[T, H, Dk]`,
    v `[T, H, Dv]`, g/beta `[T, H]`, `state` `[H, Dk, Dv]` before the first token. Returns
    the output `[T, H, Dv]`, the state after the last token, and the state after the first
    n tokens for each n of `snapshots_at` (1 <= n <= T), computed beside the scan so that
    they change nothing else.

    Within a chunk, with L the running sum of g (so exp(L_i − L_j) is the decay from token
    j to token i) and S₀ the state entering the chunk, the delta rule's writes u satisfy

        u_i + Σ_{j<i} β_i (k_i·k_j) exp(L_i − L_j) u_j = β_i v_i − β_i exp(L_i) S₀ᵀk_i,

    a unit lower-triangular system in u, inverted once per chunk: u = a − b·S₀, where the
    S₀-free parts a and b are the inverse's products with the two right-hand terms. Then
    every output and the next state are matrix products with S₀."""
    length, heads, _ = k.shape
    if any(not 0 < count <= length for count in snapshots_at):
        raise ValueError(f"snapshots after {list(snapshots_at)} of {length} tokens")
    num_chunks = -(-length // chunk_size)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """`[T, H, ...]` -> `[H, chunks, chunk_size, ...]`, zero-padded: a padded token has
        k = v = 0 and β = g = 0, so it neither writes nor decays the state. Contiguous, in
        one copy: a strided operand would be copied again by every product that takes it."""
        out = x.new_zeros(heads, num_chunks * chunk_size, *x.shape[2:])
        out[:, :length] = x.transpose(0, 1)
        return out.view(heads, num_chunks, chunk_size, *x.shape[2:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    log_decay = g.cumsum(-1)  # [H, chunks, C]: L_i
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).triu(1)
    pair_decay = log_decay[..., :, None] - log_decay[..., None, :]
    pair_decay = pair_decay.masked_fill(later, -torch.inf).exp()  # exp(L_i − L_j), 0 for j > i
    k_beta = k * beta[..., None]
    # the system's matrix; solve_triangular takes its diagonal as 1 (unitriangular). Its
    # inverse, then two products: one solve of a small identity costs less than solving
    # for the two right-hand sides (LAPACK's layout copies of those dominate a solve)
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    identity = torch.eye(chunk_size, dtype=k.dtype, device=k.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(
        system, identity.contiguous(), upper=False, unitriangular=True
    )
    writes_if_empty = inverse @ (v * beta[..., None])  # a: u when S₀ = 0
    state_reads = inverse @ (k_beta * log_decay.exp()[..., None])  # b: u = a − b·S₀
    scores = (q @ k.transpose(-1, -2)) * pair_decay  # within-chunk attention, causal
    q_decayed = q * log_decay.exp()[..., None]

    out = torch.empty_like(v)
    wanted = sorted(set(snapshots_at))
    snapshots: dict[int, torch.Tensor] = {}
    for chunk in range(num_chunks):
        first = chunk * chunk_size
        writes = writes_if_empty[:, chunk] - state_reads[:, chunk] @ state
        out[:, chunk] = q_decayed[:, chunk] @ state + scores[:, chunk] @ writes
        chunk_tokens = (k[:, chunk], log_decay[:, chunk], writes)
        while wanted and wanted[0] <= first + chunk_size:
            count = wanted.pop(0)
            snapshots[count] = _state_after(state, *chunk_tokens, count - first)
        state = _state_after(state, *chunk_tokens, min(chunk_size, length - first))
    out = out.reshape(heads, num_chunks * chunk_size, -1)[:, :length].transpose(0, 1)
    return out, state, [snapshots[count] for count in snapshots_at]


def _state_after(
    state: torch.Tensor,
    k: torch.Tensor,
    log_decay: torch.Tensor,
    writes: torch.Tensor,
    count: int,
) -> torch.Tensor:
    """The state after a chunk's first `count` tokens, from the state entering it `[H, Dk,
    Dv]` and the chunk's k `[H, C, Dk]`, L `[H, C]` and writes u `[H, C, Dv]`:
    exp(L_last)·S₀ + Σ_j exp(L_last − L_j) k_j u_jᵀ over those tokens."""
    last = log_decay[:, count - 1, None]  # [H, 1]
    decayed_k = k[:, :count] * (last - log_decay[:, :count]).exp()[..., None]
    return state * last.exp()[..., None] + decayed_k.transpose(-1, -2) @ writes[:, :count]


def _kernel_steps(recurrent: torch.Tensor) -> bool:
    """Whether a decode step over these states (one layer's) runs the C++ kernel: on a
    CPU, value heads in whole vectors, where the kernel built."""
    return (
        recurrent.device.type == "cpu"
        and recurrent.shape[-1] % cpu_kernels.VECTOR_FLOATS == 0
        and recurrent.shape[-1] <= cpu_kernels.MAX_HEAD_DIM
        and cpu_kernels.load("gated_delta")
    )


# The dtypes whose decode steps run fused (`gated_delta_decode_step`): bf16 only, since in
# float32 its sums in another order than PyTorch's could move the fp32 parity suite's tokens.
FUSED_STEP_DTYPES = (torch.bfloat16,)


def _fused_steps(columns: torch.Tensor, recurrent: torch.Tensor) -> bool:
    """Whether a decode step over these states runs fused, from the input projections on."""
    return columns.dtype in FUSED_STEP_DTYPES and _kernel_steps(recurrent)


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_NORM_EPS)


# ---------------------------------------------------------------------- the layer


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output with a plain `weight`, times SiLU of the gate z;
    rounding as transformers (normalise in fp32, cast, scale, gate in fp32, cast)."""

    DUMMY_FILL: ClassVar[dict[str, float]] = {"weight": 1.0}  # `registry._init_dummy`

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight * rms_normalized(x, self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class DepthwiseConvWeight(nn.Module):
    """The checkpoint's `conv1d.weight` `[channels, 1, kernel]` (no bias), this rank's
    channels (`pieces` of the checkpoint's, as `in_proj_qkv`'s rows)."""

    def __init__(self, pieces: tuple[tuple[int, int], ...], kernel: int) -> None:
        super().__init__()
        channels = sum(length for _, length in pieces)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.tp_splits = {"weight": TPSplit(0, pieces)}


class GatedDeltaNet(nn.Module):
    """Checkpoint names under `linear_attn.`. `state_layer` is this layer's row of the
    state pool: its index among the decoder's linear-attention layers.

    `in_proj_qkv` yields the conv's input, q then k (key heads) then v (value heads);
    `in_proj_z` the output gate per value channel, `in_proj_b` β and `in_proj_a` the decay's
    input per value head: g = −exp(A_log)·softplus(a + dt_bias). Loaded, the four are one
    layer where they can be (`fuse_input_projections`)."""

    CPU_KERNELS: ClassVar[tuple[str, ...]] = ("gated_delta",)  # cpu_kernels.load_for

    DUMMY_FILL: ClassVar[dict[str, float]] = {"A_log": 0.0, "dt_bias": 1.0}  # decay e^-1.3

    def __init__(self, config: VLModelConfig, state_layer: int) -> None:
        super().__init__()
        linear, heads = config.linear, config.linear_heads
        assert linear is not None  # config.linear_heads raised otherwise
        self.state_layer = state_layer
        self.num_key_heads, self.num_value_heads = heads.num_key_heads, heads.num_value_heads
        self.key_head_dim, self.value_head_dim = linear.key_head_dim, linear.value_head_dim
        dk, dv = self.key_head_dim, self.value_head_dim
        key_width = linear.num_key_heads * dk  # q's, and k's, rows in the checkpoint
        own_keys = (heads.key_start * dk, heads.num_key_heads * dk)
        channels = (
            own_keys,
            (key_width + own_keys[0], own_keys[1]),
            (2 * key_width + heads.value_start * dv, heads.num_value_heads * dv),
        )
        self.channel_sizes = tuple(length for _, length in channels)
        value_heads = ((heads.value_start, heads.num_value_heads),)
        value_rows = ((heads.value_start * dv, heads.num_value_heads * dv),)
        hidden = config.hidden_size
        self.in_proj_qkv = column_slices(hidden, channels)
        self.conv1d = DepthwiseConvWeight(channels, linear.conv_kernel)
        self.in_proj_z = column_slices(hidden, value_rows)
        self.in_proj_b = column_slices(hidden, value_heads)
        self.in_proj_a = column_slices(hidden, value_heads)
        self.in_proj: LinearLayer | None = None  # the four above, once fused
        self.A_log = nn.Parameter(torch.empty(heads.num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(heads.num_value_heads))
        self.tp_splits = {"A_log": TPSplit(0, value_heads), "dt_bias": TPSplit(0, value_heads)}
        self.norm = GatedRMSNorm(dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(
            linear.num_value_heads * dv, hidden, bias=False, tp=config.tp
        )

    def forward(self, x: torch.Tensor, step: LinearStepContext) -> torch.Tensor:
        """x `[N, H]`, flat over the step's sequences in `step`'s order -> `[N, H]`. Reads
        each sequence's state from its slot and writes the state after its last token back
        (and, for each capture, the state after its first k tokens to the capture's slot)."""
        n = x.shape[0]
        if sum(s.num_tokens for s in step.sequences) != n:
            raise ValueError(f"the step's sequences do not cover its {n} tokens")
        columns, z, b, a = self._input_projections(x)
        if step.is_decode and _fused_steps(columns, step.states.recurrent[self.state_layer]):
            out = self._fused_step(columns, a, b, step.states, step.slot_ids)
        else:
            beta = b.sigmoid().float()
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
            if step.is_decode:
                out = self._step(columns, g, beta, step.states, step.slot_ids)
            else:
                out = torch.cat(self._each_sequence(columns, g, beta, step))
        if step.is_decode:
            for sequence in step.sequences:
                for _, snapshot in sequence.captures:
                    self._copy_state(step.states, sequence.slot, snapshot)
        out = out.to(x.dtype)
        z = z.view(n, self.num_value_heads, self.value_head_dim)
        return self.out_proj(self.norm(out, z).reshape(n, -1))

    def _input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The conv's columns, z, b and a of `x`: one product where they are fused."""
        if self.in_proj is not None:
            return self.in_proj(x).split(self.in_proj.shard_sizes or (), dim=-1)
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def fuse_input_projections(self) -> bool:
        """Once loaded: the four projections of the input, where they hold plain weights
        under one method (a checkpoint that quantizes some keeps them apart), become one
        layer of their rows side by side, so that a decode step makes one call for the
        four instead of four (two of them a few rows each, all launch and no bytes).
        Whether it fused them."""
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        fused = fused_rows([getattr(self, name) for name in names])
        if fused is None:
            return False
        for name in names:
            delattr(self, name)
        self.in_proj = fused
        return True

    def _each_sequence(
        self, columns: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, step: LinearStepContext
    ) -> list[torch.Tensor]:
        """Each sequence's output `[tokens, value heads, Dv]`: chunked, or as a decode step
        for a single token."""
        outputs = []
        start = 0
        for index, sequence in enumerate(step.sequences):
            rows = slice(start, start + sequence.num_tokens)
            start = rows.stop
            if sequence.num_tokens == 1:
                slot = step.slot_ids[index : index + 1]
                outputs.append(self._step(columns[rows], g[rows], beta[rows], step.states, slot))
                for _, snapshot in sequence.captures:
                    self._copy_state(step.states, sequence.slot, snapshot)
            else:
                outputs.append(self._prefill(columns[rows], g[rows], beta[rows], step, index))
        return outputs

    def _prefill(
        self,
        columns: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        step: LinearStepContext,
        index: int,
    ) -> torch.Tensor:
        sequence = step.sequences[index]
        conv = step.states.conv[self.state_layer]
        recurrent = step.states.recurrent[self.state_layer]
        mixed, history = causal_conv(columns, conv[sequence.slot], self.conv1d.weight)
        q, k, v = self._heads(mixed)
        counts = [count for count, _ in sequence.captures]
        out, final, snapshots = chunked_delta_rule(
            q, k, v, g, beta, recurrent[sequence.slot], snapshots_at=counts
        )
        window = conv.shape[-1]
        for (count, snapshot_slot), snapshot in zip(sequence.captures, snapshots, strict=True):
            conv[snapshot_slot] = history[:, count : count + window]
            recurrent[snapshot_slot] = snapshot
        conv[sequence.slot] = history[:, -window:]
        recurrent[sequence.slot] = final
        return out

    def _step(
        self,
        columns: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: LinearStates,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """One token for each sequence of `slots`, gathered, advanced and scattered back."""
        conv, recurrent = states.conv[self.state_layer], states.recurrent[self.state_layer]
        mixed, conv_state = causal_conv_step(columns, conv[slots], self.conv1d.weight)
        conv.index_copy_(0, slots, conv_state)
        q, k, v = self._heads(mixed)
        if _kernel_steps(recurrent):
            kernel = torch.ops.iris_gdn.gated_delta_decode
            inputs = (x.contiguous() for x in (q, k, v, g, beta))
            return kernel(*inputs, recurrent, slots)
        out, state = recurrent_delta_step(q, k, v, g, beta, recurrent[slots])
        recurrent.index_copy_(0, slots, state)
        return out

    def _fused_step(
        self,
        columns: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        states: LinearStates,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """`_step` with g and β, from the projections to the output, in one kernel call."""
        kernel = torch.ops.iris_gdn.gated_delta_decode_step
        conv, recurrent = states.conv[self.state_layer], states.recurrent[self.state_layer]
        return kernel(
            columns, a, b, conv, self.conv1d.weight, self.A_log, self.dt_bias, recurrent, slots,
            self.num_key_heads, self.key_head_dim,
        )  # fmt: skip

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output `[N, C]` -> fp32 q, k `[N, value heads, Dk]` (normalised, q
        scaled, each key head repeated for the value heads it serves) and v."""
        n = mixed.shape[0]
        q, k, v = mixed.float().split(self.channel_sizes, dim=-1)
        group = self.num_value_heads // self.num_key_heads
        heads = (n, self.num_key_heads, group, self.key_head_dim)  # key head i serves group i
        q, k = (
            l2_normalized(x.view(n, self.num_key_heads, 1, self.key_head_dim))
            .expand(heads)
            .reshape(n, self.num_value_heads, self.key_head_dim)
            for x in (q, k)
        )
        return q * self.key_head_dim**-0.5, k, v.view(n, self.num_value_heads, -1)

    def _copy_state(self, states: LinearStates, source: int, target: int) -> None:
        """This layer's state of slot `source` into slot `target` (a capture after a
        sequence's only token of the step)."""
        states.conv[self.state_layer, target] = states.conv[self.state_layer, source]
        states.recurrent[self.state_layer, target] = states.recurrent[self.state_layer, source]
