"""Served load: the same workloads sent to several servers in one run, and each server's
figures against the first's.

    python -m bench.serve_load [--size tiny|small] [--arch ARCH | --model DIR] [--quick]
        [--workloads image,text,append,window,agents,decode,video,clips,gaps]
        [--variant NAME=FLAGS ...] [--model-variant 'NAME=DIR [FLAGS]' ...]
        [--before-tree [NAME=]DIR ...] [--flags=FLAGS] [--rounds N] [--interleave] [--threads N]
        [--client builtin|vllm] [--vllm PATH] [--num-prompts N] [--concurrency N]
        [--output-len N] [--decode CONTEXTxBATCH,...] [--no-bound] [--name NAME] [--out DIR]

The servers, on the same checkpoint (generated, `--arch`, Qwen2.5-VL by default, or
`--model`), each started fresh and warmed up:

- `iris`: `iris serve` from this tree with its defaults (and `--flags`, given to every
  Iris server); it is the base every other server is compared with;
- each `--variant NAME=FLAGS`: `iris serve` with FLAGS added; leading `VAR=value` words
  are its environment, e.g. `--variant 'passive=OMP_WAIT_POLICY=PASSIVE'`,
  `--variant 'inline=--mm-encoder-placement inline --max-itl-stretch 0'`;
- each `--model-variant 'NAME=DIR [FLAGS]'`: `iris serve` of another checkpoint (a
  quantized copy of the model, `iris tiny-model --quant fp8`) with FLAGS added; the
  workloads' tokens come from the first checkpoint's tokenizer, so it must share it;
- `--before-tree [NAME=]DIR` (repeatable): NAME (default `before`), `iris serve` from
  another checkout (`git worktree add DIR COMMIT`) with its own defaults, through this
  venv (`bench.server_process.namespace_shim`): an earlier commit measured in the same run.

`bench.peers` measures vLLM's CPU build and `transformers serve` with this same code.

The workloads (`--workloads`, default `image,text`), greedy:

- `image`, the cold workload: each request one new 1280×720 noise JPEG + 200 random text
  tokens, 32 tokens asked back, 4 in flight (`--num-prompts`, 32 on tiny, 8 on small);
  the built-in client (`bench.load_client`) or `vllm bench serve --dataset-name random-mm`
  (`--client vllm`, from `bash bench/install_vllm_client.sh`);
- `text`: the same without the image (`random`);
- `append` and `window`: the agent workloads of `bench.scenario` (a history that grows by
  one 640×480 screenshot per round, 16 rounds, mean over 9-16; the last 10 screenshots,
  steps 0-6, mean over 1-6), one request at a time, `ignore_eos`;
- `agents`: 12 `append` agents taking turns, 4 rounds each, mean over the returning rounds
  2-4, with the prefix cache's hit rate (and on Iris with `--kv-offload-gib`, the host
  tier's share of it and its copy cost per KV page); give the servers a KV cache that
  holds a few histories (`bench.peers --kv-tokens`) so that agents come back evicted;
- `decode`: per `--decode` point, `batch` distinct random prompts of `context` tokens
  sent at once, 64 tokens each with `ignore_eos`: the median inter-token latency is the
  served decode step at that batch and context;
- `video` and `clips`: the video workloads of `bench.video_scenario`: one 10 s clip of a
  640×360 30 fps screen recording asked 8 questions in a growing conversation (the first
  is the cold video), and its clips 0-10 s, 5-15 s and 10-20 s, each asked once; one
  request at a time, `ignore_eos`. The report adds how fast one tokenizer worker decodes
  and resizes each workload's clip (`bench.video_decoding`, in process).
- `gaps` (`bench.encode_gaps`): one stream's largest inter-token gap while three new
  1920×1080 images arrive and encode, the check that image work stays off the decode
  path; with `--before-tree` and `--interleave` it holds a change to that.

`--rounds N` sends every workload N times, new requests each round; `--interleave` starts
every server at once and takes their workloads in turns (a burst of other work on the
machine then hits every server alike), default one server after another. Then, for
`image` and `text`, the compute bound: the same work through the in-process engine
(`bench.compute_bound`), `iris`'s requests/s over the bound's being the fraction to push
towards 1. The report (`bench.serve_load_report`): each run, the means over rounds, and
`iris ahead of X` (above 1: `iris` better).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import scenario, video_scenario
from bench.compute_bound import compute_bound
from bench.encode_gaps import GapsWorkload
from bench.encode_gaps import measure as measure_gaps
from bench.load_client import Workload, chat_bodies, find_vllm, run_builtin, run_vllm, vllm_command
from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_common_arguments,
    add_model_argument,
    checkout_commit,
)
from bench.serve_load_report import Run, report
from bench.server_process import (
    IrisServer,
    group_processes,
    group_rss_bytes,
    measure_each,
    run_interleaved,
)
from bench.video_decoding import decode_rates
from bench.video_scenario import VideoWorkload

WORKLOADS = ("image", "text", "append", "window", "agents", "decode", "video", "clips", "gaps")
AGENTS = 12  # `agents`: conversations taking turns
SCREENSHOT = (640, 480)
DECODE_TOKENS = 64
RECORDING, QUICK_RECORDING = ((640, 360), 30.0), ((160, 90), 8.0)  # (width, height), fps
VIDEO_QUESTIONS = 8
CLIP_SPANS = ((0.0, 10.0), (5.0, 15.0), (10.0, 20.0))  # seconds of one recording
QUICK_CLIP_SPANS = ((0.0, 2.0), (1.0, 3.0))
DECODE_REPEATS = 5  # of the in-process decoding of each video workload's clip
GAP_IMAGES, GAP_IMAGE, QUICK_GAP_IMAGE = 3, (1920, 1080), (448, 252)

Planned = Workload | scenario.Agent | VideoWorkload | GapsWorkload


@dataclass(frozen=True)
class Plan:
    """What every server gets: the workloads in order, and how many rounds of them."""

    workloads: list[Planned]
    rounds: int


def make_plan(args: argparse.Namespace) -> Plan:
    quick, names = args.quick, args.workloads.split(",")
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose among {','.join(WORKLOADS)}")
    out = args.output_len or (8 if quick else 32)
    n = args.num_prompts or (4 if quick else 32 if args.size == "tiny" else 8)
    c = args.concurrency or (2 if quick else 4)
    in_len, image = (32, (448, 252)) if quick else (200, (1280, 720))
    shot = (320, 180) if quick else SCREENSHOT
    (size, fps), spans = (QUICK_RECORDING, QUICK_CLIP_SPANS) if quick else (RECORDING, CLIP_SPANS)
    chosen: list[Planned] = []
    for name in names:
        if name in ("image", "text"):
            chosen.append(Workload(name, in_len, out, n, c, image if name == "image" else None))
        elif name == "append":
            chosen.append(
                scenario.Agent("append", 3 if quick else 16, shot, out, 2 if quick else 9)
            )
        elif name == "window":
            chosen.append(scenario.Agent("window", 2 if quick else 7, shot, out, 1))
        elif name == "agents":  # every agent's round 1 is cold; its later rounds return
            turns, agents = (2, 3) if quick else (4, AGENTS)
            chosen.append(scenario.Agent("agents", turns, shot, out, 2, agents=agents))
        elif name == "video":
            questions = 2 if quick else VIDEO_QUESTIONS
            chosen.append(VideoWorkload("video", spans[:1], questions, size, fps, out, 2))
        elif name == "clips":
            chosen.append(VideoWorkload("clips", spans, 1, size, fps, out, 1))
        elif name == "gaps":
            chosen.append(GapsWorkload("gaps", GAP_IMAGES, QUICK_GAP_IMAGE if quick else GAP_IMAGE))
        else:
            for point in ("128x2" if quick else args.decode).split(","):
                context, batch = map(int, point.split("x"))
                tokens = 8 if quick else DECODE_TOKENS
                chosen.append(Workload(f"decode {point}", context, tokens, batch, batch, None))
    return Plan(chosen, 1 if quick else args.rounds)


# --- the servers -----------------------------------------------------------------------


@dataclass
class Server:
    """One server to measure: its name in the tables, the server (not started) and how it
    is started, for the result."""

    name: str
    server: IrisServer
    how: str
    rss_mib: float | None = None  # its processes' resident memory once warmed up
    weights: str | None = None  # an Iris server's linear weights, as its start-up says


LINEAR_WEIGHTS = re.compile(
    r"linear weights: (.+?) resident per rank, ([\d.]+)x their dense size \((.*)\)$", re.M
)


def linear_weights(log: str) -> str | None:
    """`"40.1 MiB (0.45x): onednn method; awq for 56 layers at 0.31x, through int4-cpu"`:
    what an Iris server's start-up line says its linear layers hold per rank, that over
    their dense size in the model's dtype, and how they compute; None for another server."""
    found = LINEAR_WEIGHTS.search(log)
    return None if found is None else f"{found.group(1)} ({found.group(2)}x): {found.group(3)}"


