"""Deterministic benchmark videos: clips of a synthetic screen recording, MP4 bytes written
with OpenCV at run time.

A `Recording` is a desktop drawn frame by frame from its index alone: a plain background,
a few windows with lines of "text", one window dragged across the screen, a line being
typed, a cursor on a looping path and a clock in the taskbar. Frame `i` is the same
picture in every clip that holds it, and clips of one recording overlap where their spans
do. Mostly flat colour that moves little, it compresses like a screen recording, not like
noise, so a clip fits in a data: URL that every server receives byte for byte.

The clips are MPEG-4 part 2 (`mp4v`) in MP4, what OpenCV's FFmpeg writes everywhere
without extra codecs, and what Iris's worker and vLLM's loader both read.
"""

from __future__ import annotations

import base64
import functools
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

CODEC = "mp4v"
MIME = "video/mp4"
WINDOWS = 3  # static windows; one more is dragged across the screen


@dataclass(frozen=True)
class Recording:
    """A synthetic screen recording: `width`×`height` pixels at `fps`; `seed` picks its
    colours and layout (a different seed, a different recording)."""

    width: int
    height: int
    fps: float
    seed: int

    def frame(self, index: int) -> np.ndarray:
        """Frame `index` (BGR uint8 [height, width, 3], OpenCV's order)."""
        layout = _layout(self)
        w, h, t = self.width, self.height, index / self.fps
        canvas = np.empty((h, w, 3), np.uint8)
        canvas[:] = layout.background
        for box, colour in layout.windows:
            _window(canvas, box, colour)
        x, y, ww, wh = layout.dragged
        x = int((x + 0.08 * w * t) % (w - ww))  # dragged right, wrapping around
        _window(canvas, (x, y, ww, wh), layout.dragged_colour)
        # a line being typed in the first window, a character every 0.1 s
        (x0, y0, bw, _), _ = layout.windows[0]
        typed = int(10 * t) % 40
        cv2.rectangle(
            canvas, (x0 + 6, y0 + 20), (x0 + 6 + typed * bw // 48, y0 + 26), (40, 40, 40), -1
        )
        # the taskbar and its clock
        bar = h - max(8, h // 16)
        canvas[bar:] = (48, 48, 48)
        scale = max(0.25, h / 720)
        cv2.putText(canvas, f"{t:6.1f} s", (w - int(200 * scale), h - 3), cv2.FONT_HERSHEY_SIMPLEX,
                    scale, (255, 255, 255), 1, cv2.LINE_AA)  # fmt: skip
        # the cursor, on a loop across the screen
        cx = int(w * (0.5 + 0.4 * math.sin(0.7 * t + layout.phase)))
        cy = int(bar * (0.5 + 0.4 * math.sin(1.1 * t)))
        size = max(4, h // 30)
        arrow = np.array([[cx, cy], [cx, cy + 2 * size], [cx + size, cy + 3 * size // 2]])
        cv2.fillPoly(canvas, [arrow], (255, 255, 255))
        cv2.polylines(canvas, [arrow], True, (0, 0, 0), 1)
        return canvas


@dataclass(frozen=True)
class _Layout:
    background: tuple[int, int, int]
    windows: tuple[tuple[tuple[int, int, int, int], tuple[int, int, int]], ...]
    dragged: tuple[int, int, int, int]  # x, y, width, height at time 0
    dragged_colour: tuple[int, int, int]
    phase: float


@functools.lru_cache(maxsize=16)
def _layout(recording: Recording) -> _Layout:
    rng = np.random.default_rng([recording.width, recording.height, recording.seed])
    w, h = recording.width, recording.height

    def colour() -> tuple[int, int, int]:
        return tuple(int(c) for c in rng.integers(40, 220, 3))  # type: ignore[return-value]

    def box() -> tuple[int, int, int, int]:
        width, height = int(rng.integers(w // 4, w // 2)), int(rng.integers(h // 4, h // 2))
        return (
            int(rng.integers(0, w - width)),
            int(rng.integers(0, h * 3 // 4 - height)),
            width,
            height,
        )

    windows = tuple((box(), colour()) for _ in range(WINDOWS))
    return _Layout(colour(), windows, box(), colour(), float(rng.uniform(0, math.tau)))


def _window(
    canvas: np.ndarray, box: tuple[int, int, int, int], colour: tuple[int, int, int]
) -> None:
    """A window: a white body, a title bar of `colour`, grey lines of text."""
    x, y, width, height = box
    cv2.rectangle(canvas, (x, y), (x + width, y + height), (250, 250, 250), -1)
    cv2.rectangle(canvas, (x, y), (x + width, y + 12), colour, -1)
    for line in range(y + 34, y + height - 6, 10):
        length = width * (3 + (line * 7 + x) % 5) // 8
        cv2.rectangle(
            canvas, (x + 6, line), (x + min(length, width - 6), line + 3), (170, 170, 170), -1
        )
    cv2.rectangle(canvas, (x, y), (x + width, y + height), (90, 90, 90), 1)


@functools.lru_cache(maxsize=16)
def clip_bytes(recording: Recording, start: float, end: float) -> bytes:
    """The recording's frames from second `start` (included) to `end` (excluded) as MP4
    bytes, at the recording's rate; the same bytes for the same arguments."""
    first, stop = round(start * recording.fps), round(end * recording.fps)
    if stop - first < 1:
        raise ValueError(f"the span {start}-{end} s holds no frame at {recording.fps} fps")
    with tempfile.TemporaryDirectory(prefix="bench-video-") as folder:
        path = Path(folder) / "clip.mp4"
        size = (recording.width, recording.height)
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*CODEC), recording.fps, size)
        if not writer.isOpened():
            raise RuntimeError(f"OpenCV cannot write {CODEC} video here")
        try:
            for index in range(first, stop):
                writer.write(recording.frame(index))
        finally:
            writer.release()
        return path.read_bytes()


def video_part(data: bytes) -> dict:
    """An OpenAI chat content part (vLLM's `video_url`) holding the video as a data: URL."""
    url = f"data:{MIME};base64,{base64.b64encode(data).decode('ascii')}"
    return {"type": "video_url", "video_url": {"url": url}}
