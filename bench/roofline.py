"""Iris against the device's own limits: the machine's measured bandwidth and matmul
rates, then decode, prefill and ViT throughput, each as a fraction of its roofline, and a
served returning agent's TTFT split into the parts the bound counts and the rest.

    python -m bench.roofline [--model DIR | --size small --arch ARCH] [--device auto]
        [--dtype auto] [--batches 1 8] [--contexts 1024 4096] [--quick] [--out DIR]

On a GPU point `--model` at a real-size checkpoint (`iris tiny-model --like
Qwen2.5-VL-7B-Instruct`); without it, the generated checkpoint of `--arch`, Qwen2.5-VL by
default, and `--size`. On a CPU the machine is measured at the torch thread count the
server uses (the process's, as `iris serve` sets it).

- bandwidth: reading a large buffer (a sum: what decode does with weights and KV), and a
  device-to-device copy (bytes read + written per second);
- matmul rate: a square matmul in float32 and in bfloat16, 2·n³ FLOPs per call;
- decode at each context and batch size, the best of three windows of `--steps` steps (the
  requests share one prompt, so setting up 256 × 2k costs one prefill; attention still
  reads each context on its own): the roofline step reads every weight once and each
  sequence's K/V, so `roofline ms = (weight bytes + batch × context × KV bytes per token)
  / read bandwidth`, and the fraction is roofline ms ÷ measured ms (1.0 = at the bandwidth
  limit);
- prefill: one prompt of the largest context, `2 × parameters × tokens` FLOPs plus its
  attention's (QKᵀ and PV over the causal pairs, `bench.attention_flops`) ÷ the matmul
  rate in the model's dtype;
- ViT: one 1280×720 and one 1920×1080 image through the vision tower, `2 × vision
  parameters × patches` FLOPs plus its attention's ÷ the matmul rate;
- a returning agent's turns on `iris serve` (same checkpoint and dtype), one at a time:
  TTFT against its new screenshot's tower plus the steps that prefilled its new tokens,
  by the server's own clocks (`bench.agent_turn_split`);
- on CUDA, decode with the CUDA graphs captured at start-up against the same engine's
  eager steps (`--enforce-eager`'s path, its graphs set aside), batch by batch.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.agent_turn_split import TurnSplit, agent_turns
from bench.attention_flops import AttentionFlops
from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_model_argument,
    markdown_table,
    write_result,
)
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler import Engine, EngineConfig, decode_weight_bytes, matmul_weights


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_decoding(engine: Engine, context: int, batch: int, steps: int) -> None:
    """`batch` requests sharing one `context`-token prompt, all past their prefill."""
    vocab = engine.model.config.vocab_size
    prompt = PromptInput.text([(7 * i + 3) % (vocab - 1) + 1 for i in range(context)])
    params = Sampling(temperature=0.0, max_tokens=(DECODE_WINDOWS + 1) * steps + 4, ignore_eos=True)
    engine.add_request("r0", prompt, params)
    while not engine.step():  # the first prefill, chunk by chunk, until it samples
        pass
    for i in range(1, batch):
        engine.add_request(f"r{i}", prompt, params)
    while engine.planner.waiting or any(
        len(r.output_token_ids) == 0 for r in engine.requests.values()
    ):
        engine.step()


def seconds_per_call(call: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Best of `repeat` timed calls, after one warm-up."""
    call()
    synchronize(device)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def measured_bandwidth(device: torch.device, num_bytes: int) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    return 2 * num_bytes / seconds_per_call(lambda: target.copy_(source), device, 5)


def measured_read_bandwidth(device: torch.device, num_bytes: int) -> float:
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    return num_bytes / seconds_per_call(lambda: source.sum(), device, 5)


def measured_matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, device, 5)


def decode_row(engine: Engine, context: int, batch: int, steps: int, bandwidth: float) -> list:
    start_decoding(engine, context, batch, steps)
    step = float("inf")
    for _ in range(DECODE_WINDOWS):  # the best window: another process's burst is not ours
        synchronize(engine.device)
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)
        step = min(step, (time.perf_counter() - started) / steps)
    weights = decode_weight_bytes(engine.model)
    kv = engine.kv_cache.layout.bytes_per_page / engine.kv_cache.page_size
    roofline = (weights + batch * context * kv) / bandwidth
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return [f"decode, batch {batch} × {context}", step * 1e3, roofline * 1e3, batch / step,
            roofline / step]  # fmt: skip


def graphs_against_eager(
    engine: Engine, points: list[tuple[int, int]], args: argparse.Namespace, bandwidth: float,
    graph_ms: list[float],
) -> list[list]:  # fmt: skip
    """The decode rows again with the engine's graphs set aside: eager steps, same engine."""
    graphs = engine.runner.decode_graphs
    if graphs is None:
        return []
    engine.runner.decode_graphs = None
    try:
        eager_ms = [decode_row(engine, c, b, args.steps, bandwidth)[1] for c, b in points]
    finally:
        engine.runner.decode_graphs = graphs
    return [
        [f"{batch} × {context}", graphs_step, eager_step, eager_step / graphs_step]
        for (context, batch), graphs_step, eager_step in zip(
            points, graph_ms, eager_ms, strict=True
        )
    ]


