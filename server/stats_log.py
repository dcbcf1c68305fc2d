"""The launcher's log lines a newcomer reads: the start-up banner, and a throughput line
every few seconds while the engine works (as vLLM logs one)."""

from __future__ import annotations

from collections.abc import Sequence

from ..common.version import iris_version
from ..ipc.messages import EngineStats, SchedulerReady
from ..ipc.stats import ENGINE_SERIES, Window, difference, total

LOG_INTERVAL_SECONDS = 10.0


def banner(
    model: str, url: str, schedulers: Sequence[SchedulerReady], workers: int, arena: int
) -> str:
    """One line: where, what is served on what, its limits and its caches."""
    first = schedulers[0]
    tokens = first.kv_pages * first.page_size
    weights = (
        first.dtype
        if first.quantization is None
        else f"{first.quantization} weights, {first.dtype}"
    )
    return (
        f"Iris {iris_version()} ready at {url}, serving {model!r} "
        f"({first.architecture}, {weights} on {first.device}): max_model_len "
        f"{first.max_model_len}, up to {first.max_num_seqs} sequences and "
        f"{first.max_num_batched_tokens} tokens per step; KV cache {first.kv_pages} "
        f"pages x {first.page_size} tokens = {tokens} tokens per rank; "
        f"{len(schedulers)} scheduler replica(s); {workers} tokenizer worker(s) with "
        f"{arena / 2**30:.2f} GiB arenas"
    )


def throughput_line(
    before: Sequence[EngineStats], now: Sequence[EngineStats], seconds: float
) -> str | None:
    """The figures `ipc.stats.ENGINE_SERIES` logs, summed over replicas, in its order
    (tokens/s over the interval, requests running and waiting, KV use, cache hit rates);
    None when nothing happened (no activity part is nonzero)."""
    window = Window(total(now), difference(total(now), total(before)), seconds)
    parts: list[str] = []
    working = False
    for series in ENGINE_SERIES:
        part = series.log
        if part is None or not part.shown(window):
            continue
        number = part.number(series.value, window)
        working = working or (part.activity and bool(number))
        parts.append(part.text.format(number))
    return ", ".join(parts) if working else None
