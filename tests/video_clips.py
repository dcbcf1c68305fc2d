"""Tiny test videos, written with OpenCV (the decoder Iris uses) where the test runs.

Each frame has content of its own (noise from a per-frame seed, so that resizing has
something to average), and `recording` frames are the same whatever clip they end up in.
`mp4v` (MPEG-4 part 2 in MP4) is the everyday case; `MJPG` (Motion JPEG in AVI) codes
every frame on its own, so two clips of one recording decode their shared frames to the
same pixels.
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

import cv2
import numpy as np

FORMATS = {"mp4v": ".mp4", "MJPG": ".avi"}


def recording(num_frames: int, width: int = 64, height: int = 48) -> list[np.ndarray]:
    """`num_frames` distinct RGB frames uint8 [height, width, 3]."""
    return [
        np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        for index in range(num_frames)
    ]


def encode_clip(
    frames: list[np.ndarray], fps: float, codec: str = "mp4v", size: tuple[int, int] = (64, 48)
) -> bytes:
    """The frames (RGB) as an encoded video at `fps` (`size`: width, height of a video
    without frames)."""
    height, width = frames[0].shape[:2] if frames else size[::-1]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"clip{FORMATS[codec]}"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*codec), fps, (width, height))
        for frame in frames:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        return path.read_bytes()


def make_clip(
    num_frames: int, fps: float = 10.0, width: int = 64, height: int = 48, codec: str = "mp4v"
) -> bytes:
    return encode_clip(recording(num_frames, width, height), fps, codec)


def decode_all(data: bytes) -> list[np.ndarray]:
    """Every frame of an encoded video, RGB, read independently of Iris's decoder path."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip"
        path.write_bytes(data)
        capture = cv2.VideoCapture(str(path))
        frames = []
        while True:
            ok, bgr = capture.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        capture.release()
    return frames


def video_data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def video_part(url: str | None, uuid: str | None = None) -> dict:
    part: dict = {"type": "video_url", "video_url": None if url is None else {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part
