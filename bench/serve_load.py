"""Served load: `vllm bench serve` against Iris and against `transformers serve`, and the
compute bound of the same work in process.

    bash bench/install_vllm_client.sh       # once: the vLLM client in its own venv
    python -m bench.serve_load [--size tiny|small] [--arch ARCH] [--quick] [--out DIR]
        [--client vllm|builtin] [--vllm PATH] [--no-peer] [--inline-baseline] [--threads N]
        [--iris-flags=FLAGS] [--before-tree DIR]

Two workloads, each sent to every server: `image` (`--dataset-name random-mm`: one
1280×720 random-noise JPEG + 200 random text tokens per request, 32 tokens asked back)
and `text` (`--dataset-name random`: 200 tokens in, 32 asked back); 32 requests at most 4
in flight, greedy (`--temperature 0`). The servers, one after the other on the same
generated checkpoint (`--arch`; Qwen2.5-VL by default), each started fresh and warmed up
with one image and one text request of their own:

- Iris: `iris serve` with its defaults (`bench.server_process.IrisServer`), and
  `--iris-flags` if given (`--iris-flags=--mm-encoder-beside` on CUDA, where the
  encoder runs inside the steps by default);
- with `--inline-baseline`, Iris again with `--mm-encoder-inline --max-itl-stretch 0`
  (`iris inline`): the vision encoder inside the steps and prefill chunks as large as
  the token budget, as before issue 12 (its other changes, uint8 pixels among them,
  stay: `--before-tree` measures the code before it);
- with `--before-tree DIR`, Iris again from another checkout of the repository (`git
  worktree add DIR COMMIT`) with its own defaults (`iris before`): an earlier commit
  measured in the same run, through this venv;
- the peer: Hugging Face's `transformers serve` on the same folder, device and dtype,
  through `bench.transformers_serve_launcher` (stock CLI; only the processor is built
  without torchvision, see there). It serves a VLM one request at a time: its
  continuous batching is text-only, so the image workload runs as its users meet it.

`vllm bench serve`'s random datasets always send `ignore_eos`, which `transformers serve`
refuses (422, unknown field), so each server gets the requests through its own
`bench.drop_fields_proxy` that removes that field, and answers may stop at EOS: compare
output tokens/s as well as requests/s. Iris is also measured without the proxy
(`iris direct`, `ignore_eos` honoured, fresh seeds): vLLM's usual settings, and the
proxy's cost. Each workload has its own `--seed` (a repeated
seed resends the same images, which Iris's caches would answer); both servers get the
same seed per workload, so they see the same requests (and, greedy in fp32 with Iris's
reference parity, give the same answers).

The compute bound: the same number of requests with images of the same size and the
same prompt and answer lengths (each answer as long as Iris's was, EOS ignored), through
`scheduler.engine.Engine` in this process at the same concurrency: decode the JPEG and
preprocess with `PromptBuilder`, then ViT, prefill and decode — no HTTP, no IPC. Iris's
requests/s over the bound's is the fraction to push towards 1. It runs after the servers
have stopped, on the same cores.

`--client builtin` replaces `vllm bench serve` (1.5 GB; `bash bench/install_vllm_client.sh`
installs it) by a small httpx load generator with the same metrics and definitions
(TTFT to the first chunk with output, TPOT = (latency - TTFT) / (output tokens - 1), ITL
between output chunks) and images from `bench.images`; it sends no `ignore_eos`, so it
needs no proxy.

This module starts the servers and runs the workloads; `bench.load_client` holds both
clients, `bench.compute_bound` the in-process bound, `bench.serve_load_report` the tables,
plot and result file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.compute_bound import compute_bound
from bench.load_client import (
    DEFAULT_CLIENT_VENV,
    INSTALL_HINT,
    Workload,
    chat_bodies,
    find_vllm,
    run_builtin,
    run_vllm,
    vllm_command,
)
from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_common_arguments,
    add_model_argument,
)
from bench.serve_load_report import BEFORE, INLINE, PEER, PEER_NOTE, Plan, Run, report
from bench.server_process import REPO, IrisServer, group_processes

STARTED = time.monotonic()


def plan(size: str, quick: bool, num_prompts: int | None, concurrency: int | None) -> Plan:
    if quick:  # smoke test: a few small requests, a lean server
        n, c = num_prompts or 4, concurrency or 2
        flags = [
            "--tokenizer-workers", "1", "--kv-cache-memory", "64MiB",
            "--mm-processor-cache-gb", "0.125",
        ]  # fmt: skip
        return Plan(
            [Workload("image", 32, 8, n, c, (448, 252)), Workload("text", 32, 8, n, c, None)],
            flags,
        )
    # small: its ViT takes seconds per 1280×720 image on 2 CPU cores, so fewer requests.
    n, c = num_prompts or (32 if size == "tiny" else 8), concurrency or 4
    return Plan(
        [Workload("image", 200, 32, n, c, (1280, 720)), Workload("text", 200, 32, n, c, None)],
        [],
    )


# --- the servers -----------------------------------------------------------------------


class PeerServer(IrisServer):
    """`transformers serve MODEL_DIR` through `bench.transformers_serve_launcher`, started,
    health-checked and stopped the way `IrisServer` does it."""

    label = PEER
    iris_metrics = False

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "bench.transformers_serve_launcher", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), *self.flags,
        ]  # fmt: skip


class ProxyServer(IrisServer):
    """`bench.drop_fields_proxy` in front of `upstream`, dropping `ignore_eos`."""

    label = "drop_fields_proxy"
    iris_metrics = False

    def __init__(self, upstream: str, flags: Sequence[str] = ()) -> None:
        super().__init__(REPO, ["--drop", "ignore_eos", *flags], start_timeout=60.0)
        self.upstream = upstream

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "bench.drop_fields_proxy", "--upstream", self.upstream,
            "--port", str(self.port), *self.flags,
        ]  # fmt: skip


def peer_site(vllm: Path | None) -> str | None:
    """Where accelerate (which `transformers serve` needs, from transformers[serving])
    comes from: this venv, or the folder bench/install_vllm_client.sh fills."""
    if importlib.util.find_spec("accelerate") is not None:
        return None
    venvs = [vllm.resolve().parent.parent] if vllm else []
    for venv in [*venvs, DEFAULT_CLIENT_VENV]:
        if (venv / "peer-site" / "accelerate").is_dir():
            return str(venv / "peer-site")
    raise RuntimeError(
        "`transformers serve` needs `accelerate` (transformers[serving]); it is not in this "
        f"venv and no <client venv>/peer-site has it. `{INSTALL_HINT}` puts it there, or "
        "`pip install accelerate==1.15.0 psutil==7.2.2` into this venv."
    )


def peer_flags(device: str) -> list[str]:
    """The peer on Iris's device and dtype (Iris: bf16 on CUDA, fp32 on CPU)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "float32" if device == "cpu" else "bfloat16"
    return ["--device", device, "--dtype", dtype]


