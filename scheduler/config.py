"""The engine's settings: one frozen dataclass; `iris serve` derives its flags from it.

A field's `metadata` declares its command-line flag (vLLM's name where one exists) and
its help, as `launch.config_flags` describes, so the default and the help live here,
once. Fields without `flag` have no flag.

torch is imported where a device or dtype is resolved, not at import: `iris serve`
parses its flags (and `--help` answers) without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

    from .kv.event_publisher import KvEventsConfig

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
_CACHES = "caches"  # the help section of the cache flags (`launch.args`)
# `--max-itl-stretch` on a CPU: the inter-token tail of served images stays flat from 2
# to 4, text loses throughput below 2.5 and grows its tail above (the measurements are in
# bench/results/itl_stretch_small*.md).
CPU_ITL_STRETCH = 2.5
CpuLinear = Literal["auto", "pairs", "onednn", "aten"]  # `--cpu-linear` (`select_linear_method`)
CPU_LINEARS: tuple[str, ...] = get_args(CpuLinear)


def _flag(flag: str, help: str, **more: object) -> dict[str, object]:
    """A field's command-line flag, for its `metadata` (keys: see the module docstring)."""
    return {"flag": flag, "help": help, **more}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = field(
        default="auto",
        metadata=_flag("--device", "auto (cuda when available, else cpu), cpu, cuda, cuda:N"),
    )
    dtype: str = field(
        default="auto",
        metadata=_flag(
            "--dtype",
            "auto (bf16 on CUDA; on a CPU a bf16/fp16 checkpoint runs in bf16 where the CPU "
            "computes bf16 natively, AVX512-BF16 or AMX, else fp32), float32, bfloat16, float16",
        ),
    )
    page_size: int = field(default=16, metadata=_flag("--block-size", "tokens per KV page"))
    attention_backend: Literal["auto", "sdpa", "triton"] = field(
        default="auto",
        metadata=_flag(
            "--attention-backend",
            "auto (triton on CUDA when the triton package is installed, else sdpa), sdpa "
            "(torch SDPA over the paged cache in place; the CPU path and the reference), "
            "triton (our Triton paged-attention kernels; CUDA, or the CPU under "
            "TRITON_INTERPRET=1)",
        ),
    )
    cpu_linear: CpuLinear = field(
        default="auto",
        metadata=_flag(
            "--cpu-linear",
            "how a CPU model's linear layers compute: auto (pairs in bfloat16 on a CPU with "
            "AVX512-BF16 and no AMX, else onednn), pairs (bfloat16 weights packed at load "
            "for our kernel, which reads a decode step's weights at the machine's bandwidth), "
            "onednn (weights prepacked at load for oneDNN's matmul) or aten (PyTorch's "
            "default, MKL's sgemm); the packed kinds hold only the packed copy",
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_flag(
            "--enforce-eager",
            "launch every kernel of every step from Python. Default on CUDA: decode-only "
            "steps replay CUDA graphs captured at start-up for batch sizes up to "
            "--max-num-seqs (triton backend)",
        ),
    )
    kv_cache_memory: int = field(
        default=1 << 30,
        metadata=_flag(
            "--kv-cache-memory",
            "bytes of KV cache on CPU (e.g. 4GiB, 512MB)",
            parse="size",
            metavar="SIZE",
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_flag(
            "--gpu-memory-utilization",
            "this server's fraction of the GPU on CUDA: weights, embedding cache, "
            "activations and the KV cache in the rest (other processes' memory is not "
            "counted against it: two servers at 0.45 share a GPU)",
        ),
    )
    num_kv_pages: int | None = None  # overrides both budgets (tests force preemption with it)
    seed: int | None = field(
        default=None,
        metadata=_flag(
            "--seed",
            "seed of the scheduler's random generator: unseeded sampling repeats across "
            "restarts for the same requests in the same order",
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_flag(
            "--tensor-parallel-size",
            "ranks the language model is split over, one process each (GPUs 0..N-1 on CUDA; "
            "gloo processes on the CPU); rank 0 schedules, the others follow",
            min=1,
        ),
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=_flag(
            "--max-num-batched-tokens", "token budget of one step: the chunked-prefill size"
        ),
    )
    max_itl_stretch: float | None = field(
        default=None,
        metadata=_flag(
            "--max-itl-stretch",
            "a step that carries decodes takes at most about this many decode steps' time: "
            "the prefill it carries is sized from measured step times (0: off, prefills take "
            "the whole --max-num-batched-tokens). Default: 2.5 on a CPU, off on CUDA",
        ),
    )
    max_num_seqs: int = field(
        default=64, metadata=_flag("--max-num-seqs", "requests running at once")
    )
    max_model_len: int | None = field(
        default=None, metadata=_flag("--max-model-len", "context length (default: the model's)")
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=_flag(
            "--disable-prefix-caching",
            "do not reuse full KV pages (keyed by their tokens and image keys)",
            group=_CACHES,
        ),
    )
    # Per-image vision-tower outputs shared by all requests, LRU-bounded in bytes; pinned
    # entries (images of running requests) are never evicted, so it may exceed the bound.
    enable_mm_embedding_cache: bool = field(
        default=True,
        metadata=_flag(
            "--disable-mm-embedding-cache",
            "an image's embedding lives only for its request",
            group=_CACHES,
        ),
    )
    mm_embedding_cache_bytes: int = field(
        default=1 << 30,
        metadata=_flag(
            "--mm-embedding-cache-gb",
            "the scheduler's per-image embedding cache, LRU-bounded on the device (images "
            "of running requests stay, so it may briefly exceed the bound)",
            parse="gib",
            metavar="GIB",
            group=_CACHES,
        ),
    )
    kv_offload_bytes: int = field(
        default=0,
        metadata=_flag(
            "--kv-offload-gib",
            "host memory (pinned on CUDA) under the prefix and embedding caches: the KV pages, "
            "image embeddings and (Qwen3.5) state snapshots they evict go there, and a "
            "request whose prefix is there reloads it instead of computing it again; one "
            "LRU, per tensor-parallel rank for its shard (0: off)",
            parse="gib",
            metavar="GIB",
            group=_CACHES,
        ),
    )
    kv_events_config: str | None = field(
        default=None,
        metadata=_flag(
            "--kv-events-config",
            "publish the prefix cache's KV events for a cluster router, as vLLM does: its "
            'JSON fields (e.g. \'{"endpoint": "tcp://*:5557", "replay_endpoint": '
            '"tcp://*:5558"}\'; each data-parallel replica on the next port); image '
            "blocks carry each image's routing id in extra_keys",
            metavar="JSON",
            group=_CACHES,
        ),
    )
    # "request": one key over all of a request's images (a new image invalidates them all).
    mm_cache_granularity: Literal["image", "request"] = field(
        default="image",
        metadata=_flag(
            "--mm-cache-granularity",
            "cache keys per image, or one over all of a request's images (a new image then "
            "invalidates them all; for comparison)",
            group=_CACHES,
        ),
    )
    linear_state_snapshots: int | None = field(
        default=None,
        metadata=_flag(
            "--linear-state-snapshots",
            "hybrid models (Qwen3.5): snapshots of the linear-attention state the prefix cache "
            "keeps, each the size of one request's state, taken at page boundaries (around "
            "images, prompt ends, where a request stopped); a prefix hit resumes only where "
            "one was taken. Default: 64, or as many as fit beside the working slots in half "
            "of the KV cache's memory",
            min=0,
            group=_CACHES,
        ),
    )
    chunked_mm_encoding: bool = field(
        default=True,
        metadata=_flag(
            "--disable-chunked-mm-encoding",
            "encode every image of a request in its first prefill chunk",
            group=_CACHES,
        ),
    )
    max_num_encoder_tokens: int = field(
        default=4096,
        metadata=_flag(
            "--max-num-encoder-tokens",
            "image tokens (after merging) per vision-encoder call, and how many the encoder "
            "may hold or be encoding ahead of the prefills",
            min=1,
            group=_CACHES,
        ),
    )
    # Where the vision tower runs (encoder_executor.py); auto: `resolved_mm_encoder_placement`.
    mm_encoder_placement: Literal["auto", "inline", "thread"] = field(
        default="auto",
        metadata=_flag(
            "--mm-encoder-placement",
            "where the vision encoder runs: inline (inside the steps, for the images their "
            "chunks overlap; every stream waits for it) or thread (in a thread of its own, "
            "with --encoder-threads of the cores on a CPU, on a CUDA stream of its own on a "
            "GPU, so decodes go on while images encode); auto: thread on a CPU, inline on "
            "CUDA. Without chunked encoding, always inline",
            group=_CACHES,
            aliases=(
                {
                    "flag": "--mm-encoder-inline",
                    "help": "deprecated, to be removed in the next release: use "
                    "--mm-encoder-placement inline",
                    "const": "inline",
                },
                {
                    "flag": "--mm-encoder-beside",
                    "help": "deprecated, to be removed in the next release: use "
                    "--mm-encoder-placement thread",
                    "const": "thread",
                },
            ),
        ),
    )
    encoder_threads: int | None = field(
        default=None,
        metadata=_flag(
            "--encoder-threads",
            "torch threads of the vision encoder's thread on a CPU (default: half the "
            "scheduler's, at least one)",
            min=1,
            group=_CACHES,
        ),
    )

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be positive")
        if self.mm_embedding_cache_bytes < 0:
            raise ValueError("mm_embedding_cache_bytes must not be negative")
        if self.cpu_linear not in CPU_LINEARS:
            raise ValueError(f"cpu_linear must be one of {', '.join(CPU_LINEARS)}")
        if self.kv_offload_bytes < 0:
            raise ValueError("kv_offload_bytes must not be negative")
        if self.mm_cache_granularity not in ("image", "request"):
            raise ValueError("mm_cache_granularity must be 'image' or 'request'")
        if self.linear_state_snapshots is not None and self.linear_state_snapshots < 0:
            raise ValueError("linear_state_snapshots must not be negative")
        if self.max_num_encoder_tokens < 1:
            raise ValueError("max_num_encoder_tokens must be positive")
        if self.mm_encoder_placement not in ("auto", "inline", "thread"):
            raise ValueError("mm_encoder_placement must be 'auto', 'inline' or 'thread'")
        if self.encoder_threads is not None and self.encoder_threads < 1:
            raise ValueError("encoder_threads must be positive")
        stretch = self.max_itl_stretch
        if stretch is not None and stretch != 0 and not stretch > 1:
            raise ValueError(f"max_itl_stretch must be above 1, or 0 (off); got {stretch}")
        self.kv_events  # noqa: B018  (parsed now: a bad value refuses to start)

    @property
    def kv_events(self) -> KvEventsConfig | None:
        """`--kv-events-config` parsed; None when events are off."""
        from .kv.event_publisher import KvEventsConfig

        if self.kv_events_config is None:
            return None
        config = KvEventsConfig.parse(self.kv_events_config)
        return config if config.enabled else None

    def resolved_itl_stretch(self, device: torch.device) -> float:
        """`max_itl_stretch`, by default 2.5 on a CPU (where prefill is compute-bound, see
        step/latency_budget.py) and 0 (off) on CUDA, where it has not been measured."""
        if self.max_itl_stretch is not None:
            return self.max_itl_stretch
        return CPU_ITL_STRETCH if device.type == "cpu" else 0.0

    def resolved_mm_encoder_placement(self, device: torch.device) -> Literal["inline", "thread"]:
        """`mm_encoder_placement`; `auto`: a thread on a CPU, where inline a large image stalls
        every stream for seconds, and inline on CUDA (bench/results/encoder_thread_h100.md).
        Without chunked encoding every image is encoded in its request's first chunk: inline."""
        if not self.chunked_mm_encoding:
            return "inline"
        if self.mm_encoder_placement != "auto":
            return self.mm_encoder_placement
        return "thread" if device.type == "cpu" else "inline"

    def resolved_encoder_threads(self) -> int:
        """The encoder thread's torch threads on a CPU: `encoder_threads`, by default half
        of the calling (scheduler) thread's, at least one."""
        import torch

        return self.encoder_threads or max(1, torch.get_num_threads() // 2)

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(
        self, device: torch.device, checkpoint_dtype: str | None = None
    ) -> torch.dtype:
        """`dtype`; "auto" by the device and the checkpoint's dtype (`auto_dtype`)."""
        import torch

        if self.dtype == "auto":
            from .auto_dtype import auto_dtype

            return auto_dtype(device, checkpoint_dtype)[0]
        try:
            return getattr(torch, _DTYPES[self.dtype])
        except KeyError:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; use one of {sorted(_DTYPES)}"
            ) from None
