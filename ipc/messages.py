"""Every message that crosses a process boundary, and the codec of each union (`ipc.codec`).

One tagged union per socket direction (tags are ints, unique across all unions):

    union                 from → to                      messages (tags)
    ServerToTokenizer     server → tokenizer worker      TokenizeRequest 10, AbortRequest 11
    TokenizerToScheduler  tokenizer worker → scheduler   EngineRequest 20, AbortEngineRequest 21
    SchedulerToTokenizer  scheduler → tokenizer worker   ReleaseImages 30
    ToServer              scheduler, workers → server    TokenBatch 40, RequestError 41,
                                                         EngineStats 42, WorkerStats 43
    ToFollower            scheduler rank 0 → rank N      RankStep 50, StopRanks 51
    ReadyReport           every child → launcher         SchedulerReady 60, ProcessReady 61,
                                                         ProcessFailed 62

`ToServer` has two senders: the scheduler, and a tokenizer worker for the errors of
requests that never reached the scheduler (an unreadable image, a prompt over the limit).

Structs are `array_like`: fields go by position, so only ever *append* fields, with
defaults. msgspec writes the defaults of an `array_like` struct anyway
(jcrist/msgspec#720); `omit_defaults=True` is the project convention. No pixel travels
here (`docs/design.md`, "Pixels never cross ZMQ").

Token ids are `bytes` of little-endian int32, not `list[int]`: msgpack spends 5 bytes on
an id above 65,535 (a Qwen image pad id, repeated for every image token), and the
scheduler reads bytes without a per-id loop (`codec.pack_token_ids`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol, TypeAlias

import msgspec

from .codec import Codec, unpack_token_ids

_TOKENIZE, _ABORT = 10, 11
_ENGINE_REQUEST, _ABORT_ENGINE, _MEDIA_WORK = 20, 21, 22
_RELEASE_IMAGES, _CORE_READY = 30, 31
_TOKEN_BATCH, _REQUEST_ERROR, _ENGINE_STATS, _WORKER_STATS = 40, 41, 42, 43
_RANK_STEP, _STOP_RANKS = 50, 51
_SCHEDULER_READY, _PROCESS_READY, _PROCESS_FAILED = 60, 61, 62

Key128 = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
FinishReason = Literal["stop", "length", "abort"]


class _Struct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire struct (`gc=False`: they never hold reference cycles)."""


