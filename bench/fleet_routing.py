"""Agents over two Iris nodes behind NVIDIA Dynamo: its KV router against round-robin,
and one Iris node serving the same agents, in one run (`docs/scale-out.md`, "A fleet").

One process group on this machine: two Dynamo frontends (`--router-mode kv` and
`round-robin`) over the same two `iris serve --dynamo` workers, and a third worker under
its own model name (one node). Each configuration serves its own agents (other
screenshots, other system prompts, so no configuration finds another's cache); an agent's
turn adds a new screenshot to its history. The agents run at once, each taking its turns
one after another, each turn for one token, so a request's latency is its time to first
token, queueing included. Each node's KV cache holds `--node-kv-tokens`: by default about
two thirds of the agents' final histories, so one node (or two that each see every agent) cannot
keep them all, and two that split the agents can: the case a fleet is for. Reported per
configuration: the returning turns' TTFT, the prefix hit rate (cached over prompt
tokens), the busier node's share of the prompt tokens, and the ratios the issue asks for.

Why at once: with requests one at a time no node is ever loaded, and Dynamo's KV router
then sends every agent to the node that holds their shared system prompt (its cost is
overlap plus load, and the load is zero), so the fleet serves from one node.

    python -m bench.fleet_routing --size small            # the recorded run
    python -m bench.fleet_routing --quick                  # smoke (tests)
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from iris_serve.tiny_checkpoint import builtin_checkpoint

from .dynamo_fleet import DynamoFleet, fleet_env, start_frontend, start_worker, stop
from .peers import kv_bytes_per_token
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


Turn = tuple[int, float, int, int]  # turn, seconds, prompt tokens, cached tokens


def run_agent(
    client: httpx.Client,
    base_url: str,
    model: str,
    name: str,
    turns: int,
    size: int,
    first_image: int,
) -> list[Turn]:
    """One agent's turns, each adding a screenshot to its history."""
    history: list[dict] = [{"role": "system", "content": SYSTEM * 20 + f"Session {name}."}]
    results = []
    for turn in range(turns):
        url = screenshot(first_image + turn, size)
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


def run_agents(
    base_url: str, model: str, agents: int, turns: int, size: int, seed: int
) -> list[Turn]:
    """Every request of `agents` agents running at once, one thread each."""
    results: list[list[Turn]] = [[] for _ in range(agents)]
    failures: list[BaseException] = []

    def agent(index: int) -> None:
        try:
            results[index] = run_agent(client, base_url, model, f"{seed}-{index}", turns,
                                       size, seed * 10_000 + index * 100)  # fmt: skip
        except BaseException as error:  # re-raised below, in the main thread
            failures.append(error)

    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=agents)) as client:
        threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    return [turn for agent_turns in results for turn in agent_turns]


def summary(name: str, results: list[Turn], node_tokens: list[float]) -> list[object]:
    returning = [r for r in results if r[0] > 0]
    ttfts = [r[1] * 1000 for r in returning]
    hit = sum(r[3] for r in returning) / max(1, sum(r[2] for r in returning))
    first = [r[1] * 1000 for r in results if r[0] == 0]
    busier = max(node_tokens) / max(1.0, sum(node_tokens))
    return [name, len(returning), statistics.median(ttfts), statistics.fmean(ttfts), hit,
            statistics.median(first), busier]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    # odd: requests arrive in waves of one per agent, and with an even count round-robin
    # would send each agent to the same node every turn
    parser.add_argument("--agents", type=int, default=7)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--node-kv-tokens", type=int, default=12288,
                        help="each node's KV cache, in tokens (default: 12288)")  # fmt: skip
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
    cache = ("--kv-cache-memory", str(args.node_kv_tokens * kv_bytes_per_token(model_dir, ())))
    named = ("--served-model-name", "iris", *cache)
    workers = [start_worker(f"iris-{i}", model_dir, named, run_dir, env) for i in range(2)]
    solo_args = ("--served-model-name", "iris-solo", "--dynamo-endpoint", "solo.backend.generate")
    workers.append(start_worker("iris-solo", model_dir, (*solo_args, *cache), run_dir, env))
    fleet = DynamoFleet(kv, workers, marker, env)
    others = DynamoFleet(rr, [], marker, env)
    rows = []
    try:
        fleet.wait_for_instances(3)
        others.wait_for_instances(3)
        configs = [("one Iris node", kv.url, "iris-solo"), ("2 nodes, KV router", kv.url, "iris"),
                   ("2 nodes, round-robin", rr.url, "iris")]  # fmt: skip
        for seed, (name, url, model) in enumerate(configs, start=1):
            before = [w.metric("iris_prompt_tokens_total") for w in workers]
            results = run_agents(url, model, args.agents, args.turns, args.image_size, seed)
            after = [w.metric("iris_prompt_tokens_total") for w in workers]
            rows.append(summary(name, results, [a - b for a, b in zip(after, before, strict=True)]))
    finally:
        stop(others)
        stop(fleet)
    solo, kv_row, rr_row = rows
    header = ["configuration", "returning turns", "TTFT p50 ms", "TTFT mean ms",
              "prefix hit rate", "first turn p50 ms", "busier node's share"]  # fmt: skip
    body = (
        f"{args.agents} agents at once x {args.turns} turns, a new "
        f"{args.image_size}x{args.image_size} screenshot per turn, `{args.size}` Qwen2.5-VL, "
        f"1 token per turn; each node's KV cache {args.node_kv_tokens} tokens.\n\n"
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
