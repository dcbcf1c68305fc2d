"""The OpenAI-compatible request bodies (pydantic); the responses are `server.responses`.

Requests ignore fields they do not know (clients send extras); every field they do
know is type-checked, and a bad value becomes a 400 naming that field
(`server.errors`). Known fields Iris does not implement yet are refused unless they are
at their no-op value (`server.unimplemented`): never a silent ignore. Content parts are
checked for shape only: images and videos stay URLs here and are fetched and decoded by
a tokenizer worker, never by the server. The part types are the rows of
`common.content_parts.PART_TYPES`, one model each, built by the row's form; a part of a
type Iris does not take is a 400 naming the part (`messages[0].content[1].type`) and the
types it takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeAlias, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..common.content_parts import PART_TYPES, PartType
from . import unimplemented
from .errors import PATH_PARAM_ERROR, UNSUPPORTED_PART_TAG

_INT64 = 2**63
Seed = Annotated[int, Field(ge=-_INT64, lt=_INT64)]
TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    # Python's JSON reader takes Infinity and NaN: a number field refuses them by name
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# --- chat messages -------------------------------------------------------------------
# One model per row of `common.content_parts.PART_TYPES`, built by its form.

MAX_UUID_CHARS = 256  # tokenizer_worker.chat's bound too
Uuid = Annotated[str, Field(min_length=1, max_length=MAX_UUID_CHARS)]


# What the document shows as media URLs (a fuzzer driven by it starts from these): a
# 16×16 PNG, the same cut short, bytes of another type, and a host no rule allows.
_PNG = "iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAGklEQVR42mM8ISfHQApgYiARjGoY1TB0NAAATx8BJMixHB8AAAAASUVORK5CYII="
IMAGE_URL_EXAMPLES = [
    f"data:image/png;base64,{_PNG}",
    f"data:image/png;base64,{_PNG[:40]}",
    "data:text/plain;base64,aGVsbG8=",
    "https://example.invalid/a.png",
]
VIDEO_URL_EXAMPLES = ["data:video/mp4;base64,AAAAGGZ0eXBtcDQy", "https://example.invalid/v.mp4"]


class ImageURL(_Body):
    url: Annotated[str, Field(min_length=1, examples=IMAGE_URL_EXAMPLES)] | None = None
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(_Body):
    url: Annotated[str, Field(min_length=1, examples=VIDEO_URL_EXAMPLES)] | None = None


class ImageEmbeds(_Body):
    """vLLM's form of an image_embeds part's data: both base64 of `torch.save`."""

    image_embeds: str
    image_grid_thw: str | list[int]


class _Part(_Body):
    """A content part of one row of `PART_TYPES` (`row`); its fields are the row's
    (`_part_model`)."""

    row: ClassVar[PartType]


class _URLPart(_Part):
    """An image or video by URL (a video part is vLLM's: OpenAI's API has none), fetched
    and decoded by a tokenizer worker; `uuid` (vLLM's) names it for later requests, which
    may then send the uuid alone (`"image_url": null`, or no `url`) and are served from
    the caches."""

    if TYPE_CHECKING:  # a field of every url row (`_part_model`)
        uuid: str | None

    @model_validator(mode="after")
    def _url_or_uuid(self) -> _URLPart:
        spec = getattr(self, self.row.field)
        if self.uuid is None and (spec is None or spec.url is None):
            modality = self.row.modality
            noun = f"{'an' if modality == 'image' else 'a'} {modality}"
            raise ValueError(
                f"{noun} part needs {self.row.field}.url, or the uuid of {noun} sent before"
            )
        return self


class _EmbedsPart(_Part):
    """An image given by its vision-tower output (`--enable-mm-embeds`): vLLM's
    `{"image_embeds": {"image_embeds": B64, "image_grid_thw": B64}}`, or `image_embeds`
    B64 with `image_grid_thw` [t, h, w] beside it; the tokenizer worker reads and checks
    the tensors (`tokenizer_worker.image_embeds`), never the server."""

    if TYPE_CHECKING:  # fields of every embeds row (`_part_model`)
        image_grid_thw: list[int] | None
        uuid: str | None

    @model_validator(mode="after")
    def _data_or_uuid(self) -> _EmbedsPart:
        data, name = getattr(self, self.row.field), self.row.name
        if data is None and self.uuid is None:
            raise ValueError(f"an {name} part needs its data, or the uuid of an image sent before")
        if isinstance(data, str) and self.image_grid_thw is None:
            raise ValueError(f"{name} needs image_grid_thw [t, h, w]")
        return self


def _part_model(row: PartType) -> type[_Part]:
    """The model of `row`'s parts, named after its type (`image_url`: `ImageURLPart`): its
    `type`, its content field checked by its form, and a media part's `uuid`."""
    words = ("URL" if word == "url" else word.capitalize() for word in row.name.split("_"))
    fields: dict[str, Any] = {"type": (Literal[row.name], ...)}
    base: type[_Part] = _Part
    if row.form == "text":
        fields[row.field] = (str, ...)
    elif row.form == "url":
        base = _URLPart
        fields[row.field] = ((ImageURL if row.modality == "image" else VideoURL) | None, None)
    else:
        base = _EmbedsPart
        fields[row.field] = (str | ImageEmbeds | None, None)
        fields["image_grid_thw"] = (list[int] | None, None)
    if row.is_media:
        # `Annotated[...] | None` is valid at run time; pyright reads only written annotations
        fields["uuid"] = (Uuid | None, None)  # pyright: ignore[reportOperatorIssue]
    model = create_model("".join(words) + "Part", __base__=base, __module__=__name__, **fields)
    model.row = row
    return model


PART_MODELS: dict[str, type[_Part]] = {row.name: _part_model(row) for row in PART_TYPES}
# Types clients send that Iris does not take, and why, beyond "not supported"
_PARTS_NOT_TAKEN = {
    "video": 'send a video as {"type": "video_url", "video_url": {"url": ...}}',
    "input_audio": "audio input is not supported",
    "audio_url": "audio input is not supported",
    "file": "file inputs are not supported",
    "input_file": "file inputs are not supported",
}


class UnsupportedPart(_Body):
    """Any content part whose type is none of `PART_TYPES`: always refused, with an
    error that names the part (`messages[0].content[1].type`) and lists what Iris takes,
    rather than pydantic's "does not match any of the expected tags"."""

    type: Any = Field(default=None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, part: Any) -> Any:
        if not isinstance(part, dict):
            raise _part_refused("a content part must be an object with a type")
        return part

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: Any) -> Any:
        if kind is None:
            why = "a content part needs a type"
        else:
            reason = _PARTS_NOT_TAKEN.get(kind) if isinstance(kind, str) else None
            why = f"content parts of type {kind!r} are not supported" + (
                f" ({reason})" if reason else ""
            )
        raise _part_refused(why)


