"""Tensor parallelism on the CPU: TP=1 against TP=2 (gloo), in process, per step.

    python -m bench.tensor_parallel [--size small] [--arch ARCH] [--quick] [--out DIR]

Each TP size runs as `iris serve --tensor-parallel-size N` runs it, in spawned processes
(rank 0 an `Engine` with a `StepBroadcaster`, rank 1 `run_follower` unchanged; TP=1 a
plain `Engine` in one process), each rank with max(1, cores // N) torch threads as the
launcher gives them. Three workloads, greedy, after a warm-up:

- decode: 8 text prompts of 256 tokens decode 32 tokens each: ms per decode-only step;
- prefill: rounds of 4 distinct text prompts of 512 tokens (one 2048-token step each);
- images: 4 chat prompts with one 1280×720 image each (`max_tokens=1`): the steps until
  every prompt is prefilled (vision tower included; it runs on rank 0 only).

For TP=2 also rank 0's per-step overhead: the bytes of each `RankStep`, the wall time of
`StepBroadcaster.send` (encoding, ZMQ sends, the image rows' broadcast) and the image
rows broadcast, against the pixel bytes that stay on rank 0. The TP=2 tokens must equal
the TP=1 tokens: the run fails after writing its result if they do not.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.images import HD, jpeg_bytes
from bench.results_io import (
    ARCH_TITLES,
    add_arch_argument,
    add_common_arguments,
    checkpoint_label,
    markdown_table,
    write_result,
)
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler import StepBroadcaster

RESULT_TIMEOUT_SECONDS = 900.0  # one TP size's whole run
JOIN_SECONDS = 30.0


@dataclass
class Workload:
    name: str
    rounds: list[list[PromptInput]]  # each round's prompts are added at once
    sampling: Sampling
    decode_only: bool = False  # time only the steps after every prompt's first token


@dataclass
class Step:
    seconds: float
    message_bytes: int = 0  # TP=2 only, as the image fields
    send_seconds: float = 0.0
    image_rows: int = 0
    image_bytes: int = 0


@dataclass
class Measured:
    steps: list[Step] = field(default_factory=list)  # the timed steps
    outputs: list[list[int]] = field(default_factory=list)
    vit_seconds: float = 0.0


class _CountingBroadcaster(StepBroadcaster):
    """Also counts the image rows (and their bytes) each step broadcasts."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.image_rows: list[int] = []
        self.image_bytes: list[int] = []

    def send(self, plan: Any, inputs: Any) -> None:
        rows = inputs.image_embeddings if inputs.image_embeddings is not None else torch.empty(0)
        self.image_rows.append(rows.shape[0])
        self.image_bytes.append(rows.numel() * rows.element_size())
        super().send(plan, inputs)


class _Ready:
    """A follower's ready report, on its own pipe (nobody needs to read it)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def put(self, item: Any) -> None:
        self.connection.send(("ready", item))


def _run(engine: Any, broadcaster: _CountingBroadcaster | None, workload: Workload) -> Measured:
    """Steps the engine through each round, timing every step it counts."""
    measured = Measured()
    engine.drain_encoder_seconds()
    for number, prompts in enumerate(workload.rounds):
        ids = [f"{workload.name}-{number}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(request_id, prompt, workload.sampling)
        outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while engine.has_unfinished_requests():
            prefilled = all(outputs.values())
            sent = broadcaster.num_steps if broadcaster is not None else 0
            started = time.perf_counter()
            for output in engine.step():
                outputs[output.request_id].extend(output.new_token_ids)
            step = Step(time.perf_counter() - started)
            if broadcaster is not None and broadcaster.num_steps > sent:
                step.message_bytes = broadcaster.last_message_bytes
                step.send_seconds = broadcaster.last_send_seconds
                step.image_rows = broadcaster.image_rows[sent]
                step.image_bytes = broadcaster.image_bytes[sent]
            if prefilled or not workload.decode_only:
                measured.steps.append(step)
        if failed := engine.pop_failed():
            raise RuntimeError(f"{workload.name}: {failed[0].message}")
        measured.outputs += [outputs[request_id] for request_id in ids]
    measured.vit_seconds = sum(engine.drain_encoder_seconds())
    return measured


def _rank_main(
    rank: int, connection: Any, workloads: list[Workload], size: int, threads: int,
    run_dir: str, engine_kwargs: dict[str, Any],
) -> None:  # fmt: skip
    """One spawned rank: a follower (never returns), or rank 0, which runs the workloads
    and sends `("result", {name: Measured})` or `("error", text)` back."""
    from iris_serve.scheduler import (
        Engine,
        EngineConfig,
        SchedulerProcessConfig,
        join_group,
        run_follower,
    )

    torch.set_num_threads(threads)
    config = EngineConfig(tensor_parallel_size=size, **engine_kwargs)
    if rank > 0:  # as the launcher starts it; exits the process
        process = SchedulerProcessConfig(config, run_dir, num_workers=0, torch_threads=threads)
        run_follower(process, rank, _Ready(connection))
    broadcaster = None
    status = 1
    try:
        if size > 1:
            tp = join_group(Path(run_dir), 0, size, config)
            broadcaster = _CountingBroadcaster(Path(run_dir), tp)
            engine = Engine(config, tp, broadcaster)
        else:
            engine = Engine(config)
        results = {w.name: _run(engine, broadcaster, w) for w in workloads}
        connection.send(("result", results))
        status = 0
    except BaseException as error:
        connection.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        if broadcaster is not None:
            broadcaster.close()
    os._exit(status)  # as the scheduler process: no teardown of the process group


def run_group(
    size: int, threads: int, engine_kwargs: dict[str, Any], workloads: list[Workload]
) -> dict[str, Measured]:
    """Runs the workloads on a TP group of `size` spawned ranks; every rank is joined, or
    killed if it is still alive when this returns or fails."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="iris-tp-bench-") as run_dir:
        pipes = [context.Pipe(duplex=False) for _ in range(size)]
        common = (size, threads, run_dir, engine_kwargs)
        processes = [
            context.Process(
                target=_rank_main,
                args=(rank, pipes[rank][1], workloads if rank == 0 else [], *common),
                name=f"tp{size}-rank{rank}",
            )
            for rank in range(size)
        ]
        for process in processes:
            process.start()
        try:
            kind, value = _rank0_result(pipes[0][0], processes)
            if kind != "result":
                raise RuntimeError(f"TP={size}: rank 0 failed: {value}")
            for process in processes:
                process.join(JOIN_SECONDS)
                if process.exitcode != 0:
                    raise RuntimeError(f"{process.name} exited with {process.exitcode}")
            return value
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()