@dataclass
class Target:
    label: str
    model_name: str  # what requests put in `model`
    base_url: str  # where the client sends (the proxy, with the vllm client)
    direct_url: str  # the server itself
    group: int  # the server's process group (all its processes; not the proxy's)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server's live processes so far."""
        ticks = sum(int(f[11]) + int(f[12]) for _, f in group_processes(self.group))
        return ticks / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def serving(server: IrisServer, model_name: str, label: str, proxy: bool) -> Iterator[Target]:
    with server:
        assert server.process is not None
        group = server.process.pid  # started with start_new_session: it leads its group
        if not proxy:
            yield Target(label, model_name, server.base_url, server.base_url, group)
            return
        with ProxyServer(server.base_url) as front:
            yield Target(label, model_name, front.base_url, server.base_url, group)


# --- one server, every workload --------------------------------------------------------


def measure_server(
    target: Target, workloads: Sequence[Workload], args, model_dir: Path, tokenizer,
    scratch: Path, direct: bool = False,
) -> list[Run]:  # fmt: skip
    """Every workload through `target.base_url`; with `direct`, again straight to the
    server (the vllm client's `ignore_eos` then honoured), each run with its own seed."""
    log(f"{target.label} is up at {target.direct_url}; warming up")
    for w in workloads:  # warm-up: one request per workload, seeds used nowhere else
        warm = Workload(w.name, w.input_len, w.output_len, 1, 1, w.image)
        bodies = chat_bodies(tokenizer, target.model_name, warm, args.seed + 900)
        metrics = run_builtin(target.base_url, bodies, 1)
        if metrics["failed"]:
            raise RuntimeError(f"{target.label}: warm-up failed: {metrics['errors']}")
    runs = [
        measure_one(target, target.label, target.base_url, w, args.seed + i,
                    args, model_dir, tokenizer, scratch)
        for i, w in enumerate(workloads)
    ]  # fmt: skip
    if direct:
        runs += [
            measure_one(target, f"{target.label} direct", target.direct_url, w,
                        args.seed + 100 + i, args, model_dir, tokenizer, scratch)
            for i, w in enumerate(workloads)
        ]  # fmt: skip
    return runs


