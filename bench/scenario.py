"""The agent workloads of `bench.serve_load` and `bench.peers`: one conversation sent one
request at a time, each request streamed and timed on the client, and on Iris also read
from its /metrics counters.

- `append`: an agent whose history grows: each round adds a user message with one new
  screenshot and keeps the answers, so round k sends k screenshots; the prefix cache and
  the per-image caches can serve everything but the newest image.
- `window`: an agent sending its last 10 screenshots, newest last: step 0 brings 10 new
  ones, every later step drops the oldest and adds one. The first image (and with it the
  prompt's prefix) changes at every step, so only the per-image caches can help.
- `agents`: `append`'s agent, many of them taking turns (round 1 of every agent, then
  round 2 of every agent, ...): with a KV cache that holds a few of their histories, an
  agent comes back after the others pushed its pages out, and only a tier below the
  device's prefix cache (`--kv-offload-gib`) can spare it the re-prefill.

Answers are greedy with `ignore_eos`, so every server generates as many tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bench.images import image_part
from bench.server_process import (
    IrisServer,
    StreamedChat,
    chat_body,
    delta,
    group_rss_bytes,
    stream_chat,
)

# --quick: the fewest processes and the smallest reservations a server can start with.
QUICK_FLAGS = [
    "--tokenizer-workers", "1", "--kv-cache-memory", "64MiB", "--mm-processor-cache-gb", "0.125",
]  # fmt: skip
WARM_UP = [  # small images the workloads never send, each its own first image
    [{"role": "user", "content": [image_part(96, 64, seed=9000 + seed)]}] for seed in range(4)
]
WINDOW = 10  # screenshots per `window` request
SYSTEM = {
    "append": "You are a careful assistant. Compare each new screenshot with the earlier ones.",
    "window": "You are a computer-use agent. Reply with the next action only.",
}
SYSTEM["agents"] = SYSTEM["append"]


@dataclass(frozen=True)
class Agent:
    """One agent workload: `turns` requests (rounds 1.. for `append`, steps 0.. for
    `window`); its summary is the mean over those from `summary_from` on."""

    name: str  # "append" or "window"
    turns: int
    size: tuple[int, int]  # of every screenshot
    max_tokens: int
    summary_from: int
    max_pixels: int | None = None  # mm_processor_kwargs.max_pixels; None: the processor's
    agents: int = 1  # `agents`: how many take turns

    @property
    def first(self) -> int:
        return 0 if self.name == "window" else 1


def warm_up(
    client: httpx.Client,
    server: IrisServer,
    model: str,
    conversations: Sequence[list[dict[str, Any]]] = WARM_UP,
) -> None:
    """First-call costs out of the measurement: each of `conversations` (by default
    `WARM_UP`'s, different first images, so every tokenizer worker gets some). On Iris,
    returns once their counts are in /metrics, so none lands in the first measured
    request's deltas."""
    before = server.metrics() if server.iris_metrics else {}
    generated = 0
    for messages in conversations:
        body = chat_body(model, messages, 2, None)
        generated += stream_chat(client, server.base_url, body).completion_tokens
    if server.iris_metrics:
        server.metrics_after(before, requests=len(conversations), generated_tokens=generated)


def measured_chat(
    client: httpx.Client, server: IrisServer, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """One streamed request: its answer text and a row of what it cost, from the client
    (TTFT, end to end) and, on Iris, from /metrics deltas once its counts are in."""
    before = server.metrics() if server.iris_metrics else {}
    answer = stream_chat(client, server.base_url, body)
    row = client_costs(answer)
    if server.iris_metrics:
        after = server.metrics_after(before, generated_tokens=answer.completion_tokens)
        row["encoded"] = int(delta(after, before, "iris_mm_images_encoded_total"))
        row["vit_ms"] = 1e3 * delta(after, before, "iris_mm_encoder_seconds_sum")
        row["server_ttft_ms"] = 1e3 * delta(after, before, "iris_time_to_first_token_seconds_sum")
        assert server.process is not None  # a started server leads its process group
        row["server_rss_mib"] = group_rss_bytes(server.process.pid) / 2**20
        if after.get("iris_host_tier_capacity_bytes"):
            row["host_copy_ms"] = 1e3 * delta(after, before, "iris_host_tier_copy_seconds_total")
            row["host_page_copies"] = int(delta(after, before, "iris_host_tier_page_copies_total"))
    return answer.text, row


def client_costs(answer: StreamedChat) -> dict[str, Any]:
    """What a client sees of one streamed answer: the row any server gets."""
    return {
        "prompt_tokens": answer.prompt_tokens,
        "cached_tokens": answer.cached_tokens,
        "completion_tokens": answer.completion_tokens,
        "ttft_ms": 1e3 * answer.ttft,
        "e2e_ms": 1e3 * answer.latency,
        **(
            {}
            if answer.host_cached_tokens is None
            else {"host_cached_tokens": answer.host_cached_tokens}
        ),
    }


def requests(agent: Agent, server: IrisServer, model: str, seed: int) -> Iterator[dict[str, Any]]:
    """Sends the workload's requests one by one (agent a's screenshot i has seed
    `seed + 17 * a + i`), yielding a row of measurements after each."""
    if agent.name == "window":
        yield from _window(agent, server, model, seed)
        return
    system = {"role": "system", "content": SYSTEM[agent.name]}
    histories: list[list[dict[str, Any]]] = [[system] for _ in range(agent.agents)]
    with httpx.Client(timeout=600) as client:
        for turn in range(agent.first, agent.first + agent.turns):
            for index, history in enumerate(histories):
                question = f"Round {turn}: what is new in this screenshot?"
                content = [image_part(*agent.size, seed=seed + 17 * index + turn)]
                history.append({"role": "user", "content": [*content, _text(question)]})
                body = chat_body(model, history, agent.max_tokens, agent.max_pixels)
                text, row = measured_chat(client, server, body)
                yield {"turn": turn, **({"agent": index} if agent.agents > 1 else {}), **row}
                history.append({"role": "assistant", "content": text})


def _window(agent: Agent, server: IrisServer, model: str, seed: int) -> Iterator[dict[str, Any]]:
    system = {"role": "system", "content": SYSTEM[agent.name]}
    with httpx.Client(timeout=600) as client:
        for turn in range(agent.first, agent.first + agent.turns):
            shots = [image_part(*agent.size, seed=seed + i) for i in range(turn, turn + WINDOW)]
            question = f"Step {turn}: the last {WINDOW} screenshots, newest last. Next action?"
            messages = [system, {"role": "user", "content": [*shots, _text(question)]}]
            body = chat_body(model, messages, agent.max_tokens, agent.max_pixels)
            yield {"turn": turn, **measured_chat(client, server, body)[1]}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def tpot_ms(row: dict[str, Any]) -> float | None:
    """Time per output token after the first, as `vllm bench serve` defines it."""
    tokens = row["completion_tokens"]
    return (row["e2e_ms"] - row["ttft_ms"]) / (tokens - 1) if tokens > 1 else None


def summary(agent: Agent, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the turns from `agent.summary_from` on, under `load_client.summarize`'s
    keys where one means the same."""
    return turn_means(rows, agent.summary_from)


def turn_means(rows: list[dict[str, Any]], summary_from: int) -> dict[str, Any]:
    """`summary` of any workload sent one request at a time: rows with a `turn`, means over
    the turns from `summary_from` on (every turn if none is)."""
    kept = [r for r in rows if r["turn"] >= summary_from] or rows
    tpots = [t for t in map(tpot_ms, kept) if t is not None]
    figures: dict[str, Any] = {
        "completed": len(rows),
        "failed": 0,
        "total_input_tokens": sum(r["prompt_tokens"] for r in rows),
        "total_output_tokens": sum(r["completion_tokens"] for r in rows),
        "mean_ttft_ms": statistics.fmean(r["ttft_ms"] for r in kept),
        "mean_e2e_ms": statistics.fmean(r["e2e_ms"] for r in kept),
        "mean_tpot_ms": statistics.fmean(tpots) if tpots else 0.0,
    }
    if "encoded" in kept[0]:
        figures["images_encoded"] = statistics.fmean(r["encoded"] for r in kept)
    prompt = sum(r["prompt_tokens"] for r in kept)
    figures["prefix_hit_rate"] = sum(r["cached_tokens"] for r in kept) / prompt
    if "host_cached_tokens" in kept[0]:  # Iris with a host tier: its share of the hits
        figures["host_hit_rate"] = sum(r["host_cached_tokens"] for r in kept) / prompt
    if "server_rss_mib" in kept[0]:  # Iris: how its processes' memory moved meanwhile
        figures["server_rss_growth_mib"] = kept[-1]["server_rss_mib"] - kept[0]["server_rss_mib"]
    copies = sum(r.get("host_page_copies", 0) for r in rows)
    if copies:  # every request's copies, spills included: µs per KV page either way
        figures["host_copy_us_per_page"] = 1e3 * sum(r["host_copy_ms"] for r in rows) / copies
    return figures