def parse_variant(spec: str) -> tuple[str, list[str], dict[str, str]]:
    """`NAME=FLAGS` -> (name, flags, environment from FLAGS' leading `VAR=value` words)."""
    name, equals, rest = spec.partition("=")
    if not equals or not re.fullmatch(r"[\w.+-]+", name) or name in ("iris", "before"):
        raise SystemExit(f"--variant {spec!r}: expected NAME=FLAGS, NAME not iris or before")
    words = shlex.split(rest)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name, words, env


def iris_servers(args: argparse.Namespace, model_dir: Path, logs: Path) -> list[Server]:
    """`iris`, each `--variant`, each `--model-variant` and each `--before-tree`, in that
    order."""
    threads = ["--scheduler-threads", str(args.threads)] if args.threads else []
    common = [*(scenario.QUICK_FLAGS if args.quick else []), *shlex.split(args.flags), *threads]
    common += ["--device", args.device]
    specs = [
        ("iris", None, [], {}),
        *((name, None, flags, env) for name, flags, env in map(parse_variant, args.variant)),
        *map(parse_model_variant, args.model_variant),
    ]
    servers = []
    for name, other_model, flags, env in specs:
        env = {**thread_env(args), **env}
        served = model_dir if other_model is None else other_model
        server = IrisServer(served, [*common, *flags], env=env, log_path=logs / f"{name}.log")
        shown = "MODEL_DIR" if other_model is None else str(other_model)
        how = shlex.join([*(f"{k}={v}" for k, v in env.items()), "iris", "serve", shown,
                          *common, *flags])  # fmt: skip
        servers.append(Server(name, server, f"`{how}`"))
    for name, tree in map(parse_before_tree, args.before_tree):
        server = IrisServer(model_dir, common, env=thread_env(args), source_tree=tree,
                            log_path=logs / f"{name}.log")  # fmt: skip
        how = f"`{shlex.join(['iris', 'serve', 'MODEL_DIR', *common])}`"
        servers.append(Server(name, server, f"{how} from `{tree}`, commit {checkout_commit(tree)}"))
    return servers