def measure_one(
    target: Target, label: str, url: str, w: Workload, seed: int, args, model_dir: Path,
    tokenizer, scratch: Path,
) -> Run:  # fmt: skip
    run = Run(label, w.name, seed)
    model_name = target.model_name
    cpu_before = target.cpu_seconds()
    try:
        if args.client == "builtin":
            bodies = chat_bodies(tokenizer, model_name, w, seed)
            run.metrics = run_builtin(url, bodies, w.concurrency)
            run.command = f"built-in client, seed {seed}"
        else:
            filename = f"{label.replace(' ', '_')}-{w.name}.json"
            command = vllm_command(
                args.vllm_path, url, model_name, model_dir, w, seed, scratch, filename
            )
            run.command = shlex.join(command).replace(str(scratch), "$RESULT_DIR")
            run.metrics = run_vllm(command, scratch, filename)
        run.metrics["server_cpu_s"] = target.cpu_seconds() - cpu_before
        if run.metrics["completed"] == 0:
            run.error = f"every request failed: {run.metrics.get('errors', [])[:2]}"
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        run.error = str(error)
    log(f"{label} / {w.name}: {_brief(run)}")
    return run


def log(message: str) -> None:
    print(f"[serve_load +{time.monotonic() - STARTED:.0f}s] {message}", file=sys.stderr, flush=True)


def _brief(run: Run) -> str:
    if run.metrics is None:
        return "FAILED " + run.error[-500:]
    m = run.metrics
    return (
        f"{m['completed']} ok, {m['request_throughput']:.3g} req/s, "
        f"{m['output_throughput']:.3g} tok/s, TTFT {m['mean_ttft_ms']:.0f} ms, "
        f"TPOT {m['mean_tpot_ms']:.1f} ms"
    )


def iris_variants(args) -> list[tuple[str, list[str], Path | None]]:
    """(label, flags beyond the common ones, source tree) of each Iris server to measure."""
    variants = [("iris", shlex.split(args.iris_flags), None)]
    if args.inline_baseline:
        variants.append((INLINE, ["--mm-encoder-inline", "--max-itl-stretch", "0"], None))
    if args.before_tree:
        variants.append((BEFORE, [], args.before_tree))
    return variants


