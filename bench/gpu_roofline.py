"""Iris against the device's own limits: measured bandwidth and matmul rate, then decode,
prefill and ViT throughput, each as a fraction of its roofline.

    python -m bench.gpu_roofline [--model DIR | --size small --arch ARCH] [--device auto]
        [--dtype auto] [--batches 1 8 64 256] [--context 2048] [--quick] [--out DIR]

Written for a GPU (`iris tiny-model --like Qwen2.5-VL-7B-Instruct` makes the real-size
checkpoint to point `--model` at; without it, the generated checkpoint of `--arch`, Qwen2.5-VL
by default, and `--size`); it runs on a CPU too, where the same fractions say how far the
CPU path is from the machine's memory bandwidth.

- bandwidth: a device-to-device copy of a large buffer, bytes read + written per second;
- matmul rate: a square matmul in the model's dtype, 2·n³ FLOPs per call;
- decode at each batch size, `context` tokens each (the requests share one prompt, so
  setting up 256 × 2k costs one prefill; attention still reads each context on its own):
  the roofline step reads every weight once and each sequence's K/V, so
  `roofline ms = (weight bytes + batch × context × KV bytes per token) / bandwidth`, and
  the fraction is roofline ms ÷ measured ms (1.0 = at the bandwidth limit);
- prefill: one `context`-token prompt, `2 × parameters × tokens` FLOPs (attention left
  out) ÷ the matmul rate;
- ViT: one 1280×720 and one 1920×1080 image through the vision tower, `2 × vision
  parameters × patches` FLOPs ÷ the matmul rate;
- on CUDA, decode with the CUDA graphs captured at start-up against the same engine's
  eager steps (`--enforce-eager`'s path, its graphs set aside), batch by batch.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_model_argument,
    markdown_table,
    write_result,
)
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler import Engine, EngineConfig


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_decoding(engine: Engine, context: int, batch: int, steps: int) -> None:
    """`batch` requests sharing one `context`-token prompt, all past their prefill."""
    vocab = engine.model.config.vocab_size
    prompt = PromptInput.text([(7 * i + 3) % (vocab - 1) + 1 for i in range(context)])
    params = Sampling(temperature=0.0, max_tokens=2 * steps + 4, ignore_eos=True)
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


def measured_matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, device, 5)


def decode_row(engine: Engine, context: int, batch: int, steps: int, bandwidth: float) -> list:
    start_decoding(engine, context, batch, steps)
    synchronize(engine.device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(engine.device)
    step = (time.perf_counter() - started) / steps
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = engine.kv_cache.layout.bytes_per_page / engine.kv_cache.page_size
    roofline = (weights + batch * context * kv) / bandwidth
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return [f"decode, batch {batch} × {context}", step * 1e3, roofline * 1e3, batch / step,
            roofline / step]  # fmt: skip


def graphs_against_eager(
    engine: Engine, args: argparse.Namespace, bandwidth: float, graph_ms: list[float]
) -> list[list]:
    """The decode rows again with the engine's graphs set aside: eager steps, same engine."""
    graphs = engine.runner.decode_graphs
    if graphs is None:
        return []
    engine.runner.decode_graphs = None
    try:
        eager_ms = [
            decode_row(engine, args.context, b, args.steps, bandwidth)[1] for b in args.batches
        ]
    finally:
        engine.runner.decode_graphs = graphs
    return [
        [f"{batch} × {args.context}", graphs_step, eager_step, eager_step / graphs_step]
        for batch, graphs_step, eager_step in zip(args.batches, graph_ms, eager_ms, strict=True)
    ]


def prefill_row(engine: Engine, tokens: int, matmul_rate: float) -> list:
    vocab = engine.model.config.vocab_size
    prompt = PromptInput.text([(11 * i + 5) % (vocab - 1) + 1 for i in range(tokens)])
    params = sum(p.numel() for p in engine.model.model.parameters())

    def prefill() -> None:
        engine.generate([prompt], Sampling(temperature=0.0, max_tokens=1, ignore_eos=True))

    seconds = seconds_per_call(prefill, engine.device, 2)
    roofline = 2 * params * tokens / matmul_rate
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
    params = sum(p.numel() for p in engine.model.visual.parameters())
    with torch.inference_mode():
        seconds = seconds_per_call(
            lambda: engine.model.encode_images(pixels, grid), engine.device, 3
        )
    roofline = 2 * params * pixels.shape[0] / matmul_rate
    return [f"ViT, one {size[0]}×{size[1]} image ({pixels.shape[0]} patches)", seconds * 1e3,
            roofline * 1e3, 1 / seconds, roofline / seconds]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_argument(parser)
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    add_arch_argument(parser)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.batches, args.context, args.steps = "tiny", [1, 2], 64, 2
    checkpoint = Checkpoint.of(args)
    model_dir = checkpoint.model_dir
    engine = Engine(
        EngineConfig(
            model=str(model_dir), device=args.device, dtype=args.dtype,
            max_model_len=args.context + 4 * args.steps + 64, max_num_seqs=max(args.batches),
        )
    )  # fmt: skip
    device = engine.device
    on_gpu = device.type == "cuda"
    bandwidth = measured_bandwidth(device, (1 << 30) if on_gpu else (256 << 20))
    matmul_rate = measured_matmul_rate(device, engine.dtype, 8192 if on_gpu else 1024)
    rows = [decode_row(engine, args.context, b, args.steps, bandwidth) for b in args.batches]
    graph_rows = graphs_against_eager(engine, args, bandwidth, [row[1] for row in rows])
    rows.append(prefill_row(engine, args.context, matmul_rate))
    for size in [(1280, 720), (1920, 1080)]:
        rows.append(vit_row(engine, model_dir, size, matmul_rate))
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    moe = engine.model.config.moe
    body = (
        f"{checkpoint.sentence} {engine.dtype} "
        f"on {name}: measured bandwidth {bandwidth / 1e9:.1f} GB/s (copy), matmul rate "
        f"{matmul_rate / 1e12:.2f} TFLOP/s ({engine.dtype}). Decode steps: {args.steps} per "
        "point."
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
    suffix = "_quick" if args.quick else ""
    write_result(f"roofline_{label}_{checkpoint.label}{suffix}", "Iris against the device's limits",
                 body, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
