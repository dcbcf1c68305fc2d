"""What an image costs in the tokenizer worker and its arena: the processor's float32 rows
(the worker's output before issue 12) against the resized uint8 image (now), side by side.

Per image size (JPEGs from `bench.images`, the checkpoint's processor with Qwen2-VL's
published pixel bound, 12,845,056, so a 1920×1080 screenshot keeps its full size):

- worker ms: decode the JPEG and run the old path (`image_processor(...)`: convert,
  resize, rescale, normalise, patchify to float32) or the new one (convert and resize to
  uint8, `PromptBuilder.resize_image`): the CPU work of a processor-cache miss;
- arena bytes: what the image takes in shared memory (float32 rows, or uint8 [H, W, 3]);
- scheduler ms: the work moved to the scheduler, the uint8 image made into the
  processor's rows (`scheduler.patches`) on this machine's CPU (on a GPU, a gather).

The best of `--repeats` runs each, one torch / OpenMP thread (a worker's share).

    python -m bench.pixel_format [--size tiny|small] [--repeats N] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

from bench.images import jpeg_bytes
from bench.results_io import add_common_arguments, markdown_table, write_result
from iris_serve.scheduler.patches import PatchMaker
from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint
from iris_serve.tokenizer_worker.prompt import PromptBuilder

SIZES = [(1280, 720), (1920, 1080), (3840, 2160)]
PUBLISHED_MAX_PIXELS = 12_845_056  # Qwen2-VL / 2.5-VL's preprocessor_config.json


def best_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = builtin_checkpoint(size=args.size)
    builder = PromptBuilder(model_dir)
    processor = builder.image_processor
    patches = PatchMaker.from_checkpoint(model_dir, torch.device("cpu"), torch.float32)
    size = builder.image_size(max_pixels=PUBLISHED_MAX_PIXELS)
    bounds = {"shortest_edge": size[0], "longest_edge": size[1]}
    repeats = 1 if args.quick else args.repeats
    rows = []
    for width, height in SIZES[:1] if args.quick else SIZES:
        data = jpeg_bytes(width, height, seed=1)

        def decode(data: bytes = data) -> Image.Image:
            image = Image.open(io.BytesIO(data))
            image.load()
            return image

        def old() -> np.ndarray:
            out = processor(images=[decode()], size=bounds)
            return np.asarray(out["pixel_values"], dtype=np.float32)

        def new() -> tuple[np.ndarray, tuple[int, int, int]]:
            return builder.resize_image(decode(), size)

        rows_old, (pixels, grid) = old(), new()
        uint8 = torch.from_numpy(pixels.copy())
        made = patches([uint8], [grid])
        assert torch.equal(made, torch.from_numpy(rows_old)), "the two paths differ"
        old_ms, new_ms = best_ms(old, repeats), best_ms(new, repeats)
        scheduler_ms = best_ms(lambda u=uint8, g=grid: patches([u], [g]), repeats)
        rows.append([
            f"{width}×{height} → {pixels.shape[1]}×{pixels.shape[0]}",
            old_ms, new_ms, old_ms / new_ms,
            rows_old.nbytes, pixels.nbytes, rows_old.nbytes / pixels.nbytes, scheduler_ms,
        ])  # fmt: skip
    header = [
        "image (resized)", "worker ms, float32 rows (before)", "worker ms, uint8 (now)",
        "worker speed-up", "arena bytes before", "arena bytes now", "arena ratio",
        "scheduler ms to make the rows (CPU)",
    ]  # fmt: skip
    body = "\n".join([
        f"Generated Qwen2.5-VL `{args.size}` checkpoint's processor, max_pixels "
        f"{PUBLISHED_MAX_PIXELS}; best of {repeats}, 1 thread. Worker ms include the JPEG "
        "decode. Both paths were checked to give the same float32 rows (`torch.equal`).",
        "",
        markdown_table(header, rows),
    ])  # fmt: skip
    name = "pixel_format" + ("_quick" if args.quick else "")
    write_result(name, "Pixels in the worker: float32 rows vs uint8", body, args.out)


if __name__ == "__main__":
    main()