def _rank0_result(reader: Any, processes: list[Any]) -> tuple[str, Any]:
    """Rank 0's `(kind, value)`, skipping nothing else (followers report on their own
    pipes); fails once a rank dies without a result, or after RESULT_TIMEOUT_SECONDS."""
    deadline = time.monotonic() + RESULT_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if reader.poll(1.0):
            return reader.recv()
        dead = [p for p in processes if p.exitcode is not None]
        if dead and not reader.poll(0):  # a result may have come just before rank 0 exited
            raise RuntimeError(f"{dead[0].name} died (exit {dead[0].exitcode}) before a result")
    raise RuntimeError(f"rank 0 gave no result in {RESULT_TIMEOUT_SECONDS:.0f} s")


def text_prompt(builder: Any, num_tokens: int, seed: int) -> PromptInput:
    """`num_tokens` ids of made-up words, distinct per seed (no shared prefix)."""
    words = " ".join(f"word{(seed * 131 + i) % 997}" for i in range(num_tokens))
    ids = builder.tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
    assert len(ids) == num_tokens, (len(ids), num_tokens)
    return PromptInput.text(ids)


def image_prompt(builder: Any, size: tuple[int, int], seed: int) -> PromptInput:
    image = Image.open(io.BytesIO(jpeg_bytes(*size, seed))).convert("RGB")
    content = [{"type": "image"}, {"type": "text", "text": f"Describe picture {seed}."}]
    return builder.build(builder.render_chat([{"role": "user", "content": content}]), [image])


def workloads(model_dir: Path, quick: bool) -> list[Workload]:
    from iris_serve.tokenizer_worker import PromptBuilder

    builder = PromptBuilder(model_dir)
    decode_len, new_tokens, prefill_len, rounds = (64, 4, 128, 1) if quick else (256, 32, 512, 3)
    image_size = (320, 180) if quick else HD
    return [
        Workload(
            "warm-up",
            [[text_prompt(builder, 32, 900), image_prompt(builder, (112, 112), 900)]],
            Sampling(temperature=0.0, max_tokens=4, ignore_eos=True),
        ),
        Workload(
            "decode",
            [[text_prompt(builder, decode_len, seed) for seed in range(8)]],
            Sampling(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True),
            decode_only=True,
        ),
        Workload(
            "prefill",
            [
                [text_prompt(builder, prefill_len, 100 + 4 * r + i) for i in range(4)]
                for r in range(rounds)
            ],
            Sampling(temperature=0.0, max_tokens=1),
        ),
        Workload(
            "images",
            [[image_prompt(builder, image_size, seed) for seed in range(4)]],
            Sampling(temperature=0.0, max_tokens=1),
        ),
    ]


NOTE = """\
{cores} usable cores; each rank gets max(1, cores // TP) torch threads, as `iris serve
--tensor-parallel-size` gives them: TP=1 is 1 rank × {cores} threads, TP=2 is 2 ranks × {half}.
On a CPU this is a correctness-and-overhead check, not a speed-up claim: the same cores do
the same matmuls either way (split across ranks instead of threads), and TP=2 adds 2 gloo
all-reduces per decoder layer (after attention and after the MLP), one for the
vocab-parallel embedding and an all-gather of the logits per step, rank 0's `RankStep` per
step over ZMQ and the broadcast of the step's image rows. The vision tower runs on rank 0
only (each image encoded once), on its share of the threads. What TP buys (each rank
reading its share of the weights and KV from its own memory) needs one GPU per rank."""


def _seconds(measured: Measured) -> float:
    return sum(s.seconds for s in measured.steps)


