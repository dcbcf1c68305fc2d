"""What one Qwen3-VL-MoE layer's experts cost, per way of running them, at real shapes.

One MoE MLP of Qwen3-VL-30B-A3B (128 experts, top-8, hidden 2048, expert width 768) on
random weights, for a decode-sized to a prefill-sized number of tokens. Variants, side by
side on the same router decisions and weights:

- `grouped_mm`: Iris's block (tokens sorted by expert, two `F.grouped_mm` calls, no sync);
- `expert loop`: Iris's fallback where grouped_mm cannot run (a matmul pair per expert
  that received tokens, after one `.tolist()`);
- `hf eager`: transformers 5's `Qwen3VLMoeTextSparseMoeBlock` with eager experts (a loop
  over the experts hit, `torch.where` per expert);
- `all experts`: what transformers 4.57 ran at eval (every expert on every token, weighted
  by a dense routing matrix); only up to `--dense-max-tokens` tokens, it is E/k times the
  work;
- `dense k*I`: a dense SwiGLU MLP of width top_k * expert width (6144), the same FLOPs as
  the routed experts: the floor a perfect MoE kernel would approach on a CPU.

    python -m bench.moe_block                      # fp32, 1..2048 tokens
    python -m bench.moe_block --quick              # a smoke test at toy shapes
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.results_io import markdown_table, write_result

# Qwen3-VL-30B-A3B's text config (shared/notes/qwen3-vl-moe.md, section 4)
A3B = dict(num_experts=128, top_k=8, hidden=2048, expert_width=768)
QUICK = dict(num_experts=8, top_k=2, hidden=64, expert_width=24)


def _time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _blocks(shape: dict[str, int], dtype: torch.dtype):
    """Iris's block and transformers' block sharing one set of random weights."""
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextSparseMoeBlock,
    )

    from iris_serve.scheduler.models.config import MoEConfig
    from iris_serve.scheduler.models.moe import SparseMoEBlock

    moe = MoEConfig(shape["num_experts"], shape["top_k"], shape["expert_width"], 1, ())
    ours = SparseMoEBlock(shape["hidden"], moe).to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in ours.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    config = Qwen3VLMoeTextConfig(
        hidden_size=shape["hidden"],
        num_experts=shape["num_experts"],
        num_experts_per_tok=shape["top_k"],
        moe_intermediate_size=shape["expert_width"],
    )
    config._experts_implementation = "eager"
    with torch.device("meta"):
        hf = Qwen3VLMoeTextSparseMoeBlock(config)
    hf.gate.weight = ours.gate.weight  # shared, not copied: one set of weights in memory
    hf.experts.gate_up_proj = ours.experts.gate_up_proj
    hf.experts.down_proj = ours.experts.down_proj
    return ours.eval(), hf.eval()


def _all_experts(block, x: torch.Tensor) -> torch.Tensor:
    """transformers 4.57's eval path: every expert on every token, dense routing weights."""
    from iris_serve.scheduler.models.moe import route

    weights, experts = route(block.gate(x), block.top_k)
    dense = torch.zeros(x.shape[0], block.experts.num_experts, dtype=x.dtype)
    dense.scatter_(1, experts, weights)
    gate, up = torch.matmul(x, block.experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.matmul(F.silu(gate) * up, block.experts.down_proj.transpose(1, 2))
    return (out * dense.T[:, :, None]).sum(0)


@torch.no_grad()
def run(shape: dict[str, int], tokens: list[int], dtype: torch.dtype, dense_max: int) -> str:
    from iris_serve.scheduler.models import moe

    ours, hf = _blocks(shape, dtype)
    width = shape["top_k"] * shape["expert_width"]
    generator = torch.Generator().manual_seed(1)
    w_gate_up = torch.randn(2 * width, shape["hidden"], generator=generator).to(dtype)
    w_down = torch.randn(shape["hidden"], width, generator=generator).to(dtype)

    def dense(x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w_down)

    def expert_loop(x: torch.Tensor) -> torch.Tensor:
        works = moe._grouped_mm_works
        moe._grouped_mm_works = lambda *_: False  # type: ignore[assignment]
        try:
            return ours(x)
        finally:
            moe._grouped_mm_works = works

    expert_bytes = 3 * shape["hidden"] * shape["expert_width"] * torch.finfo(dtype).bits // 8
    rows = []
    for n in tokens:
        x = torch.randn(n, shape["hidden"], generator=generator).to(dtype)
        repeats = 5 if n <= 64 else 3
        active = int(torch.unique(moe.route(ours.gate(x), ours.top_k)[1]).numel())
        grouped = _time_ms(lambda x=x: ours(x), repeats)
        loop = _time_ms(lambda x=x: expert_loop(x), repeats)
        eager = _time_ms(lambda x=x: hf(x[None]), repeats)
        all_experts = (
            _time_ms(lambda x=x: _all_experts(ours, x), repeats) if n <= dense_max else None
        )
        floor = _time_ms(lambda x=x: dense(x), repeats)
        weight_mb = active * expert_bytes / 1e6
        rows.append(
            [
                n,
                active,
                f"{weight_mb:.0f}",
                f"{weight_mb / grouped:.1f}",
                grouped,
                loop,
                eager,
                "-" if all_experts is None else all_experts,
                floor,
                f"{eager / grouped:.2f}x",
                f"{grouped / floor:.2f}x",
            ]
        )
    header = [
        "tokens",
        "experts hit",
        "their weights MB",
        "grouped_mm GB/s",
        "grouped_mm ms",
        "expert loop ms",
        "hf eager ms",
        "all experts ms",
        f"dense {width} ms",
        "hf eager / grouped_mm",
        "grouped_mm / dense",
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy shapes, two token counts")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dense-max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="results folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else A3B
    tokens = [1, 16] if args.quick else [1, 8, 64, 512, 2048]
    table = run(shape, tokens, getattr(torch, args.dtype), args.dense_max_tokens)
    body = (
        f"One MoE MLP, {shape['num_experts']} experts, top-{shape['top_k']}, hidden "
        f"{shape['hidden']}, expert width {shape['expert_width']}, {args.dtype}, "
        f"{args.threads} threads; median of 3-5 calls after a warm-up. Every expert a token "
        "routes to has its weights read once per call, so `their weights MB` / time is the "
        "bandwidth the call reached; `dense` reads only top_k experts' worth whatever the "
        f"number of tokens.\n\n{table}"
    )
    name = "moe_block_quick" if args.quick else f"moe_block_a3b_{args.dtype}"
    from pathlib import Path

    write_result(name, "Qwen3-VL-MoE expert MLP: cost per way of running it", body,
                 Path(args.out) if args.out else None)  # fmt: skip


if __name__ == "__main__":
    main()
