"""The video workloads of `bench.serve_load` and `bench.peers`: questions about clips of a
synthetic screen recording (`bench.videos`), sent one request at a time, each streamed and
timed on the client and, on Iris, read from its /metrics counters, as `bench.scenario`'s
agents are.

- `video`: one clip asked several questions one after another in one conversation. Every
  request re-sends the video part with the whole history, as a chat client does: the
  first question is the cold video (decoded, encoded, prefilled), each later one finds
  whatever a server kept of it (Iris: what the worker made of those bytes, the temporal
  patches' embeddings, the prompt's KV in the prefix cache).
- `clips`: overlapping clips of one recording (a screen-recording agent's moving window),
  each its own MP4 asked once in a new conversation. Whether a later clip's temporal
  patches equal an earlier one's is up to the model's sampling rules and the codec (see
  docs/design.md, "Life of a video"); Iris's `images encoded` column shows what it encoded.

Clips are written once per run and sent as data: URLs, so every server gets the same
bytes; each round and workload gets a recording of its own (its seed), so no cache carries
over from one to the next. Answers are greedy with `ignore_eos`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bench import scenario
from bench.server_process import IrisServer, chat_body
from bench.videos import Recording, clip_bytes, video_part

SYSTEM = {"role": "system", "content": "You are a careful assistant watching a screen recording."}
QUESTIONS = (
    "What is on the screen at the start of this recording?",
    "Which window moves, and where does it go?",
    "What is being typed in the first window?",
    "Where is the mouse cursor at the end?",
    "What does the clock in the taskbar show last?",
    "How many windows are open?",
    "What colours are the title bars?",
    "Summarise what the user did in this clip.",
)
WARM_UP_SEEDS = (9100, 9101)  # recordings the workloads never send, one per tokenizer worker


@dataclass(frozen=True)
class VideoWorkload:
    """Conversations about clips of one recording: a clip per span (seconds, start
    included, end excluded), `questions` requests about each; its summary is the mean
    over requests `summary_from` (1-based) on."""

    name: str  # "video" or "clips"
    spans: tuple[tuple[float, float], ...]
    questions: int
    size: tuple[int, int]  # width, height of the recording
    fps: float
    max_tokens: int
    summary_from: int

    @property
    def turns(self) -> int:
        """Requests sent."""
        return len(self.spans) * self.questions

    def recording(self, seed: int) -> Recording:
        return Recording(*self.size, self.fps, seed)

    def clips(self, seed: int) -> list[tuple[str, bytes]]:
        """(span as text, MP4 bytes) of each clip of the recording `seed`, in order."""
        recording = self.recording(seed)
        return [(f"{a:g}-{b:g} s", clip_bytes(recording, a, b)) for a, b in self.spans]

    def describe(self) -> str:
        """The workload in a sentence of the report's setup."""
        spans = ", ".join(f"{a:g}-{b:g} s" for a, b in self.spans)
        clips = f"one clip ({spans})" if len(self.spans) == 1 else f"clips {spans}"
        asked = (
            f"asked {self.questions} questions one after another in one conversation, each "
            "request re-sending the video part with the history"
            if self.questions > 1
            else "each asked once in a new conversation"
        )
        cold = " (cold: request 1)" if self.summary_from > 1 else ""
        return (
            f"`{self.name}`: {clips} of a {self.size[0]}×{self.size[1]} {self.fps:g} fps "
            f"synthetic screen recording, MP4 data: URLs, {asked}; {self.max_tokens} tokens "
            f"back (`ignore_eos`), summary over requests {self.summary_from} on{cold}."
        )


def requests(
    workload: VideoWorkload, server: IrisServer, model: str, seed: int
) -> Iterator[dict[str, Any]]:
    """Sends the workload's requests one by one (clips of recording `seed`, all written
    before the first request), yielding a row of measurements after each."""
    clips = workload.clips(seed)
    turn = 0
    with httpx.Client(timeout=600) as client:
        for span, data in clips:
            history: list[dict[str, Any]] = [SYSTEM]
            for question in range(workload.questions):
                turn += 1
                text = {"type": "text", "text": ask(workload, span, question)}
                content = [video_part(data), text] if question == 0 else [text]
                history.append({"role": "user", "content": content})
                body = chat_body(model, history, workload.max_tokens, None)
                answer, row = scenario.measured_chat(client, server, body)
                yield {"turn": turn, "clip": span, **row}
                history.append({"role": "assistant", "content": answer})


def ask(workload: VideoWorkload, span: str, question: int) -> str:
    if workload.questions == 1:
        return f"This is seconds {span} of the recording. What changes on the screen?"
    return f"Question {question + 1}: {QUESTIONS[question % len(QUESTIONS)]}"


def summary(workload: VideoWorkload, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`scenario.turn_means` over the requests from `summary_from` on, with the cold
    request's (the first's) figures and the whole workload's end to end beside them."""
    return {
        **scenario.turn_means(rows, workload.summary_from),
        "cold_ttft_ms": rows[0]["ttft_ms"],
        "cold_e2e_ms": rows[0]["e2e_ms"],
        "total_e2e_ms": sum(r["e2e_ms"] for r in rows),
    }


def warm_up(
    client: httpx.Client, server: IrisServer, model: str, workloads: Sequence[VideoWorkload]
) -> None:
    """First-video costs out of the measurement: the decoder's and the video processor's
    first call, and the vision tower's first call at each size (a cost paid once per
    shape: on Iris, a video's first request after a shorter or smaller warm-up takes far
    longer than the next one of the same size). For each frame size, rate and clip length
    of `workloads`, a clip of a recording they never send, one per tokenizer worker; so
    a workload's first request is a new video, not a new shape."""
    shapes = dict.fromkeys(
        (w.size, w.fps, end - start) for w in workloads for start, end in w.spans
    )
    conversations = []
    for (size, fps, seconds), seed in itertools.product(shapes, WARM_UP_SEEDS):
        data = clip_bytes(Recording(*size, fps, seed), 0.0, seconds)
        question = {"type": "text", "text": "What happens?"}
        conversations.append([{"role": "user", "content": [video_part(data), question]}])
    scenario.warm_up(client, server, model, conversations)