# --- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, quick_help="a few small requests (smoke test)")
    add_arch_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--client", choices=["vllm", "builtin"], default="vllm")
    parser.add_argument("--vllm", default=None, help="the `vllm` executable of the client venv")
    parser.add_argument("--no-peer", action="store_true", help=f"skip {PEER}")
    parser.add_argument(
        "--inline-baseline",
        action="store_true",
        help="also measure Iris with --mm-encoder-inline --max-itl-stretch 0 (the placement "
        "before issue 12: the encoder inside the steps, unpaced prefill chunks)",
    )
    parser.add_argument(
        "--before-tree",
        type=Path,
        default=None,
        help="also measure `iris serve` from this checkout of another commit (e.g. `git "
        "worktree add /tmp/before COMMIT`), with its defaults and this venv",
    )
    parser.add_argument("--device", default="auto", help="for both servers")
    parser.add_argument(
        "--iris-flags",
        default="",
        help="more flags for the `iris` server alone, e.g. --iris-flags=--mm-encoder-beside "
        "(on CUDA the encoder runs inside the steps by default, as in `iris inline`)",
    )
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1234, help="workload i uses seed + i")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for both servers (and Iris's --scheduler-threads) and torch "
        "threads for the bound (default: the servers' own choice; the bound uses every core)",
    )
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoTokenizer

    # With the built-in client, --vllm only says where the client venv (and peer-site) is.
    args.vllm_path = (
        find_vllm(args.vllm) if args.client == "vllm" else args.vllm and Path(args.vllm)
    )
    plan_ = plan(args.size, args.quick, args.num_prompts, args.concurrency)
    checkpoint = Checkpoint.of(args)
    model_dir = checkpoint.model_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    proxy = args.client == "vllm"
    threads_env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    threads = ["--scheduler-threads", str(args.threads)] if args.threads else []
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    peer_note = "Not measured (`--no-peer`)."
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
        scratch = Path(tmp)
        common = ["--served-model-name", "iris", "--device", args.device, *plan_.iris_flags]
        for label, flags, tree in iris_variants(args):
            server = IrisServer(
                model_dir,
                [*common, *threads, *flags],
                log_path=scratch / f"{label.replace(' ', '-')}.log",
                env=threads_env,
                source_tree=tree,
            )
            # `iris direct`: the proxy's cost, and vLLM's own settings
            direct = label == "iris" and proxy and not args.quick
            with serving(server, "iris", label, proxy) as target:
                runs += measure_server(
                    target, plan_.workloads, args, model_dir, tokenizer, scratch, direct
                )
        if not args.no_peer:
            flags = peer_flags(args.device)
            peer_note = PEER_NOTE.format(version=transformers.__version__, flags=shlex.join(flags))
            try:
                site = peer_site(args.vllm_path)
                env = {**threads_env, **({"PYTHONPATH": site} if site else {})}
                peer = PeerServer(model_dir, flags, log_path=scratch / "peer.log", env=env)
                with serving(peer, str(model_dir), PEER, proxy) as target:
                    runs += measure_server(
                        target, plan_.workloads, args, model_dir, tokenizer, scratch
                    )
            except (RuntimeError, TimeoutError) as error:
                message = f"{PEER} could not be measured: {error}"
                log(message)
                peer_note += f"\n\n**{message}**"
                runs += [Run(PEER, w.name, args.seed + i, error=str(error)[-2000:])
                         for i, w in enumerate(plan_.workloads)]  # fmt: skip

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    bounds = []
    served = {r.workload: r.metrics for r in runs if r.server == "iris" and r.metrics}
    for i, w in enumerate(plan_.workloads):
        if w.name not in served:
            continue
        lens = served[w.name].get("output_lens") or [w.output_len] * w.num_prompts
        source = "vllm" if args.client == "vllm" else "bench.images"
        log(f"compute bound / {w.name}")
        bounds.append(compute_bound(model_dir, w, lens, args.seed + 500 + i, source))
    name = f"serve_load_{checkpoint.label}" + ("_builtin" if args.client == "builtin" else "")
    name += f"_threads{args.threads}" if args.threads else ""
    name += "_vs_before" if args.before_tree else ""
    name += "_quick" if args.quick else ""
    load = (load_before, os.getloadavg()[0])
    report(args, checkpoint, name, plan_, runs, bounds, peer_note, load)
    if not served:
        raise SystemExit("Iris served no workload; see the failures above")


if __name__ == "__main__":
    main()
