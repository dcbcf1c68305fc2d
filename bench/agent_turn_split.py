"""A returning agent's turn, split by the server's own clocks: how much of its TTFT is the
new screenshot's vision tower, how much the steps that prefilled its new tokens, and how
much everything else (HTTP, tokenization and the image's preprocessing, queueing, copies,
waits between the two). Used by `bench.roofline`.

One agent, one turn at a time on an otherwise idle `iris serve`: turn 1 sends a system
prompt, a screenshot and a question; each next turn sends the history back (cached) with
the answer, a new screenshot and a new question. For each returning turn the `/metrics`
deltas of that turn alone give `iris_mm_encoder_seconds` (the tower),
`iris_request_prefill_step_seconds` (the wall time of the steps that computed its
prompt), `vllm:request_prefill_time_seconds` (first step to first token) and
`vllm:request_queue_time_seconds`; the client's streamed TTFT holds them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.images import image_part
from bench.server_process import IrisServer, chat_body, stream_chat

SYSTEM = "You are a desktop agent. Look at each screenshot and say what to click next. " * 4
SERIES = {
    "tower": "iris_mm_encoder_seconds_sum",
    "steps": "iris_request_prefill_step_seconds_sum",
    "prefill": "vllm:request_prefill_time_seconds_sum",
    "queue": "vllm:request_queue_time_seconds_sum",
    "server_ttft": "vllm:time_to_first_token_seconds_sum",
}


@dataclass(frozen=True)
class TurnSplit:
    """One returning turn, in seconds."""

    ttft: float  # the client's, streamed
    tower: float
    steps: float
    prefill: float
    queue: float
    server_ttft: float
    new_tokens: int  # its prompt tokens not found cached

    @property
    def other(self) -> float:
        """TTFT less the tower and the prefill steps."""
        return self.ttft - self.tower - self.steps

    @property
    def over_bound(self) -> float:
        """TTFT ÷ (tower + prefill steps): 1 is no time beyond the two."""
        return self.ttft / (self.tower + self.steps)


def agent_turns(
    model_dir: Path, flags: list[str], turns: int, size: tuple[int, int], answer_tokens: int
) -> list[TurnSplit]:
    """The split of each of an agent's `turns - 1` returning turns (see the module)."""
    with IrisServer(model_dir, flags) as server, httpx.Client(timeout=600) as client:
        model = server.model_name()
        messages: list[dict] = [{"role": "system", "content": SYSTEM}]
        splits = []
        for turn in range(turns):
            question = {"type": "text", "text": f"Step {turn}: what next?"}
            messages.append({"role": "user", "content": [image_part(*size, seed=turn), question]})
            before = server.metrics()
            reply = stream_chat(
                client, server.base_url, chat_body(model, messages, answer_tokens, None)
            )
            after = server.metrics_after(before, generated_tokens=reply.completion_tokens)
            messages.append({"role": "assistant", "content": reply.text})
            if turn == 0:
                continue  # the first turn has no history to return to
            delta = {
                key: after.get(name, 0.0) - before.get(name, 0.0) for key, name in SERIES.items()
            }
            new = reply.prompt_tokens - reply.cached_tokens
            splits.append(TurnSplit(ttft=reply.ttft, new_tokens=new, **delta))
        return splits