def _supported_types() -> str:
    """The part types for an error: "text, image_url, video_url and image_embeds (the last
    with --enable-mm-embeds)"."""
    *first, last = PART_TYPES
    listed = f"{', '.join(row.name for row in first)} and {last.name}"
    notes = [
        f"{'the last' if row is last else row.name} with {row.flag}"
        for row in PART_TYPES
        if row.flag is not None
    ]
    return f"{listed} ({', '.join(notes)})" if notes else listed


_SUPPORTED_TYPES = _supported_types()


def _part_refused(why: str) -> PydanticCustomError:
    return PydanticCustomError(
        PATH_PARAM_ERROR,
        # built once at import from PART_TYPES, never from a request
        "{why}; the supported types are " + _SUPPORTED_TYPES,  # pyright: ignore[reportArgumentType]
        {"why": why},
    )


def _part_type(part: Any) -> str:
    """The union tag of a content part: its type where Iris takes that type (a string:
    any other JSON value, an object or a list, is refused as an unsupported part)."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return kind if isinstance(kind, str) and kind in PART_MODELS else UNSUPPORTED_PART_TAG


_MEMBERS = (
    *(Annotated[model, Tag(name)] for name, model in PART_MODELS.items()),
    Annotated[UnsupportedPart, Tag(UNSUPPORTED_PART_TAG)],
)
if TYPE_CHECKING:  # what static tools see: the union below is built from the table
    ContentPart: TypeAlias = _Part | UnsupportedPart
else:
    # `Union[members]`: a union of a tuple built at run time (`|` cannot unpack one)
    ContentPart = Annotated[Union[_MEMBERS], Discriminator(_part_type)]  # noqa: UP007


class ChatMessage(BaseModel):
    """One message; fields other than role and content (name, ...) pass through."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def wire(self) -> dict[str, Any]:
        """The message as the tokenizer worker takes it (plain dicts, no None content)."""
        message = self.model_dump(exclude_none=True)
        message.setdefault("content", "")
        return message

    @property
    def has_images(self) -> bool:
        """Whether the message has an image or a video part."""
        return isinstance(self.content, list) and any(
            isinstance(part, _Part) and part.row.is_media for part in self.content
        )