def parse_model_variant(spec: str) -> tuple[str, Path, list[str], dict[str, str]]:
    """`NAME=DIR [FLAGS]` -> (name, the checkpoint DIR, flags, environment): this tree's
    `iris serve` on another checkpoint (a quantized copy of the model, say)."""
    name, words, env = parse_variant(spec)
    if not words:
        raise SystemExit(f"--model-variant {spec!r}: expected NAME=DIR [FLAGS]")
    return name, Path(words[0]).resolve(), words[1:], env


def parse_before_tree(spec: str) -> tuple[str, Path]:
    """`[NAME=]DIR` -> (name, the checkout's path); the name defaults to `before`."""
    name, equals, tree = spec.partition("=")
    if not equals:
        name, tree = "before", spec
    if not re.fullmatch(r"[\w.+-]+", name) or name == "iris":
        raise SystemExit(f"--before-tree {spec!r}: expected [NAME=]DIR, NAME not iris")
    return name, Path(tree).resolve()


def thread_env(args: argparse.Namespace) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}


# --- measuring -------------------------------------------------------------------------


def cpu_seconds(server: IrisServer) -> float:
    """User + system CPU time of the server's live processes so far."""
    assert server.process is not None  # started with start_new_session: it leads a group
    ticks = sum(int(f[11]) + int(f[12]) for _, f in group_processes(server.process.pid))
    return ticks / os.sysconf("SC_CLK_TCK")


