"""How fast one tokenizer worker turns a benchmark clip into the frames of its temporal
patches, measured in this process with Iris's own video functions.

A worker decodes every frame of a video up to the last one its model samples (a compressed
frame depends on those before it), converts the sampled ones to RGB and resizes each as
the model's video processor does (`tokenizer_worker.video_decode.open_video`,
`video_rules.plan_video` and `resize_frame`, what `VideoLoader` calls). Workers decode side
by side, one process each with one torch thread and one FFmpeg thread by default; this
measures one, the same way, after the servers have stopped, so nothing else runs on the
cores. Hashing and storing the patches in the arena are left out: they are the image path's
costs, measured by the image workloads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.video_scenario import VideoWorkload
from iris_serve.tokenizer_worker import (
    VideoProcessorSettings,
    open_video,
    plan_video,
    resize_frame,
)

WORKER_THREADS = 1  # a tokenizer worker's torch threads and FFmpeg threads (their defaults)


@dataclass(frozen=True)
class DecodeRate:
    """One clip through one worker's decoding and resizing: what it holds, what the
    model's rules make of it, and the median seconds of each step over the repeats."""

    workload: str
    span: str
    mp4_bytes: int
    seconds: float  # of video
    frames: int  # in the file
    decoded: int  # up to the last sampled frame
    sampled: int
    size: tuple[int, int]  # width, height in the file
    resized: tuple[int, int]  # width, height after resizing
    decode_s: float
    resize_s: float
    repeats: int

    @property
    def total_s(self) -> float:
        return self.decode_s + self.resize_s


def measure(model_dir: Path, workload: str, span: str, data: bytes, repeats: int) -> DecodeRate:
    """Decodes and resizes the clip `data` as a worker serving `model_dir` does, `repeats`
    times (each from the bytes: a worker keeps no decoder state between videos)."""
    settings = VideoProcessorSettings.from_checkpoint(model_dir)
    if settings is None:
        raise ValueError(f"{model_dir} is no video model")
    with open_video(data, WORKER_THREADS) as video:
        header = video.header
    plan = plan_video(settings, header.num_frames, header.fps, header.height, header.width)
    decode, resize = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            with open_video(data, WORKER_THREADS) as video:
                frames = list(video.frames(plan.indices))
            decoded = time.perf_counter()
            for frame in frames:
                resize_frame(frame, plan.height, plan.width)
            decode.append(decoded - started)
            resize.append(time.perf_counter() - decoded)
    finally:
        torch.set_num_threads(threads)
    return DecodeRate(
        workload=workload,
        span=span,
        mp4_bytes=len(data),
        seconds=header.num_frames / (header.fps or 1.0),
        frames=header.num_frames,
        decoded=plan.indices[-1] + 1,
        sampled=len(plan.indices),
        size=(header.width, header.height),
        resized=(plan.width, plan.height),
        decode_s=statistics.median(decode),
        resize_s=statistics.median(resize),
        repeats=repeats,
    )


def decode_rates(
    model_dir: Path, workloads: Sequence[tuple[VideoWorkload, int]], repeats: int
) -> list[DecodeRate]:
    """`measure` on the first clip of each (workload, seed of its recording)."""
    rates = []
    for workload, seed in workloads:
        span, data = workload.clips(seed)[0]
        rates.append(measure(model_dir, workload.name, span, data, repeats))
    return rates
