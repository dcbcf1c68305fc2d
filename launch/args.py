"""`iris serve` flags. Names follow vLLM's where one exists.

Every flag comes from a config dataclass field (`launch.config_flags`): the launcher's
own in `ServeArgs`, the scheduler's in `EngineConfig`, the workers' in `WorkerConfig`.
`ServeArgs.engine` and `ServeArgs.worker` hold only the fields whose flags were given,
so everything else keeps the dataclass's default.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Literal

from ..scheduler import EngineConfig
from ..tokenizer_worker import WorkerConfig
from .config_flags import GiB, add_config_flags, config_kwargs

__all__ = ["GiB", "ServeArgs", "build_parser", "parse_serve_args"]

_CACHES = """\
Each tokenizer worker owns one shared-memory arena of --mm-processor-cache-gb GiB. It
carries the pixels of the images in flight to the scheduler and keeps, in the rest, the
processor cache: processed images by the hash of their bytes and processor settings,
least recently used evicted first when room is needed; an image in flight is never
evicted. A request goes to the worker most of its images were sent to before, so a
conversation or an agent's window of screenshots finds its earlier images there.
/dev/shm must hold tokenizer-workers x that size (the arenas are reserved at start-up).
The scheduler keeps vision-encoder outputs per image in the embedding cache and KV pages
in the prefix cache."""


def _flag(flag: str, help: str, **more: object) -> dict[str, object]:
    return {"flag": flag, "help": help, **more}


@dataclass(frozen=True)
class ServeArgs:
    """What `iris serve` was asked for: the launcher's own settings, and the role
    configs' fields given on the command line (by field name)."""

    model: str | None = None  # the positional MODEL
    host: str = field(default="127.0.0.1", metadata=_flag("--host", "address to listen on"))
    port: int = field(default=8000, metadata=_flag("--port", "port to listen on"))
    served_model_name: list[str] | None = field(
        default=None,
        metadata=_flag("--served-model-name", "the model's name(s) in the API (default: MODEL)"),
    )
    tokenizer_workers: int = field(
        default=2, metadata=_flag("--tokenizer-workers", "tokenizer worker processes", min=1)
    )
    data_parallel_size: int = field(
        default=1,
        metadata=_flag(
            "--data-parallel-size",
            "model replicas, each with its own scheduler (and tensor-parallel ranks), KV "
            "and embedding caches, and tokenizer workers (worker i serves replica i mod N; "
            "at least N workers are started); the image router keeps a conversation on "
            "the replica that holds its images",
            min=1,
        ),
    )
    generation_config: str = field(
        default="auto",
        metadata=_flag(
            "--generation-config",
            "sampling defaults for fields a request leaves out: auto (the model's "
            "generation_config.json, as vLLM), vllm (ignore it), or a folder holding one",
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_flag(
            "--chat-template",
            "a Jinja chat template, or the file holding one, instead of the model's",
        ),
    )
    revision: str | None = field(
        default=None, metadata=_flag("--revision", "the hub revision (branch, tag, commit)")
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=_flag(
            "--trust-remote-code",
            "accepted for vLLM compatibility; Iris runs its own model code, so it has no effect",
        ),
    )
    shutdown_timeout: float = field(
        default=5.0,
        metadata=_flag(
            "--shutdown-timeout",
            "seconds running requests may take to finish after SIGINT/SIGTERM; then they "
            "end as aborted (streams with finish_reason abort and [DONE])",
            min=0,
        ),
    )
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata=_flag(
            "--enable-auto-tool-choice",
            'let the model decide when to call tools (tool_choice "auto", the default '
            "when a request has tools), reading its calls with --tool-call-parser",
        ),
    )
    tool_call_parser: Literal["hermes"] = field(
        default="hermes",
        metadata=_flag(
            "--tool-call-parser",
            "how the model writes tool calls: hermes (<tool_call>{json}</tool_call>: "
            "Qwen2.5-VL, Qwen3-VL)",
        ),
    )
    max_logprobs: int = field(
        default=20,
        metadata=_flag("--max-logprobs", "most top logprobs a request may ask for", min=0),
    )
    scheduler_threads: int | None = field(
        default=None,
        metadata=_flag(
            "--scheduler-threads",
            "torch CPU threads of the scheduler (default: every core it may run on)",
            min=1,
        ),
    )
    api_key: str | None = field(
        default=None, metadata=_flag("--api-key", "require this bearer token")
    )
    dynamo: bool = field(
        default=False,
        metadata=_flag(
            "--dynamo",
            "serve as an NVIDIA Dynamo backend worker instead of an HTTP server: register "
            "with Dynamo's discovery (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE, "
            "DYN_EVENT_PLANE, as Dynamo's own workers), take its frontend's requests and "
            "publish the prefix cache's KV events to its router (needs "
            "pip install 'iris-serve[dynamo]'; docs/scale-out.md)",
        ),
    )
    dynamo_endpoint: str = field(
        default="iris.backend.generate",
        metadata=_flag(
            "--dynamo-endpoint",
            "the Dynamo endpoint served with --dynamo, namespace.component.endpoint",
        ),
    )
    log_level: str = field(default="info", metadata=_flag("--log-level", "debug, info, ..."))
    startup_timeout: float = field(
        default=600.0,
        metadata=_flag("--startup-timeout", "seconds the workers and the scheduler may take"),
    )
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields given
    worker: dict[str, Any] = field(default_factory=dict)  # WorkerConfig fields given


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,  # `--tokenizer x` must not pass for `--tokenizer-workers x`
        prog="iris serve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="OpenAI-compatible server. MODEL: a local folder or a hub id; "
        "without one, the built-in tiny Qwen2.5-VL checkpoint is generated and served.",
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL")
    add_config_flags(p, ServeArgs)
    engine = p.add_argument_group("scheduler")
    worker = p.add_argument_group("tokenizer workers")
    caches = {"caches": p.add_argument_group("multimodal and prefix caches", _CACHES)}
    add_config_flags(p, WorkerConfig, section=worker, groups=caches)
    add_config_flags(p, EngineConfig, section=engine, groups=caches)
    return p


def parse_serve_args(argv: list[str]) -> ServeArgs:
    namespace = build_parser().parse_args(argv)
    return ServeArgs(
        model=namespace.model,
        **config_kwargs(namespace, ServeArgs),
        engine=config_kwargs(namespace, EngineConfig),
        worker=config_kwargs(namespace, WorkerConfig),
    )
