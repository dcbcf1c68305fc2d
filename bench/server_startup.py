"""How long `iris serve` takes to answer `/health` and to stop, and the CPU time its
processes spend.

Each variant is a set of `iris serve` flags, from this tree and, with `--before-tree DIR`,
from another checkout too (`git worktree add DIR COMMIT`); the variants start in turns,
`--reps` times each, one server at a time. A start is timed from the launch to the first
200 from `/health`; a stop from SIGTERM until the launcher has exited (it waits for its
children first), with nothing in flight, and in one more variant with a stream still
running (its grace period, `--shutdown-timeout 1`, then the teardown). The CPU seconds are the whole process tree's
(the launcher waits for its children, so theirs are in its own), start to stop.

    python -m bench.server_startup [--size tiny|small] [--reps 4] [--before-tree DIR]
        [--quick] [--out DIR]

`--quick` (the smoke test) starts the default and the in-flight variant once each.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_common_arguments,
    checkout_commit,
    markdown_table,
    write_result,
)
from bench.server_process import IrisServer

BASE_FLAGS = ("--kv-cache-memory", "64MiB", "--mm-shm-arena-bytes", "128MiB")
GRACE_SECONDS = 1  # --shutdown-timeout of the variant stopped with a stream in flight
IN_FLIGHT = f"a stream in flight at the stop (--shutdown-timeout {GRACE_SECONDS})"
VARIANTS: dict[str, tuple[str, ...]] = {
    "2 tokenizer workers (default)": (),
    "1 tokenizer worker": ("--tokenizer-workers", "1"),
    IN_FLIGHT: ("--shutdown-timeout", str(GRACE_SECONDS)),
}
DEFAULT = next(iter(VARIANTS))
QUICK_VARIANTS = (DEFAULT, IN_FLIGHT)  # `--quick`: the baseline and the stop with a stream


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_start(
    checkpoint: Checkpoint, flags: tuple[str, ...], tree: Path | None
) -> tuple[float, float, float]:
    """(seconds until `/health` answered, seconds to stop, CPU seconds of the process
    tree) for one start of `tree`'s code (None: this tree's)."""
    cpu_before = children_cpu_seconds()
    server = IrisServer(checkpoint.model_dir, (*BASE_FLAGS, *flags), source_tree=tree)
    started = time.perf_counter()
    server.start()
    ready = time.perf_counter() - started
    if "--shutdown-timeout" in flags:
        streaming = start_stream(server)
        if not streaming.wait(60):
            server.stop()
            raise RuntimeError(f"no streamed token in 60 s: {server.log_path}")
    stopping = time.perf_counter()
    status = server.stop()
    if status != 0:
        raise RuntimeError(f"iris serve exited with {status} on SIGTERM: {server.log_path}")
    return ready, time.perf_counter() - stopping, children_cpu_seconds() - cpu_before


def start_stream(server: IrisServer) -> threading.Event:
    """Starts a long streamed answer in a thread; the event is set at its first chunk.
    The stream ends when the server's shutdown aborts it."""
    streaming = threading.Event()
    body = {
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 20_000,
        "ignore_eos": True,
        "stream": True,
    }

    def read() -> None:
        url = f"{server.base_url}/v1/chat/completions"
        try:
            with httpx.stream("POST", url, json=body, timeout=120) as response:
                for _ in response.iter_lines():
                    streaming.set()
        except httpx.HTTPError:
            pass  # the server went away mid-stream: what the stop is about

    threading.Thread(target=read, daemon=True).start()
    return streaming


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    add_arch_argument(parser)
    parser.add_argument("--reps", type=int, default=4, help="starts per variant")
    parser.add_argument(
        "--before-tree",
        type=Path,
        default=None,
        help="also every variant from this checkout",
    )
    args = parser.parse_args(argv)
    reps = 1 if args.quick else args.reps
    checkpoint = Checkpoint.of(args)
    trees: dict[str, Path | None] = {"": None}
    if args.before_tree is not None:
        trees[f" @ {checkout_commit(args.before_tree)}"] = args.before_tree
    runs = {
        name + suffix: (flags, tree)
        for suffix, tree in trees.items()
        for name, flags in VARIANTS.items()
        if name in QUICK_VARIANTS or not args.quick
    }
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, (flags, tree) in runs.items():
            times[name].append(one_start(checkpoint, flags, tree))
    baseline = statistics.median(ready for ready, _, _ in times[next(iter(runs))])
    rows = []
    for name, measured in times.items():
        ready = statistics.median(r for r, _, _ in measured)
        stop = statistics.median(s for _, s, _ in measured)
        cpu = statistics.median(c for _, _, c in measured)
        every = " ".join(f"{r:.1f}" for r, _, _ in measured)
        rows.append([name, ready, ready / baseline, stop, cpu, every])
    body = (
        f"{checkpoint.sentence} Flags for all: `{' '.join(BASE_FLAGS)}`; {reps} start(s) per "
        "variant, in turns; medians. `stop s`: SIGTERM with nothing in flight until the "
        "launcher exited.\n\n"
        + markdown_table(
            ["variant", "up s", "÷ default", "stop s", "CPU s (start and stop)", "every start, s"],
            rows,
        )
    )
    name = f"server_startup_{checkpoint.label}" + ("_quick" if args.quick else "")
    write_result(name, f"`iris serve` start-up and stop ({checkpoint.title})", body, args.out)


if __name__ == "__main__":
    main()
