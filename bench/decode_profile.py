"""Where a decode step's milliseconds go at agent-length contexts (in process, CPU).

    python -m bench.decode_profile [--size small] [--arch ARCH] [--contexts 2048 4096 8192]
        [--batches 1 4 16] [--steps 8] [--quick] [--out DIR]    # from the repo root

On the generated checkpoint of `--arch` (Qwen2.5-VL by default) and `--size`: for each
context length and batch size, one engine holds `batch` requests that share one
prompt of `context` tokens (the first is prefilled, the others find its full pages in
the prefix cache, so setting up 16 × 8k tokens costs one 8k prefill) and then decode
together. Attention reads each sequence's history on its own whatever pages it shares,
so the step costs what `batch` distinct histories would.

Two passes over `--steps` decode-only steps:

- timed: `Engine.step()` wall time per step, and, with timers wrapped around them from
  here (production code carries no hooks), the planner, the per-step attention
  metadata (the backend's `prepare`: slots of the new tokens, each chunk's runs) and
  the sampler;
- profiled (`torch.profiler`, CPU): each aten op's self time, grouped into K/V writes
  (`index_copy_` into the pages), K/V copies (`index`, `cat`: before the in-place
  backend, the per-layer gather of every decoding sequence's whole history into a
  padded tensor; now only contexts split over several page runs in a prefill chunk),
  the attention kernel (SDPA), matmuls (QKV, O, MLP, logits) and the rest; "python and
  framework" is the timed step minus every op's self time (the profiler's own cost is
  left out that way).

The requests share their prompt's full pages (prefix cache), so each decoding
sequence's context is two runs of pages: the shared prefix and its own tail.

IPC and detokenizing are not in process: the served path adds them (compare the
served time per output token in `bench/results/peers_small.md`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.results_io import (
    ARCH_TITLES,
    add_arch_argument,
    checkpoint_label,
    markdown_table,
    write_result,
)
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.engine import Engine
from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint

# aten op name -> category of the table (first match wins; the rest is "other ops")
CATEGORIES: list[tuple[str, Callable[[str], bool]]] = [
    ("K/V write", lambda op: op == "aten::index_copy_"),
    ("K/V copies", lambda op: op in {"aten::index", "aten::cat"}),
    ("attention kernel", lambda op: "scaled_dot_product" in op or "flash_attention" in op),
    ("matmuls", lambda op: op in {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"}),
]


class StageTimers:
    """Seconds spent in a few named calls, wrapped from outside for the timed pass."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return timed

    @contextlib.contextmanager
    def around(self, engine: Engine) -> Iterator[None]:
        planner_schedule, sampler = engine.planner.schedule, engine.runner.sampler
        prepare = engine.attention.prepare
        engine.planner.schedule = self.wrap("planner", planner_schedule)  # type: ignore[method-assign]
        engine.runner.sampler = self.wrap("sampling", sampler)  # type: ignore[assignment]
        engine.attention.prepare = self.wrap("attention metadata", prepare)  # type: ignore[method-assign]
        try:
            yield
        finally:
            engine.planner.schedule = planner_schedule  # type: ignore[method-assign]
            engine.runner.sampler = sampler
            engine.attention.prepare = prepare  # type: ignore[method-assign]


def start_decoding(engine: Engine, context: int, batch: int, steps: int) -> None:
    """`batch` requests sharing one `context`-token prompt, all past their prefill."""
    vocab = engine.model.config.vocab_size
    prompt = PromptInput.text([(7 * i + 3) % (vocab - 1) + 1 for i in range(context)])
    params = Sampling(temperature=0.0, max_tokens=2 * steps + 4, ignore_eos=True)
    engine.add_request("r0", prompt, params)
    while not engine.step():  # the first prefill, chunk by chunk, until it samples
        pass
    for i in range(1, batch):
        engine.add_request(f"r{i}", prompt, params)
    while engine.planner.waiting or any(
        len(r.output_token_ids) == 0 for r in engine.requests.values()
    ):
        engine.step()


def profile_point(model_dir: str, context: int, batch: int, steps: int) -> dict[str, float]:
    """Milliseconds per decode step, by stage and by op category."""
    engine = Engine(
        EngineConfig(
            model=model_dir,
            max_model_len=context + 4 * steps + 64,
            kv_cache_memory=1 << 30,
            max_num_seqs=max(batch, 1),
        )
    )
    start_decoding(engine, context, batch, steps)
    timers = StageTimers()
    with timers.around(engine):
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - started) / steps
    ops: dict[str, float] = defaultdict(float)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    total_ops = 0.0
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6 / steps
        total_ops += seconds
        name = next((label for label, match in CATEGORIES if match(event.key)), "other ops")
        ops[name] += seconds
    row = {"step": wall}
    row.update({name: seconds / steps for name, seconds in timers.seconds.items()})
    row.update(ops)
    row["python and framework"] = max(wall - total_ops, 0.0)
    return {name: seconds * 1e3 for name, seconds in row.items()}


COLUMNS = [
    "step",
    "K/V copies",
    "K/V write",
    "attention kernel",
    "matmuls",
    "other ops",
    "python and framework",
    "attention metadata",
    "planner",
    "sampling",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    add_arch_argument(parser)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--label", default="", help="names the result file (e.g. before)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args()
    if args.quick:
        args.size, args.contexts, args.batches, args.steps = "tiny", [64], [1, 2], 2
    torch.set_num_threads(args.threads)
    model_dir = str(builtin_checkpoint(arch=args.arch, size=args.size))
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            ms = profile_point(model_dir, context, batch, args.steps)
            rows.append([context, batch, *(ms.get(column, 0.0) for column in COLUMNS)])
            print(f"context {context} batch {batch}: {ms['step']:.1f} ms/step", flush=True)
    body = (
        f"Generated {ARCH_TITLES[args.arch]} `{args.size}`, float32, {args.threads} torch "
        f"threads, {args.steps} decode steps per point; milliseconds per decode step (one token for "
        "every sequence of the batch). `step` is the timed pass; the op columns come from "
        "the profiled pass (self time); `python and framework` = step − all ops' self "
        "time; `attention metadata`, `planner` and `sampling` are timers around those "
        "calls (they overlap the op columns).\n\n"
        + markdown_table(["context", "batch", *(f"{c} ms" for c in COLUMNS)], rows)
    )
    suffix = "_quick" if args.quick else (f"_{args.label}" if args.label else "")
    write_result(
        f"decode_profile_{checkpoint_label(args.arch, args.size)}{suffix}",
        "Decode step profile at agent-length contexts (in process, CPU)",
        body,
        args.out,
    )


if __name__ == "__main__":
    main()
