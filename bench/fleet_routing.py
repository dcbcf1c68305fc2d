"""Agents over two Iris nodes behind NVIDIA Dynamo: its KV router against round-robin,
and one Iris node serving the same agents, in one run (`docs/scale-out.md`, "A fleet").

One process group on this machine: two Dynamo frontends (`--router-mode kv` and
`round-robin`) over the same two `iris serve --dynamo` workers, and a third worker under
its own model name (one node). Each configuration serves its own agents (other
screenshots, other system prompts, so no configuration finds another's cache); an agent's
turn adds a new screenshot to its history. Requests go one at a time, agents in turn, each
for one token, so a request's latency is its time to first token. Reported per
configuration: the returning turns' TTFT and the prefix hit rate (cached over prompt
tokens), and the ratios the issue asks for.

    python -m bench.fleet_routing --size small            # the recorded run
    python -m bench.fleet_routing --quick                  # smoke (tests)
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from iris_serve.tiny_checkpoint import builtin_checkpoint

from .dynamo_fleet import DynamoFleet, fleet_env, start_frontend, start_worker, stop
from .results_io import markdown_table, write_result

SYSTEM = "You operate a desktop for the user, one click at a time, and explain each step. "


def screenshot(seed: int, size: int) -> str:
    """A PNG data URL of a random-looking screenshot (distinct per seed)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
    image = Image.fromarray(pixels).resize((size, size), Image.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def run_agents(
    base_url: str, model: str, agents: int, turns: int, size: int, seed: int
) -> list[tuple[int, float, int, int]]:
    """`(turn, seconds, prompt tokens, cached tokens)` of every request."""
    histories = [
        [{"role": "system", "content": SYSTEM * 20 + f"Session {seed}-{a}."}] for a in range(agents)
    ]
    results = []
    with httpx.Client(timeout=300) as client:
        for turn in range(turns):
            for agent, history in enumerate(histories):
                url = screenshot(seed * 10_000 + agent * 100 + turn, size)
                history.append({"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": f"Step {turn}: what next?"}]})  # fmt: skip
                body = {"model": model, "messages": history, "max_tokens": 1, "temperature": 0}
                start = time.perf_counter()
                response = client.post(f"{base_url}/v1/chat/completions", json=body)
                seconds = time.perf_counter() - start
                response.raise_for_status()
                usage = response.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                results.append((turn, seconds, usage["prompt_tokens"], cached))
                history.append({"role": "assistant", "content": f"I clicked item {turn}."})
    return results


def summary(name: str, results: list[tuple[int, float, int, int]]) -> list[object]:
    returning = [r for r in results if r[0] > 0]
    ttfts = [r[1] * 1000 for r in returning]
    hit = sum(r[3] for r in returning) / max(1, sum(r[2] for r in returning))
    first = [r[1] * 1000 for r in results if r[0] == 0]
    return [name, len(returning), statistics.median(ttfts), statistics.fmean(ttfts), hit,
            statistics.median(first)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--agents", type=int, default=5)  # odd: round-robin moves agents
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--quick", action="store_true", help="3 agents, 2 turns, small images")
    parser.add_argument("--name", default=None, help="result file (default fleet_routing_SIZE)")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.agents, args.turns, args.image_size = 3, 2, 112
    model_dir = builtin_checkpoint(size=args.size)
    run_dir = Path(tempfile.mkdtemp(prefix="iris-fleet-"))
    marker = uuid.uuid4().hex
    env = fleet_env(run_dir, marker)
    kv = start_frontend("kv", run_dir, env)
    rr = start_frontend("round-robin", run_dir, env, name="frontend-rr")
    named = ("--served-model-name", "iris")
    workers = [start_worker(f"iris-{i}", model_dir, named, run_dir, env) for i in range(2)]
    solo_args = ("--served-model-name", "iris-solo", "--dynamo-endpoint", "solo.backend.generate")
    workers.append(start_worker("iris-solo", model_dir, solo_args, run_dir, env))
    fleet = DynamoFleet(kv, workers, marker, env)
    others = DynamoFleet(rr, [], marker, env)
    rows = []
    try:
        fleet.wait_for_instances(3)
        others.wait_for_instances(3)
        configs = [("one Iris node", kv.url, "iris-solo"), ("2 nodes, KV router", kv.url, "iris"),
                   ("2 nodes, round-robin", rr.url, "iris")]  # fmt: skip
        for seed, (name, url, model) in enumerate(configs, start=1):
            results = run_agents(url, model, args.agents, args.turns, args.image_size, seed)
            rows.append(summary(name, results))
    finally:
        stop(others)
        stop(fleet)
    solo, kv_row, rr_row = rows
    header = ["configuration", "returning turns", "TTFT p50 ms", "TTFT mean ms",
              "prefix hit rate", "first turn p50 ms"]  # fmt: skip
    body = (
        f"{args.agents} agents x {args.turns} turns, a new {args.image_size}x{args.image_size} "
        f"screenshot per turn, `{args.size}` Qwen2.5-VL, one request at a time (1 token each).\n\n"
        + markdown_table(header, rows)
        + "\n\n"
        + markdown_table(
            ["ratio", "value"],
            [
                ["returning TTFT p50, round-robin / KV router", rr_row[2] / kv_row[2]],
                ["returning TTFT mean, round-robin / KV router", rr_row[3] / kv_row[3]],
                ["prefix hit rate, KV-routed fleet / one node", kv_row[4] / max(solo[4], 1e-9)],
            ],
        )
    )
    title = "Agents over two Iris nodes behind Dynamo: KV router vs round-robin vs one node"
    write_result(args.name or f"fleet_routing_{args.size}", title, body, args.results_dir)


if __name__ == "__main__":
    main()