def _ms_per_step(measured: Measured) -> float:
    return 1000 * _seconds(measured) / len(measured.steps)


def report(loads: list[Workload], by_size: dict[int, dict[str, Measured]]) -> list[list[object]]:
    """The table's rows: workload, metric, TP=1, TP=2, TP=2 / TP=1 ("-" where TP=1 has none)."""
    one, two = by_size[1], by_size[2]
    load = {w.name: w for w in loads}
    rows: list[list[object]] = []

    def both(name: str, metric: str, value: Callable[[Measured], float]) -> None:
        a, b = value(one[name]), value(two[name])
        rows.append([name, metric, a, b, b / a if a else "-"])

    decoding = len(load["decode"].rounds[0])
    prefill_tokens = sum(len(p.token_ids) for r in load["prefill"].rounds for p in r)
    both("decode", f"ms per step ({decoding} sequences)", _ms_per_step)
    both("decode", "out tok/s", lambda m: decoding * len(m.steps) / _seconds(m))
    both("prefill", "ms per step", _ms_per_step)
    both("prefill", "prompt tok/s", lambda m: prefill_tokens / _seconds(m))
    both("images", "ms until all prefilled", lambda m: 1000 * _seconds(m))
    both("images", "steps until all prefilled", lambda m: len(m.steps))
    both("images", "of which ViT ms (rank 0)", lambda m: 1000 * m.vit_seconds)
    for name in ("decode", "prefill", "images"):
        sizes = [s.message_bytes for s in two[name].steps]
        sends = [1e6 * s.send_seconds for s in two[name].steps]
        mean_max = f"{np.mean(sizes):.0f} / {max(sizes)}"
        rows.append([name, "RankStep bytes mean / max", "-", mean_max])
        p99 = np.percentile(sends, 99)
        rows.append([name, "send µs mean / p99", "-", f"{np.mean(sends):.0f} / {p99:.0f}"])
    images = two["images"].steps
    pixels = load["images"].rounds[0][0].pixels[0]
    pixel_bytes = pixels.numel() * pixels.element_size()
    mib = sum(s.image_bytes for s in images) / 2**20
    broadcast = f"{sum(s.image_rows for s in images)} ({mib:.1f})"
    largest = max(s.message_bytes for s in images)
    ratio = f"{pixel_bytes} / {largest} = {pixel_bytes / largest:.0f}x"
    rows.append(["images", "image rows broadcast (MiB)", "-", broadcast])
    rows.append(["images", "one image's pixel bytes / largest RankStep", "-", ratio])
    return [row + ["-"] * (5 - len(row)) for row in rows]


def mismatches(loads: list[Workload], by_size: dict[int, dict[str, Measured]]) -> list[str]:
    """Where TP=2's greedy tokens differ from TP=1's."""
    found = []
    for w in loads:
        pairs = zip(by_size[1][w.name].outputs, by_size[2][w.name].outputs, strict=True)
        found += [f"{w.name} request {i}" for i, (a, b) in enumerate(pairs) if a != b]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, "tiny checkpoint, short prompts, few tokens (smoke test)")
    add_arch_argument(parser)
    parser.set_defaults(size="small")
    args = parser.parse_args()
    size = "tiny" if args.quick else args.size
    from iris_serve.tiny_checkpoint import builtin_checkpoint

    model_dir = builtin_checkpoint(arch=args.arch, size=size)
    loads = workloads(model_dir, args.quick)
    cores = len(os.sched_getaffinity(0))  # the launcher's count: the cpuset, not the host
    # the same number of pages at both sizes (a page holds a rank's share of the heads)
    engine_kwargs = {"model": str(model_dir), "device": "cpu", "dtype": "float32"}
    engine_kwargs["num_kv_pages"] = 1024
    load_before = os.getloadavg()[0]  # another job on the cores skews TP=1 most (2 threads)
    by_size = {tp: run_group(tp, max(1, cores // tp), engine_kwargs, loads) for tp in (1, 2)}
    wrong = mismatches(loads, by_size)
    compared = sum(len(m.outputs) for m in by_size[1].values())
    header = ["workload", "metric", "TP=1", "TP=2", "TP=2 / TP=1"]
    verdict = (
        f"Greedy outputs: TP=2 matched TP=1 on all {compared} requests (warm-up included)."
        if not wrong
        else f"Greedy outputs: TP=2 DIFFERED from TP=1 on {', '.join(wrong)}."
    )
    verdict += f" 1-minute load average before the run: {load_before:.2f}."
    note = NOTE.format(cores=cores, half=max(1, cores // 2))
    body = "\n\n".join([markdown_table(header, report(loads, by_size)), verdict, note])
    name = f"tensor_parallel_{checkpoint_label(args.arch, size)}" + ("_quick" if args.quick else "")
    title = f"Tensor parallelism on the CPU: TP=1 vs TP=2 ({ARCH_TITLES[args.arch]} {size})"
    write_result(name, title, body, args.out)
    if wrong:
        raise SystemExit(f"TP=2 outputs differ from TP=1: {', '.join(wrong)}")


if __name__ == "__main__":
    main()