def steps(
    entry: Server, plan: Plan, args: argparse.Namespace, model_dir: Path, tokenizer: Any,
    scratch: Path,
) -> Iterator[Run]:  # fmt: skip
    """One started server: the warm-up, then a `Run` per round and workload."""
    server = entry.server
    model = server.model_name()
    log(f"{entry.name} is up at {server.base_url}; warming up")
    for image in ((96, 64), None):  # seeds used nowhere else
        warm = Workload("warm-up", 32, 4, 1, 1, image)
        metrics = run_builtin(server.base_url, chat_bodies(tokenizer, model, warm, 900), 1)
        if metrics["failed"]:
            raise RuntimeError(f"{entry.name}: warm-up failed: {metrics['errors']}")
    with httpx.Client(timeout=600) as client:
        if any(isinstance(w, scenario.Agent) for w in plan.workloads):
            scenario.warm_up(client, server, model)
        videos = [w for w in plan.workloads if isinstance(w, VideoWorkload)]
        if videos:
            video_scenario.warm_up(client, server, model, videos)
    entry.rss_mib = group_rss_bytes(server.process.pid) / 2**20
    entry.weights = linear_weights(server.log)
    for round_ in range(plan.rounds):
        for i, w in enumerate(plan.workloads):
            seed = workload_seed(args, round_, i)
            run = Run(entry.name, w.name, round_, seed)
            cpu_before = cpu_seconds(server)
            try:
                run.metrics, run.rows, run.command = measure(
                    w, server, model, seed, args, model_dir, tokenizer, scratch
                )
                run.metrics["server_cpu_s"] = cpu_seconds(server) - cpu_before
                if run.metrics["completed"] == 0:
                    run.error = f"every request failed: {run.metrics.get('errors', [])[:2]}"
            except (RuntimeError, TimeoutError, httpx.HTTPError, subprocess.SubprocessError) as e:
                run.error = str(e)[-2000:]
            log(f"{entry.name} / {w.name} round {round_}: {brief(run)}")
            yield run


def workload_seed(args: argparse.Namespace, round_: int, index: int) -> int:
    """The seed of the `index`th workload's requests in round `round_` (the agents use
    seed + 0..16, a video workload the recording `seed`)."""
    return args.seed + 1000 * round_ + 100 * index


def measure(
    w: Planned, server: IrisServer, model: str, seed: int,
    args: argparse.Namespace, model_dir: Path, tokenizer: Any, scratch: Path,
) -> tuple[dict[str, Any], list[dict[str, Any]], str]:  # fmt: skip
    """(summary metrics, per-request rows of an agent workload, client command) of one
    workload sent to one server."""
    if isinstance(w, scenario.Agent):
        rows = list(scenario.requests(w, server, model, seed))
        return scenario.summary(w, rows), rows, ""
    if isinstance(w, VideoWorkload):
        rows = list(video_scenario.requests(w, server, model, seed))
        return video_scenario.summary(w, rows), rows, ""
    if isinstance(w, GapsWorkload):
        return measure_gaps(w, server.base_url, model, seed), [], ""
    if w.name.startswith("decode") or args.client == "builtin":
        bodies = chat_bodies(tokenizer, model, w, seed)
        if w.name.startswith("decode"):
            bodies = [json.dumps({**json.loads(b), "ignore_eos": True}).encode() for b in bodies]
        return run_builtin(server.base_url, bodies, w.concurrency), [], f"built-in, seed {seed}"
    filename = f"{server.port}-{w.name}-{seed}.json"
    command = vllm_command(args.vllm_path, server.base_url, model, model_dir, w, seed, scratch,
                           filename)  # fmt: skip
    shown = shlex.join(command).replace(str(scratch), "$RESULT_DIR")
    return run_vllm(command, scratch, filename), [], shown


