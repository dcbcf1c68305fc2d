"""The launcher's log lines a newcomer reads: the start-up banner, and a throughput line
every few seconds while the engine works (as vLLM logs one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..common.version import iris_version
from ..ipc.messages import EngineStats

LOG_INTERVAL_SECONDS = 10.0


def banner(
    model: str, url: str, schedulers: Sequence[Mapping[str, Any]], workers: int, arena: int
) -> str:
    """One line: where, what is served on what, its limits and its caches."""
    first = schedulers[0]
    tokens = first["kv_pages"] * first["page_size"]
    return (
        f"Iris {iris_version()} ready at {url}, serving {model!r} "
        f"({first['architecture']}, {first['dtype']} on {first['device']}): max_model_len "
        f"{first['max_model_len']}, up to {first['max_num_seqs']} sequences and "
        f"{first['max_num_batched_tokens']} tokens per step; KV cache {first['kv_pages']} "
        f"pages x {first['page_size']} tokens = {tokens} tokens per rank; "
        f"{len(schedulers)} scheduler replica(s); {workers} tokenizer worker(s) with "
        f"{arena / 2**30:.2f} GiB arenas"
    )


def throughput_line(
    before: Sequence[EngineStats], now: Sequence[EngineStats], seconds: float
) -> str | None:
    """Prompt and generation tokens/s over the interval, requests running and waiting,
    KV use and cache hit rates, summed over replicas; None when nothing happened."""

    def total(stats: Sequence[EngineStats], name: str) -> int:
        return sum(getattr(s, name) for s in stats)

    def grew(name: str) -> int:
        return total(now, name) - total(before, name)

    running, waiting = total(now, "num_running"), total(now, "num_waiting")
    prompt, generated = grew("prompt_tokens"), grew("generation_tokens")
    if not (prompt or generated or running or waiting):
        return None
    pages = total(now, "kv_pages_total")
    hits, misses = grew("mm_embedding_cache_hits"), grew("mm_embedding_cache_misses")
    # as vLLM's "Prefix cache hit rate": hit tokens over the tokens looked up
    prefix, queried = grew("prefix_cache_hit_tokens"), grew("prefix_cache_query_tokens")
    line = (
        f"prompt {prompt / seconds:.1f} tok/s, generation {generated / seconds:.1f} tok/s, "
        f"running {running}, waiting {waiting}, KV cache "
        f"{100 * total(now, 'kv_pages_used') / pages if pages else 0:.1f}% used, prefix "
        f"cache hit rate {100 * prefix / queried if queried else 0:.1f}%, image "
        f"embeddings {100 * hits / (hits + misses) if hits + misses else 0:.1f}% cached"
    )
    admitted = grew("linear_state_snapshot_queries")  # a hybrid model's (Qwen3.5)
    if admitted:
        restored = grew("linear_state_snapshot_hits")
        line += f", linear-state snapshots restored for {100 * restored / admitted:.1f}%"
    if total(now, "host_tier_capacity_bytes"):  # `--kv-offload-gib`
        host = grew("prefix_cache_host_hit_tokens")
        line += (
            f", host tier {100 * host / queried if queried else 0:.1f}% of prefix tokens, "
            f"{total(now, 'host_tier_usage_bytes') / 2**30:.2f} GiB held"
        )
    return line