# --- tools -------------------------------------------------------------------------


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# --- structured output -------------------------------------------------------------


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema with its schema')
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            name
            for name in ("json_", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


# --- requests ------------------------------------------------------------------------


class StreamOptions(_Body):
    include_usage: bool = False


class MMProcessorKwargs(BaseModel):
    """vLLM's per-request processor settings, those the Qwen processors honour: pixel
    bounds (images; videos where the model's video processor takes them) and video frame
    sampling (`fps` and `num_frames` exclude each other). Any other key is refused by
    name: vLLM passes more to the processor, and a key Iris ignored would change nothing."""

    model_config = ConfigDict(extra="forbid")

    max_pixels: Annotated[int, Field(gt=0)] | None = None
    min_pixels: Annotated[int, Field(gt=0)] | None = None
    fps: Annotated[float, Field(gt=0, le=120)] | None = None
    num_frames: Annotated[int, Field(ge=2)] | None = None
    min_frames: Annotated[int, Field(ge=1)] | None = None
    max_frames: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _one_sampling(self) -> MMProcessorKwargs:
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("fps and num_frames are mutually exclusive: give one of them")
        return self


class _Generate(unimplemented.refusing_base("_GenerateRefusals", unimplemented.GENERATE, _Body)):
    """Fields shared by chat completions and completions (OpenAI, plus vLLM's extras)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Seed | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    # OpenAI's shape: token id (as a string) -> bias in [-100, 100]
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    skip_special_tokens: bool = True
    n: Annotated[int, Field(ge=1, le=128)] = 1  # choices (OpenAI's bounds)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
        return bias

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items() if v))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stop if s)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# apply_chat_template's own arguments and what Iris sets itself: a template variable may
# not override them (vLLM refuses the same).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatCompletionRequest(
    unimplemented.refusing_base("_ChatRefusals", unimplemented.CHAT, _Generate)
):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # extra variables for the model's chat template (`enable_thinking`, `add_vision_id`, ...)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # false: at most one call per answer

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @property
    def requested_logprobs(self) -> int | None:
        """Top tokens per sampled token (0: the sampled one's only); None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)} cannot be set through chat_template_kwargs "
                "(apply_chat_template's own arguments)"
            )
        return kwargs

    @property
    def max_output_tokens(self) -> tuple[int | None, str]:
        """The requested limit and the field it came from (the newer name wins)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(
    unimplemented.refusing_base("_CompletionRefusals", unimplemented.COMPLETION, _Generate)
):
    prompt: str | list[TokenId]  # a batch of one ("prompt": ["text"] or [[ids]]) is unwrapped
    logprobs: Annotated[int, Field(ge=0)] | None = None  # top tokens per sampled token

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"send one prompt per request, got a batch of {len(prompt)}")
            return prompt[0]
        return prompt

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def max_output_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"


class TokenizeBody(_Body):
    """vLLM's /tokenize: a prompt, or text-only messages rendered with the chat template
    (exactly one: the document says so, and the error names `messages`)."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, validate_default=True)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _one_input(cls, messages: list[ChatMessage] | None, info: ValidationInfo) -> Any:
        if (info.data.get("prompt") is None) == (messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return messages


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[TokenId]