def measure_all(
    servers: Sequence[Server], plan: Plan, args: argparse.Namespace, model_dir: Path,
    interleave: bool = False,
) -> list[Run]:  # fmt: skip
    """Every server on every workload: one server after another (the others stopped), or
    all up at once and measured in turns; a server that fails leaves its error in a Run."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    by_name = {entry.name: entry for entry in servers}
    named = [(entry.name, entry.server) for entry in servers]
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:

        def runs_of(name: str, _: IrisServer) -> Iterator[Run]:
            return steps(by_name[name], plan, args, model_dir, tokenizer, Path(tmp))

        if interleave:
            measured: dict[str, Any] = run_interleaved(named, runs_of)
        else:
            measured = measure_each(named, lambda n, s: list(runs_of(n, s)),
                                    overlap_start=args.quick, keep_going=True)  # fmt: skip
    runs = []
    for name, result in measured.items():
        if isinstance(result, Exception):
            result = [Run(name, w.name, 0, 0, error=str(result)[-3000:]) for w in plan.workloads]
        runs += result
    return runs


STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[serve_load +{time.monotonic() - STARTED:.0f}s] {message}", file=sys.stderr, flush=True)


def brief(run: Run) -> str:
    if run.metrics is None:
        return "FAILED " + run.error[-500:]
    m = run.metrics
    figures = [f"{m['completed']} ok", f"TTFT {m['mean_ttft_ms']:.0f} ms"]
    if "max_gap_ms" in m:
        figures.append(f"largest gap {m['max_gap_ms']:.1f} ms")
    else:
        figures.append(f"TPOT {m['mean_tpot_ms']:.1f} ms")
    if "request_throughput" in m:
        figures.append(f"{m['request_throughput']:.3g} req/s")
    return ", ".join(figures)


# --- the command line ------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, workloads: str) -> None:
    """What `bench.serve_load` and `bench.peers` share."""
    add_common_arguments(parser, quick_help="a few small requests (smoke test)")
    add_arch_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--workloads", default=workloads, help=f"among {','.join(WORKLOADS)}")
    parser.add_argument("--client", choices=["builtin", "vllm"], default="builtin",
                        help="image/text: the built-in client or `vllm bench serve`")  # fmt: skip
    parser.add_argument("--vllm", default=None, help="the `vllm` of the client venv")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-prompts", type=int, default=None, help="image/text requests")
    parser.add_argument("--concurrency", type=int, default=None, help="image/text in flight")
    parser.add_argument("--output-len", type=int, default=None, help="tokens asked back")
    parser.add_argument("--decode", default="4096x1,4096x8,8192x1,8192x8",
                        help="the decode workload's CONTEXTxBATCH points")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--rounds", type=int, default=1, help="of every workload")
    parser.add_argument("--name", default=None, help="of the result file")


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser, "image,text")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="another iris serve, with FLAGS added (repeatable)")  # fmt: skip
    parser.add_argument("--model-variant", action="append", default=[], metavar="NAME=DIR [FLAGS]",
                        help="another iris serve, of the checkpoint in DIR (e.g. its quantized "
                        "copy), with FLAGS added (repeatable)")  # fmt: skip
    parser.add_argument("--before-tree", action="append", default=[], metavar="[NAME=]DIR",
                        help="also iris serve from this checkout of another commit, named "
                        "NAME (default: before; repeatable)")  # fmt: skip
    parser.add_argument("--flags", default="", help="more flags for every Iris server")
    parser.add_argument("--interleave", action="store_true", help="servers up at once")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS and --scheduler-threads for every server")  # fmt: skip
    parser.add_argument("--no-bound", action="store_true", help="skip the compute bound")
    return parser.parse_args(argv)


def run(
    args: argparse.Namespace, make_servers: Callable[[Path, Path], list[Server]], name: str,
    bound: bool, interleave: bool = False,
) -> list[Run]:  # fmt: skip
    """The servers `make_servers(model_dir, log folder)` measured on `args.workloads`, the
    compute bound if `bound`, and the result file `name`; returns the runs."""
    args.vllm_path = find_vllm(args.vllm) if args.client == "vllm" else None
    plan = make_plan(args)
    checkpoint = Checkpoint.of(args)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="serve_load-logs-") as logs:
        servers = make_servers(checkpoint.model_dir, Path(logs))
        runs = measure_all(servers, plan, args, checkpoint.model_dir, interleave)
    load = (load_before, os.getloadavg()[0])
    bounds = []
    first = {r.workload: r.metrics for r in runs if r.server == servers[0].name and r.metrics}
    for i, w in enumerate(plan.workloads):
        if bound and w.name in ("image", "text") and w.name in first:
            import torch

            torch.set_num_threads(getattr(args, "threads", None) or os.cpu_count() or 1)
            lens = first[w.name].get("output_lens") or [w.output_len] * w.num_prompts
            log(f"compute bound / {w.name}")
            source = "vllm" if args.client == "vllm" else "bench.images"
            bounds.append(compute_bound(checkpoint.model_dir, w, lens, args.seed + 500 + i, source))
    videos = [(w, workload_seed(args, 0, i)) for i, w in enumerate(plan.workloads)
              if isinstance(w, VideoWorkload)]  # fmt: skip
    if videos:
        log("video decoding, in process")
    rates = decode_rates(checkpoint.model_dir, videos, 1 if args.quick else DECODE_REPEATS)
    name = args.name or name + ("_quick" if args.quick else "")
    report(args, checkpoint, name, plan, servers, runs, bounds, load, rates)
    return runs


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_arguments(argv)
    name = f"serve_load_{Checkpoint.of(args).label}" + ("_vs_before" if args.before_tree else "")
    runs = run(args, lambda model_dir, logs: iris_servers(args, model_dir, logs), name,
               bound=not args.no_bound, interleave=args.interleave)  # fmt: skip
    if not any(r.metrics for r in runs if r.server == "iris"):
        raise SystemExit("iris served no workload; see the failures above")


if __name__ == "__main__":
    main()
