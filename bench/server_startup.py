"""How long `iris serve` takes to answer `/health`, and the CPU time its processes spend.

Each variant is a set of `iris serve` flags; the variants start in turns, `--reps` times
each, one server at a time. A start is timed from the launch to the first 200 from
`/health`; the CPU seconds are the whole process tree's (the launcher waits for its
children, so theirs are in its own), start to stop.

    python -m bench.server_startup [--size tiny|small] [--reps 4] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_common_arguments,
    markdown_table,
    write_result,
)
from bench.server_process import IrisServer

BASE_FLAGS = ("--kv-cache-memory", "64MiB", "--mm-shm-arena-bytes", "128MiB")
VARIANTS: dict[str, tuple[str, ...]] = {
    "2 tokenizer workers (default)": (),
    "1 tokenizer worker": ("--tokenizer-workers", "1"),
}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_start(checkpoint: Checkpoint, flags: tuple[str, ...]) -> tuple[float, float]:
    """(seconds until `/health` answered, CPU seconds of the process tree) for one start."""
    cpu_before = children_cpu_seconds()
    server = IrisServer(checkpoint.model_dir, (*BASE_FLAGS, *flags))
    started = time.perf_counter()
    with server:
        ready = time.perf_counter() - started
    return ready, children_cpu_seconds() - cpu_before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    add_arch_argument(parser)
    parser.add_argument("--reps", type=int, default=4, help="starts per variant")
    args = parser.parse_args(argv)
    reps = 1 if args.quick else args.reps
    checkpoint = Checkpoint.of(args)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for _ in range(reps):
        for name, flags in VARIANTS.items():
            times[name].append(one_start(checkpoint, flags))
    baseline = statistics.median(ready for ready, _ in times[next(iter(VARIANTS))])
    rows = []
    for name, measured in times.items():
        ready = statistics.median(r for r, _ in measured)
        cpu = statistics.median(c for _, c in measured)
        every = " ".join(f"{r:.1f}" for r, _ in measured)
        rows.append([name, ready, ready / baseline, cpu, every])
    body = (
        f"{checkpoint.sentence} Flags for all: `{' '.join(BASE_FLAGS)}`; {reps} start(s) per "
        "variant, in turns; medians.\n\n"
        + markdown_table(
            ["variant", "up s", "÷ default", "CPU s (start and stop)", "every start, s"], rows
        )
    )
    name = f"server_startup_{checkpoint.label}" + ("_quick" if args.quick else "")
    write_result(name, f"`iris serve` start-up ({checkpoint.title})", body, args.out)


if __name__ == "__main__":
    main()
