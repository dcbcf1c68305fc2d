"""Encoded video bytes to the RGB frames a sampling picks: OpenCV's FFmpeg, in memory.

The header (frame count, rate, size) is read first, so that every limit is checked before
any frame is decoded. Frames are then decoded in order up to the last one wanted (a
compressed video's frames depend on the ones before them) and only the wanted ones are
converted to RGB. A video that cannot be opened, or that ends before the frames its
header announces, is the client's error (`MediaError`, a 400); so is a frame whose size
differs from the header's.

OpenCV reads the bytes through a Python stream object that must outlive the capture
(its reader calls back into it, up to `release`): `open_video` keeps both together.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import cv2
import numpy as np

from ..media.fetch import MediaError

# OpenCV's own thread pool (colour conversion) stays single-threaded: tokenizer workers
# run side by side and scale with processes; FFmpeg's decoding threads are set per video.
cv2.setNumThreads(1)


@dataclass(frozen=True)
class VideoHeader:
    """What the container says: `num_frames` (counted from the header, or estimated by
    FFmpeg from the duration and rate where the container has no count), `fps` (None:
    unknown), `width` x `height` pixels."""

    num_frames: int
    fps: float | None
    width: int
    height: int


class OpenVideo:
    """A video being read (`open_video`): its header, then its frames, once."""

    def __init__(self, capture: cv2.VideoCapture) -> None:
        self._capture = capture
        fps = capture.get(cv2.CAP_PROP_FPS)
        self.header = VideoHeader(
            num_frames=max(0, int(capture.get(cv2.CAP_PROP_FRAME_COUNT))),
            fps=fps if fps > 0 else None,
            width=int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
            height=int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)),
        )

    def frames(self, indices: Sequence[int]) -> Iterator[np.ndarray]:
        """The RGB frame (uint8 [height, width, 3]) at each of `indices` (non-decreasing;
        a repeated index repeats its frame), decoding nothing past the last one."""
        wanted = list(indices)
        if any(b < a for a, b in itertools.pairwise(wanted)):
            raise ValueError("frame indices must be non-decreasing")
        position = 0  # the index of the next frame to grab
        frame: np.ndarray | None = None
        for index in wanted:
            while position <= index:
                if not self._capture.grab():
                    raise self._ended(position)
                position += 1
                frame = None
            if frame is None:
                frame = self._retrieve(index)
            yield frame

    def _retrieve(self, index: int) -> np.ndarray:
        ok, bgr = self._capture.retrieve()
        if not ok or bgr is None:
            raise self._ended(index)
        expected = (self.header.height, self.header.width, 3)
        if bgr.shape != expected:
            raise MediaError(
                f"frame {index} of the video is {bgr.shape[1]}x{bgr.shape[0]}, its header "
                f"says {expected[1]}x{expected[0]}: videos that change size are not supported"
            )
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    def _ended(self, position: int) -> MediaError:
        return MediaError(
            f"the video ends at frame {position} of the {self.header.num_frames} its header "
            "announces: it is truncated or damaged"
        )


@contextmanager
def open_video(data: bytes, threads: int = 1) -> Iterator[OpenVideo]:
    """The video in `data`, decoded by FFmpeg with `threads` threads; `MediaError` when it
    is no video OpenCV's FFmpeg can read."""
    stream = io.BytesIO(data)  # lives until the capture is released (see the module doc)
    try:
        # OpenCV's stubs name only its IStreamReader; any binary stream with read and seek works
        capture = cv2.VideoCapture(  # pyright: ignore[reportCallIssue]
            stream,  # pyright: ignore[reportArgumentType]
            cv2.CAP_FFMPEG,
            [cv2.CAP_PROP_N_THREADS, max(1, threads)],
        )
    except cv2.error:
        capture = None
    if capture is None or not capture.isOpened():
        raise MediaError("the data is not a video in a format FFmpeg can read")
    try:
        video = OpenVideo(capture)
        if video.header.width < 1 or video.header.height < 1:
            raise MediaError("the video has no picture (its frames are 0 pixels wide or high)")
        yield video
    finally:
        capture.release()
        del stream
