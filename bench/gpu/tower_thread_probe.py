"""Why one vision-tower call takes ~6x longer through the encoder thread on CUDA.

Times one tower call for one image, with no step running, in the ways it can be made:
the caller's thread or another, the default stream or a side one, a new thread per
call or one kept alive; then profiles one slow call.

    python -m bench.gpu.tower_thread_probe --model DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import threading
import time
from collections.abc import Callable

import torch

from bench.encoder_overlap import make_prompts
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.engine import Engine
from iris_serve.tokenizer_worker.prompt import PromptBuilder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    builder = PromptBuilder(args.model)
    prompt = make_prompts(builder, 1, 7, (1280, 720), 32)[0]
    engine = Engine(
        EngineConfig(model=args.model, device=args.device, mm_encoder_placement="thread")
    )
    tower = engine.tower
    device = engine.device
    pixels = [prompt.pixels[0].to(device)]
    grids = [prompt.prompt.images[0].grid_thw]
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def call(stream: torch.cuda.Stream | None) -> None:
        with torch.inference_mode():
            if stream is None:
                tower(pixels, grids)
            else:
                with torch.cuda.stream(stream):
                    tower(pixels, grids)
        sync()

    def in_new_thread(work: Callable[[], None]) -> None:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()

    def timed(label: str, run: Callable[[], None]) -> None:
        times = []
        for _ in range(args.reps):
            sync()
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) * 1e3)
        print(f"{label:48s} " + " ".join(f"{t:7.1f}" for t in times), flush=True)

    timed("caller thread, default stream", lambda: call(None))
    timed("caller thread, side stream", lambda: call(side))
    timed("new thread per call, default stream", lambda: in_new_thread(lambda: call(None)))
    timed("new thread per call, side stream", lambda: in_new_thread(lambda: call(side)))

    persistent: list[float] = []

    def kept_alive() -> None:
        for _ in range(args.reps):
            started = time.perf_counter()
            call(side)
            persistent.append((time.perf_counter() - started) * 1e3)

    in_new_thread(kept_alive)
    print(
        f"{'one thread kept alive, side stream':48s} " + " ".join(f"{t:7.1f}" for t in persistent)
    )
    executor = engine.encoder_executor
    assert executor.placement == "thread"
    timed("EncoderThread.submit", lambda: executor.submit(pixels, grids).result())

    def profiled() -> None:
        profile = cProfile.Profile()
        profile.enable()
        call(side)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
            + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        ) as prof:
            call(side)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

    in_new_thread(profiled)
    engine.close()


if __name__ == "__main__":
    main()
