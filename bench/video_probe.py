"""`bench.image_probe --media video`: one video per request whose sampled frame count
doubles (16, 32 … 256), the scheduler's peak private memory and TTFT per point.

Iris turns a video into temporal patches of 2 frames that the scheduler encodes lazily,
patch by patch, under `--max-num-encoder-tokens` (docs/design.md, "Life of a video"), so
the vision tower's working memory should not grow with the frames; what does grow is the
request's embeddings (pinned to its end) and the text side's context.

The clip of N frames is a synthetic screen recording (`bench.videos`) at 2 fps, MP4 in a
data: URL, a recording of its own per N (nothing cached from an earlier point), sent with
`mm_processor_kwargs` `num_frames` = N: every frame is sampled. The generated checkpoints'
video processor caps a frame at 224x224 px (64 tokens per temporal patch), so 256 frames
are at most 8192 video tokens, well within the 32k context.
"""

from __future__ import annotations

from typing import Any

from bench.results_io import Checkpoint, markdown_table
from bench.server_process import chat_body
from bench.videos import Recording, clip_bytes, video_part

FPS = 2.0  # the recording's rate, also the processor's sampling rate
SIZE = (640, 360)  # resized to 280x168 per frame by the generated checkpoints (60 tokens)
QUICK_SIZE = (160, 96)
COUNTS = [16, 32, 64, 128, 256]
QUICK_COUNTS = [4, 8, 16]
WARM_UP_FRAMES = 6  # a clip the sweep never sends, at its resolution: the first-call costs
SEED = 7000


def body(model: str, size: tuple[int, int], n: int) -> dict[str, Any]:
    """A chat request with an N-frame clip (its own recording), all N frames sampled."""
    data = clip_bytes(Recording(*size, FPS, SEED + 10 * size[0] + n), 0.0, n / FPS)
    content = [video_part(data), {"type": "text", "text": f"Describe these {n} frames."}]
    request = chat_body(model, [{"role": "user", "content": content}], 1, max_pixels=None)
    request["mm_processor_kwargs"] = {"num_frames": n}
    return request


def header(columns: list[str]) -> list[str]:
    """`bench.image_probe`'s columns, in frames."""
    return [c.replace("images", "frames").replace("image", "frame") for c in columns]


def report(
    checkpoint: Checkpoint,
    flags: list[str],
    variants: list[tuple[str, list[str]]],
    summary: tuple[list[str], list[list[object]]],
    table: tuple[list[str], list[list[object]]],
    png: str,
) -> str:
    per_variant = "; ".join(f"`{name}`: `{' '.join(f)}`" for name, f in variants)
    return "\n".join(
        [
            f"{checkpoint.sentence} One request at a time with one video of N frames "
            f"({FPS:g} fps synthetic screen recording, `bench.videos`, MP4 data: URL, a new "
            "recording per N) and `mm_processor_kwargs` `num_frames` = N, so every frame is "
            "sampled; `max_tokens=1`. After each, on the first variant's server, a "
            "completion of as many plain token ids and no video (`text only, same tokens`). "
            "Each variant on its own `iris serve`, servers in turns point by point after a "
            f"warm-up with a {WARM_UP_FRAMES}-frame clip of the same size. Server flags for "
            f"all: `{' '.join(flags)}`; per variant: {per_variant}. Servers run with "
            "`MALLOC_MMAP_THRESHOLD_=65536`.",
            "",
            f"![scheduler peak private memory and TTFT vs frames per video]({png})",
            "",
            "## Summary",
            "",
            markdown_table(*summary),
            "",
            "MiB per added frame = (peak private at the most frames − at the fewest) / "
            "(difference in frames). A frame is half a temporal patch; its embedding is "
            "pinned until the request ends (`scheduler/encoder/embedding_cache.py`), so some growth "
            "per frame is by design: the vision tower's working memory is what "
            "`--max-num-encoder-tokens` bounds. The `text only` rows are the text side's "
            "share (attention over a longer context per 512-token chunk).",
            "",
            "## Per request",
            "",
            markdown_table(*table),
            "",
            "Columns as in `bench.image_probe` (its module docstring and its results): peak "
            "private + = the scheduler's peak RSS − RssShmem over idle during the request "
            "(its `VmHWM` reset before each, and a 2 ms sampler); arena read = pages of the "
            "tokenizer worker's shared-memory arena the scheduler read patches from; TTFT = "
            "client, request sent → first content chunk (decode, resize, encode and "
            "prefill); load avg = the 1-minute load average when the request was sent.",
        ]
    )
