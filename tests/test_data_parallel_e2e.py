"""Data parallelism end to end: `iris serve --data-parallel-size 2` runs two schedulers,
each with its own caches and tokenizer worker. A conversation's rounds stay on the replica
that holds its images (one image encoded per round, all on that replica), while
independent conversations spread over both; `/metrics` labels each engine figure with
its replica.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.reference import make_image
from tests.server_harness import RunningServer, iris_server
from tests.test_caches_e2e import (
    PAGE,
    chat,
    conversation_round,
    reference_answer,
    single_turn,
)
from tests.test_server_e2e import png_bytes

REPLICAS = 2
ROUNDS = 8


def encoded(server: RunningServer) -> list[float]:
    metrics = server.metrics()
    return [metrics[f'iris_mm_images_encoded_total{{replica="{r}"}}'] for r in range(REPLICAS)]


def idle() -> dict[str, float]:
    """What /metrics reads once both replicas are idle (each replica's own figures)."""
    wanted = {"iris_shm_arena_pinned_entries": 0.0}
    for r in range(REPLICAS):
        wanted[f'iris_num_requests_running{{replica="{r}"}}'] = 0.0
        wanted[f'iris_kv_cache_used_pages{{replica="{r}"}}'] = 0.0
        wanted[f'iris_scheduler_pinned_images{{replica="{r}"}}'] = 0.0
    return wanted


def test_a_conversation_stays_on_one_replica_and_new_ones_spread(qwen2_5_vl_tiny, tmp_path):
    flags = ["--served-model-name", "tiny", "--block-size", str(PAGE), "--max-model-len", "4096"]
    flags += ["--data-parallel-size", str(REPLICAS), "--tokenizer-workers", str(REPLICAS)]
    with iris_server(qwen2_5_vl_tiny, *flags, tmp_path=tmp_path) as server:
        history: list[dict] = []
        images: list[bytes] = []
        for k in range(1, ROUNDS + 1):
            image = png_bytes(make_image(48 + 8 * k, 40 + 4 * k, seed=200 + k))
            images.append(image)
            messages = conversation_round(history, image, f"And picture {k}?")
            answer = chat(server, messages)["choices"][0]["message"]["content"]
            assert answer == reference_answer(qwen2_5_vl_tiny, messages, images), f"round {k}"
            server.wait_for_metrics(idle())
            per_replica = sorted(encoded(server))
            assert per_replica == [0.0, float(k)], f"round {k}: images encoded {per_replica}"
            history = [*messages, {"role": "assistant", "content": answer}]
        home = encoded(server).index(float(ROUNDS))

        # Eight new conversations at once: their first images' hashes spread them.
        new = [png_bytes(make_image(64, 56, seed=300 + i)) for i in range(8)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda b: chat(server, single_turn([b], "What is it?")), new))
        assert all(a["choices"][0]["message"]["content"] is not None for a in answers)
        server.wait_for_metrics(idle())
        after = encoded(server)
        assert sum(after) == ROUNDS + len(new)
        assert after[1 - home] > 0, f"no new conversation reached the other replica: {after}"
        assert after[home] > ROUNDS, f"every new conversation left the busy replica: {after}"