class _Frozen(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Base of value types (hashable, so usable as dict keys): `_Struct`'s options, frozen.

    Not a `_Struct` subclass, and every subclass repeats `frozen=True`, because type
    checkers treat structs as dataclasses, where frozen and non-frozen may not mix."""


class _Message(_Struct, tag_field="kind"):
    """Base of the top-level messages; each subclass sets a unique int `tag`."""


# --- shared pieces ---------------------------------------------------------------


class StructuredOutput(_Frozen, frozen=True):
    """A constraint on a request's output, enforced token by token by the scheduler
    (`scheduler.structured_output`). `spec`: the JSON schema as JSON text (json_schema),
    a regular expression (regex), a JSON list of the allowed strings (choice), a Lark
    grammar (grammar); json_object needs none."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: str = ""


class Sampling(_Frozen, frozen=True):
    """One request's sampling parameters; the scheduler samples with this very type
    (`scheduler.sampling.check_sampling` validates it on admission)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's: subtracted per occurrence / once, for tokens in the output so far
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # transformers' and vLLM's: logits of tokens in the prompt or output divided by it
    # (multiplied where negative)
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # None: no logprobs; N >= 0: each sampled token's logprob and the N most likely tokens'
    logprobs: int | None = None
    structured: StructuredOutput | None = None


class ShmHandle(_Frozen, frozen=True):
    """Names one allocation in a worker's arena; enough to pin or release it."""

    segment: str
    offset: NonNegative
    generation: int


class ShmPointer(_Frozen, frozen=True):
    """Where a tensor lies in a tokenizer worker's shared-memory arena: `offset` is the first
    data byte inside `segment`, `dtype` a torch dtype name. `generation` is unique per
    allocation: the owner refuses a release whose generation is not the live one, and a
    reader refuses to view an entry that was freed or reused since (use-after-free)."""

    worker_id: NonNegative
    segment: str
    offset: NonNegative
    nbytes: NonNegative
    dtype: str
    shape: tuple[int, ...]
    generation: int

    @property
    def handle(self) -> ShmHandle:
        return ShmHandle(self.segment, self.offset, self.generation)


class ImageRef(_Frozen, frozen=True):
    """One image of a prompt, or one temporal patch of a video's frames: its key, its token
    span `token_ids[offset:offset + length]` and where its pixels are. `pixels` is None
    when the worker has none for it (named by its uuid alone, evicted): the scheduler must
    hold its embedding, or refuse it. `embeds`: `pixels` points at the client's embeddings
    `[length, width]` instead (`image_embeds`).

    A video is a run of these, one per temporal patch (`frames` consecutive sampled frames,
    uint8 `[frames, H, W, 3]`; an image is one frame, `[H, W, 3]`, which the processor
    repeats), each with grid `(1, h, w)` and a key of its own, so every cache reuses a
    patch that another request or clip shares. Qwen2-VL and Qwen2.5-VL give a whole video
    one M-RoPE block: its patches after the first `continue_block` (they start where the
    one before them started) at temporal position `rope_time`; Qwen3-VL's and Qwen3.5's
    patches are blocks of their own, like images.

    `kept`: a pruned patch's (`--video-pruning-rate`) token indices into its grid's merged
    tokens, increasing, `length` of them; each keeps its unpruned position, and the patch
    is still encoded whole (None: every token, `length` is the grid's).

    `routing_hash`: the 64-bit id a cluster router knows this image by, which the KV
    events name it by (Dynamo's frontend: xxh3_64 of its URL string); None: the first 8
    bytes of `key` (`scheduler/kv/kv_events.py`)."""

    key: Key128
    offset: NonNegative
    length: NonNegative
    grid_thw: tuple[int, int, int]
    pixels: ShmPointer | None = None
    embeds: bool = False
    frames: Annotated[int, msgspec.Meta(ge=1)] = 1
    rope_time: NonNegative = 0
    continue_block: bool = False
    kept: tuple[NonNegative, ...] | None = None
    routing_hash: Annotated[int, msgspec.Meta(ge=0)] | None = None  # below 2**64

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether tokens `start..end` hold some of this image's tokens."""
        return self.offset < end and start < self.end


ImageCache = Literal["none", "processor", "embedding", "prefix"]


class ImageReport(_Frozen, frozen=True):
    """What the client is told about one image of its prompt (`usage.image_cache`): the
    deepest cache that served it, "prefix" (its KV pages), "embedding" (the vision tower's
    output), "processor" (its pixels: no decode or resize) or "none". The worker fills in
    `part` (where in the messages), `uuid` and "processor"; the scheduler the deeper levels."""

    part: str
    uuid: str | None = None
    cache: ImageCache = "none"


class Prompt(_Struct):
    """Expanded token ids and their images, in order, as the scheduler's `Request` is
    built from. `EngineRequest` carries the same fields on the wire; in one process
    (`ipc.local.PromptInput`) the pointers are None and the pixels travel beside it."""

    token_ids: list[int]
    images: list[ImageRef] = []


# --- server → tokenizer worker ----------------------------------------------------


class TokenizeRequest(_Message, tag=_TOKENIZE):
    """A validated API request, before the chat template and image processing: exactly one of
    `messages` (chat completions, as received) and `prompt` (completions: text or token ids).
    `max_pixels`/`min_pixels` override the processor's defaults for this request's images
    (and, where the model's video processor takes them, videos); `fps`, `num_frames`,
    `min_frames` and `max_frames` its video processor's frame sampling;
    `chat_template_kwargs` (checked by the server) and `tools` go to the chat template.

    A token-id `prompt` may come with media (a cluster frontend that templated and
    tokenized the chat itself, `server/dynamo/`): `image_urls` and `video_urls` in prompt
    order, one image or video placeholder in the prompt each, with the id the frontend's
    router knows each image by (`image_routing_hashes`, see `ImageRef.routing_hash`);
    `expected_prompt_len` is the prompt's length once expanded as the frontend counted it,
    and a worker whose expansion differs refuses the request rather than serve other
    positions."""

    request_id: str
    sampling: Sampling
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    max_pixels: int | None = None
    min_pixels: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    image_urls: list[str] | None = None
    image_routing_hashes: list[int] | None = None
    expected_prompt_len: int | None = None
    video_urls: list[str] | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("exactly one of `messages` and `prompt` must be set")
        media = self.image_urls is not None or self.video_urls is not None
        if media and not isinstance(self.prompt, list):
            raise ValueError("`image_urls` and `video_urls` come with a token-id `prompt` only")
        hashes = self.image_routing_hashes
        if hashes is not None and len(hashes) != len(self.image_urls or ()):
            raise ValueError("one `image_routing_hashes` entry per image URL")


class AbortRequest(_Message, tag=_ABORT):
    """The client went away. Sent to the worker that got the request (messages on one
    socket stay in order), which forwards an `AbortEngineRequest` to the scheduler."""

    request_id: str


ServerToTokenizer: TypeAlias = TokenizeRequest | AbortRequest


# --- tokenizer worker → scheduler -------------------------------------------------


class EngineRequest(_Message, tag=_ENGINE_REQUEST):
    """A prompt ready for the engine. Every `ImageRef.pixels` pointer is pinned once for
    this request, until the scheduler's `ReleaseImages` (`docs/design.md`, "Shared
    memory has an owner and a lifetime")."""

    request_id: str
    token_ids: bytes  # little-endian int32, see `pack_token_ids`
    sampling: Sampling
    images: list[ImageRef] = []
    reports: list[ImageReport] = []  # one per image of a chat prompt, else none

    def __post_init__(self) -> None:
        if len(self.token_ids) % 4:
            raise ValueError(f"token_ids holds {len(self.token_ids)} bytes, not int32s")
        num_tokens = len(self.token_ids) // 4
        for image in self.images:
            if image.end > num_tokens:
                raise ValueError(
                    f"image span [{image.offset}, {image.end}) exceeds {num_tokens} tokens"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    def prompt(self) -> Prompt:
        return Prompt(unpack_token_ids(self.token_ids), list(self.images))


class AbortEngineRequest(_Message, tag=_ABORT_ENGINE):
    request_id: str


class MediaWork(_Message, tag=_MEDIA_WORK):
    """A worker starts (`busy`) or ends turning a request's media into pixels. Meanwhile it
    takes a core, so on a CPU the scheduler's steps leave it one (`CoreSharing`): more
    OpenMP threads than free cores stall every parallel region of a step. The scheduler
    answers a start with `CoreReady` once no step that counted on that core still runs."""

    worker_id: int
    busy: bool
    seq: int = 0  # of the worker's starts: the `CoreReady` that answers this one echoes it


TokenizerToScheduler: TypeAlias = EngineRequest | AbortEngineRequest | MediaWork


# --- scheduler → tokenizer worker -------------------------------------------------


class ReleaseImages(_Message, tag=_RELEASE_IMAGES):
    """Unpin arena entries; sent to the worker that owns their segment."""

    handles: list[ShmHandle]


class CoreReady(_Message, tag=_CORE_READY):
    """The answer to `MediaWork(busy=True)`: the steps from now on leave the worker its core."""

    seq: int = 0  # the `MediaWork` answered


SchedulerToTokenizer: TypeAlias = ReleaseImages | CoreReady


# --- scheduler / tokenizer worker → server ----------------------------------------


class TokenLogprob(_Frozen, frozen=True):
    """A sampled token's log-probability under the model (log-softmax of its logits, before
    any sampling parameter) and the `Sampling.logprobs` most likely tokens', best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestOutput(_Struct):
    """What one request produced in one engine step (token counts are totals so far)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    images: list[ImageReport] | None = None  # on a chat request's first token only
    # on the first token: seconds from the scheduler's admission of the request to its
    # first step (waiting for a batch slot and KV pages: vLLM's queue time)
    queue_seconds: float | None = None
    # on the first token: seconds from its first step to it (vLLM's prefill time: its
    # images' encoding and its prompt's chunks), and of those the wall time of the steps
    # that computed its prompt (shared with whatever else those steps ran)
    prefill_seconds: float | None = None
    prefill_step_seconds: float | None = None
    # of `cached_tokens`, those reloaded from the host tier (None: the server has none)
    host_cached_tokens: int | None = None


class TokenBatch(_Message, tag=_TOKEN_BATCH):
    outputs: list[RequestOutput]


class RequestError(_Message, tag=_REQUEST_ERROR):
    """A request ends with an OpenAI-style error; it produces nothing more."""

    request_id: str
    status: int  # HTTP status
    message: str
    type: str = "invalid_request_error"
    param: str | None = None


def context_length_error(
    max_model_len: int, prompt_tokens: int | None, completion_tokens: int
) -> str | None:
    """The context-length rule and its message, for every side that checks it.

    A prompt plus `completion_tokens` (at least one: something must be generated) must fit
    in `max_model_len`. The server checks before tokenizing (`prompt_tokens=None`: at
    least one), the scheduler once the prompt is known. Returns None when it fits."""
    prompt = 1 if prompt_tokens is None else prompt_tokens
    if prompt + max(completion_tokens, 1) <= max_model_len:
        return None
    at_least = "at least " if prompt_tokens is None else ""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {at_least}{prompt + completion_tokens} tokens ({at_least}{prompt} in the "
        f"messages, {completion_tokens} in the completion). Please reduce the length of the "
        "messages or completion."
    )


class EngineStats(_Message, tag=_ENGINE_STATS):
    """The scheduler's gauges and totals, sent when they change (at most a few times a
    second). What each figure is on /metrics and in the throughput line is its row in
    `ipc.stats.ENGINE_SERIES`, the one place a metric is named."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    pinned_images: int  # arena entries the scheduler holds pins on
    num_preemptions: int = 0
    images_encoded: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    mm_embedding_cache_hits: int = 0
    mm_embedding_cache_misses: int = 0
    mm_embedding_cache_usage_bytes: int = 0
    # torch's allocator on a CUDA device (0 on CPU): bytes allocated now, and the most
    # ever allocated since the scheduler started (`torch.cuda.max_memory_allocated`)
    device_memory_allocated_bytes: int = 0
    device_memory_peak_bytes: int = 0
    # vision-tower call durations observed since the previous EngineStats (a histogram feed)
    encoder_seconds: list[float] = []
    replica: NonNegative = 0  # the data-parallel replica whose scheduler sent it
    # prompt tokens looked up in the prefix cache at requests' first admission (the
    # denominator of `prefix_cache_hit_tokens`; 0 with the prefix cache off)
    prefix_cache_query_tokens: int = 0
    # hybrid models (Qwen3.5): requests' first admissions, those whose prefix hit restored
    # a snapshot of the linear-attention state, the snapshots kept now, and the working
    # slots requests hold
    linear_state_snapshot_queries: int = 0
    linear_state_snapshot_hits: int = 0
    linear_state_snapshots: int = 0
    linear_state_slots_held: int = 0
    # the host tier (`--kv-offload-gib`; zeros without it): prompt tokens and images its
    # reloads served, its capacity and use, entries, bytes each way and copy time
    prefix_cache_host_hit_tokens: int = 0
    mm_embedding_cache_host_hits: int = 0
    host_tier_capacity_bytes: int = 0
    host_tier_usage_bytes: int = 0
    host_tier_pages: int = 0
    host_tier_embeddings: int = 0
    host_tier_bytes_to_host: int = 0
    host_tier_bytes_to_device: int = 0
    host_tier_copy_seconds: float = 0.0
    host_tier_page_copies: int = 0  # KV pages copied either way
    host_tier_failed_reloads: int = 0


class WorkerStats(_Message, tag=_WORKER_STATS):
    """A tokenizer worker's gauges and totals, sent when they change; each figure's
    metric is its row in `ipc.stats.WORKER_SERIES`."""

    worker_id: int
    arena_used_bytes: int
    arena_capacity_bytes: int
    arena_pinned_entries: int
    requests_processed: int = 0
    images_processed: int = 0
    processor_cache_hits: int = 0
    processor_cache_misses: int = 0
    # image parts sent with a uuid and no data: the worker knew the uuid, or not (a 400)
    image_uuid_hits: int = 0
    image_uuid_misses: int = 0
    image_uuids: int = 0  # uuids the worker remembers now
    arena_waiting_requests: int = 0  # requests waiting for pins to free arena room


ToServer: TypeAlias = TokenBatch | RequestError | EngineStats | WorkerStats


# --- scheduler rank 0 → the other tensor-parallel ranks ----------------------------


class RankChunk(_Struct):
    """One sequence's share of a step, as a follower rank needs it for attention: the
    pages it gained since the last step that named it (all of them when `reset`: it was
    preempted, or is new), then `num_new` tokens after `num_cached` cached ones."""

    request_id: str
    new_pages: bytes  # little-endian int32
    num_cached: NonNegative
    num_new: NonNegative
    reset: bool = False
    # a hybrid model's: the sequence's linear-attention state slot (-1: none), and the
    # (tokens into the chunk, snapshot slot) its state is also written to
    state_slot: int = -1
    state_captures: list[tuple[int, int]] = []


class RankStep(_Message, tag=_RANK_STEP):
    """What every rank's forward pass reads, decided by rank 0 (tensor parallelism).

    `image_rows` are the `[start, end)` rows that take image embeddings, whose values
    follow as one `torch.distributed` broadcast of `[sum of rows, hidden * (1 + DeepStack
    levels)]`. `logit_rows` are the rows whose logits are computed; `dropped` are
    requests whose pages the followers forget."""

    step: NonNegative
    input_ids: bytes  # little-endian int32, [N]
    positions: bytes  # little-endian int32, [3, N]
    chunks: list[RankChunk]
    image_rows: list[tuple[int, int]] = []
    logit_rows: bytes = b""  # little-endian int32
    dropped: list[str] = []
    # a hybrid model's slot clears (source -1) and copies, (target, source), in order
    slot_ops: list[tuple[int, int]] = []
    # the host tier's copies rank 0 made since the last step, (kind, device page or slot,
    # host block or snapshot id), in order: each rank makes them on its shard before its
    # forward and its slot ops (`scheduler/kv/host_tier.py`, `HostCopy`)
    host_copies: list[tuple[str, int, int]] = []


class StopRanks(_Message, tag=_STOP_RANKS):
    """Rank 0 is shutting down: the followers leave their loop."""


ToFollower: TypeAlias = RankStep | StopRanks


# --- every child → the launcher, once started -------------------------------------


class SchedulerReady(_Message, tag=_SCHEDULER_READY):
    """A scheduler (rank 0 of its replica) is ready: its limits, which the server applies
    (`max_model_len`) and its start-up banner states."""

    name: str  # the process name
    max_model_len: int
    architecture: str  # the checkpoint's, as transformers names it
    device: str
    dtype: str  # without torch's "torch." prefix
    kv_pages: int  # per tensor-parallel rank
    page_size: int  # tokens per KV page
    max_num_seqs: int
    max_num_batched_tokens: int
    quantization: str | None = None  # the checkpoint's quantized format ("block-fp8")


class ProcessReady(_Message, tag=_PROCESS_READY):
    """A tokenizer worker or a follower tensor-parallel rank is ready."""

    name: str


class ProcessFailed(_Message, tag=_PROCESS_FAILED):
    """A child could not start: `error` is the exception's type and message."""

    name: str
    error: str

    @classmethod
    def of(cls, name: str, error: BaseException) -> ProcessFailed:
        return cls(name, f"{type(error).__name__}: {error}")


ReadyReport: TypeAlias = SchedulerReady | ProcessReady | ProcessFailed


class ReadySink(Protocol):
    """Where a child puts its one `ReadyReport` (the launcher's `ReadyChannel`)."""

    def put(self, report: ReadyReport) -> None: ...


# --- codecs, one per union ---------------------------------------------------

SERVER_TO_TOKENIZER: Codec[ServerToTokenizer] = Codec(ServerToTokenizer, "server→tokenizer")
TOKENIZER_TO_SCHEDULER: Codec[TokenizerToScheduler] = Codec(
    TokenizerToScheduler, "tokenizer→scheduler"
)
SCHEDULER_TO_TOKENIZER: Codec[SchedulerToTokenizer] = Codec(
    SchedulerToTokenizer, "scheduler→tokenizer"
)
TO_SERVER: Codec[ToServer] = Codec(ToServer, "→server")
TO_FOLLOWER: Codec[ToFollower] = Codec(ToFollower, "rank 0→follower")
READY: Codec[ReadyReport] = Codec(ReadyReport, "child→launcher")