def prefill_row(engine: Engine, tokens: int, matmul_rate: float) -> list:
    vocab = engine.model.config.vocab_size
    params = matmul_weights(engine.model.model)
    calls = itertools.count()

    def prefill() -> None:  # a prompt of its own each call: nothing found in the prefix cache
        first = next(calls)
        prompt = PromptInput.text([(11 * i + 5 + first) % (vocab - 1) + 1 for i in range(tokens)])
        engine.generate([prompt], Sampling(temperature=0.0, max_tokens=1, ignore_eos=True))

    seconds = seconds_per_call(prefill, engine.device, 2)
    with AttentionFlops() as attention:  # untimed: the mode sees every op
        prefill()
    roofline = (2 * params * tokens + attention.flops) / matmul_rate
    return [f"prefill, {tokens} tokens", seconds * 1e3, roofline * 1e3, tokens / seconds,
            roofline / seconds]  # fmt: skip


def vit_row(engine: Engine, model_dir: Path, size: tuple[int, int], matmul_rate: float) -> list:
    import io

    from PIL import Image

    from bench.images import jpeg_bytes
    from iris_serve.tokenizer_worker import PromptBuilder

    builder = PromptBuilder(str(model_dir))
    content = [{"type": "image"}, {"type": "text", "text": "?"}]
    prompt = builder.build(
        builder.render_chat([{"role": "user", "content": content}]),
        [Image.open(io.BytesIO(jpeg_bytes(*size, seed=7)))],
    )
    pixels = engine.patches([prompt.pixels[0]], [prompt.images[0].grid_thw])
    grid = torch.tensor([prompt.images[0].grid_thw])
    params = matmul_weights(engine.model.visual)
    with torch.inference_mode():
        seconds = seconds_per_call(
            lambda: engine.model.encode_images(pixels, grid), engine.device, 3
        )
        with AttentionFlops() as attention:
            engine.model.encode_images(pixels, grid)
    roofline = (2 * params * pixels.shape[0] + attention.flops) / matmul_rate
    return [f"ViT, one {size[0]}×{size[1]} image ({pixels.shape[0]} patches)", seconds * 1e3,
            roofline * 1e3, 1 / seconds, roofline / seconds]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_argument(parser)
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    add_arch_argument(parser)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", type=int, nargs="+", help="(CUDA 1 8 64 256; CPU 1 8)")
    parser.add_argument("--contexts", type=int, nargs="+", help="(CUDA 2048; CPU 1024 4096)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--agent-turns", type=int, default=5, help="0: no served agent")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.batches, args.contexts, args.steps = "tiny", [1, 2], [64], 2
        args.agent_turns = 2
    checkpoint = Checkpoint.of(args)
    model_dir = checkpoint.model_dir
    engine = Engine(
        EngineConfig(
            model=str(model_dir), device=args.device, dtype=args.dtype,
            max_model_len=max(args.contexts or [4096]) + (DECODE_WINDOWS + 2) * args.steps + 64,
            max_num_seqs=max(args.batches or [256]),
        )
    )  # fmt: skip
    device = engine.device
    on_gpu = device.type == "cuda"
    batches = args.batches or ([1, 8, 64, 256] if on_gpu else [1, 8])
    contexts = args.contexts or ([2048] if on_gpu else [1024, 4096])
    buffer = (1 << 30) if on_gpu else (512 << 20)
    read_bandwidth = measured_read_bandwidth(device, buffer)
    copy_bandwidth = measured_bandwidth(device, buffer // 2)
    side = 8192 if on_gpu else 2048
    rates = {dtype: measured_matmul_rate(device, dtype, side) for dtype in GEMM_DTYPES}
    matmul_rate = rates.get(engine.dtype) or measured_matmul_rate(device, engine.dtype, side)
    points = [(context, batch) for context in contexts for batch in batches]
    rows = [decode_row(engine, c, b, args.steps, read_bandwidth) for c, b in points]
    graph_rows = graphs_against_eager(engine, points, args, read_bandwidth, [r[1] for r in rows])
    rows.append(prefill_row(engine, max(contexts), matmul_rate))
    for size in [(1280, 720), (1920, 1080)]:
        rows.append(vit_row(engine, model_dir, size, matmul_rate))
    dtype, threads, moe = engine.dtype, torch.get_num_threads(), engine.model.config.moe
    engine.close()
    del engine  # its memory back before the server starts
    turns = served_turns(model_dir, args, dtype) if args.agent_turns > 1 else []
    agent = agent_table(turns, args, dtype) if turns else ""
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU, {threads} torch threads"
    measured_rates = ", ".join(f"{rate / 1e12:.3g} TFLOP/s in {str(d).removeprefix('torch.')}"
                               for d, rate in rates.items())  # fmt: skip
    body = (
        f"{checkpoint.sentence} {dtype} on {name}: read bandwidth {read_bandwidth / 1e9:.1f} "
        f"GB/s (a sum), copy {copy_bandwidth / 1e9:.1f} GB/s; matmul rate ({side}² matmul) "
        f"{measured_rates}. Decode rooflines use the read bandwidth; prefill and ViT the "
        f"matmul rate in {dtype}, over their weights' and their attention's FLOPs. Decode "
        f"steps: the best of {DECODE_WINDOWS} windows of {args.steps} steps per point."
        + (
            f" Mixture of experts ({moe.top_k} of {moe.num_experts} experts per token): the "
            "rooflines count every expert (weight bytes in decode, 2 × parameters × tokens "
            "in prefill), so the fractions run high in prefill, and in decode where a step's "
            "tokens hit fewer experts than all."
            if moe
            else ""
        )
        + "\n\n"
        + markdown_table(
            ["what", "measured ms", "roofline ms", "per second", "fraction of roofline"], rows
        )
        + agent
        + "\n\n## Decode: CUDA graphs against eager steps\n\n"
        + (
            markdown_table(
                ["batch × context", "graphs ms", "eager ms", "eager ÷ graphs"], graph_rows
            )
            if graph_rows
            else "Measured on CUDA, with graphs (not under --enforce-eager) only."
        )
    )
    label = "gpu" if on_gpu else "cpu"
    # A dtype other than fp32 (`auto` on a CPU with native bf16) is its own result.
    suffix = "" if dtype == torch.float32 else "_" + DTYPE_NAMES.get(dtype, str(dtype))
    suffix += "_quick" if args.quick else ""
    written = write_result(f"roofline_{label}_{checkpoint.label}{suffix}",
                           "Iris against the device's limits", body, args.out)  # fmt: skip
    plot(rows, turns, written.with_suffix(".png"), f"{checkpoint.title}, {dtype} on {name}")


GEMM_DTYPES = (torch.float32, torch.bfloat16)
DECODE_WINDOWS = 3  # timed windows of `--steps` steps per decode point
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def served_turns(model_dir: Path, args: argparse.Namespace, dtype: torch.dtype) -> list[TurnSplit]:
    """A served agent's returning turns (`bench.agent_turn_split`)."""
    return agent_turns(model_dir, agent_flags(args, dtype), args.agent_turns, agent_image(args), 8)


def agent_flags(args: argparse.Namespace, dtype: torch.dtype) -> list[str]:
    return ["--device", args.device, "--dtype", str(dtype).removeprefix("torch.")]


def agent_image(args: argparse.Namespace) -> tuple[int, int]:
    return (448, 448) if args.quick else (1280, 720)


def agent_table(turns: list[TurnSplit], args: argparse.Namespace, dtype: torch.dtype) -> str:
    """The served agent's returning turns as a section."""
    size, flags = agent_image(args), agent_flags(args, dtype)
    rows = [
        [i + 2, t.new_tokens, t.ttft * 1e3, t.tower * 1e3, t.steps * 1e3, t.other * 1e3,
         t.over_bound, t.prefill * 1e3, t.queue * 1e3, t.server_ttft * 1e3]
        for i, t in enumerate(turns)
    ]  # fmt: skip
    header = ["turn", "new tokens", "TTFT ms", "tower ms", "prefill steps ms", "other ms",
              "TTFT ÷ (tower + steps)", "server prefill ms", "queue ms", "server TTFT ms"]  # fmt: skip
    return (
        f"\n\n## A returning agent's turn\n\nOne agent on `iris serve` ({' '.join(flags)}), "
        f"a new {size[0]}×{size[1]} screenshot each turn, its history cached; one turn at a "
        "time. `tower`: the vision tower on the new screenshot; `prefill steps`: the steps "
        "that computed its new tokens; `other`: TTFT less both (HTTP, tokenization and "
        "preprocessing, queueing, copies, the tower's wait when the steps cannot overlap "
        "it); `server prefill`: first step to first token; `server TTFT`: the request's "
        "arrival at the server to its first token.\n\n" + markdown_table(header, rows)
    )


def plot(rows: list[list], turns: list[TurnSplit], path: Path, title: str) -> None:
    """Each path's fraction of its roofline, and each returning turn's TTFT in parts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (paths, split) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=[3, 2])
    names = [str(row[0]).replace(", ", "\n", 1) for row in rows]
    paths.barh(names, [row[4] for row in rows], color="tab:blue")
    paths.axvline(1.0, color="grey", linestyle=":")
    paths.set_xscale("log")
    paths.invert_yaxis()
    paths.set_xlabel("fraction of roofline (1 = at the machine's limit)")
    paths.tick_params(axis="y", labelsize=7)
    paths.grid(alpha=0.3, axis="x")
    left = [0.0] * len(turns)
    labels = [f"turn {i + 2}" for i in range(len(turns))]
    for part, color in (("tower", "tab:orange"), ("steps", "tab:green"), ("other", "tab:red")):
        widths = [getattr(t, part) * 1e3 for t in turns]
        split.barh(labels, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    split.invert_yaxis()
    split.set_xlabel("a returning agent's TTFT, ms")
    split.legend(fontsize=8)
    split.grid(alpha=0.3, axis="x")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
