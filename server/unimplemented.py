"""Request fields Iris knows but does not implement yet: never silently ignored.

An agent that sends such a field and gets a 200 without its effect is broken without
knowing it. Each field below changes the answer when set; a request may carry it only at
the value that changes nothing (what clients send by default: `null`, `false`, `0`, `[]`,
...). Any other value is a 400 naming the field (`error.param`). Unknown vendor fields
stay ignored, as vLLM does, and so do known fields that change nothing in the answer
(`user`, `safety_identifier`, `metadata`, `store`, `service_tier`, `prompt_cache_key`,
`prompt_cache_retention`, `prompt_cache_options`: Iris's prefix cache needs no hint).

The bodies inherit these as declared fields (`refusing_base`), so they appear in the
OpenAPI schema and in one table here, not as checks spread over the handlers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationInfo, create_model, field_validator

NoOp = Callable[[Any], bool]


def _absent(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {}


def _one(value: Any) -> bool:
    return value is None or value == 1


def _no_tool(value: Any) -> bool:
    return value in (None, "none", "auto")  # no tools: "auto" and "none" mean the same


def _text_only(value: Any) -> bool:
    return value is None or value == ["text"]


def _true(value: Any) -> bool:
    return value is None or value is True


# field -> (the values that change nothing, what to say about it)
GENERATE: dict[str, tuple[NoOp, str]] = {
    "prompt_logprobs": (_absent, "prompt logprobs are not implemented yet"),
    "best_of": (_one, "only best_of=1 is supported"),
    "use_beam_search": (_absent, "beam search is not supported"),
    "length_penalty": (_one, "beam search is not supported"),
    "include_stop_str_in_output": (_absent, "stop strings are always cut from the output"),
    "bad_words": (_absent, "bad_words is not implemented"),
    "allowed_token_ids": (_absent, "allowed_token_ids is not implemented"),
    "truncate_prompt_tokens": (_absent, "prompts are never truncated; shorten it"),
    "logits_processors": (_absent, "custom logits processors are not supported"),
    "prediction": (_absent, "predicted outputs are not supported"),
}
CHAT: dict[str, tuple[NoOp, str]] = {
    "functions": (_absent, "the deprecated functions field is not supported; use tools"),
    "function_call": (_no_tool, "the deprecated function_call field is not supported; "
                      "use tool_choice"),
    "audio": (_absent, "audio output is not supported"),
    "moderation": (_absent, "moderation is not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported; ask in the prompt"),
    "modalities": (_text_only, "only text output is supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),  # {}: on
    "reasoning_effort": (_absent, "reasoning_effort is not supported; for Qwen3 thinking "
                         "models use chat_template_kwargs.enable_thinking"),
    "add_generation_prompt": (_true, "the generation prompt is always added"),
    "continue_final_message": (_absent, "continuing the final message is not implemented"),
    "echo": (_absent, "echo is not implemented"),
    "chat_template": (_absent, "per-request chat templates are not supported"),
    "documents": (_absent, "documents are not supported"),
    "media_io_kwargs": (_absent, "media_io_kwargs is not supported; sample a video's frames "
                        "with mm_processor_kwargs (fps or num_frames)"),
}  # fmt: skip
COMPLETION: dict[str, tuple[NoOp, str]] = {
    "echo": (_absent, "echo is not implemented"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
}


def refusing_base(name: str, table: dict[str, tuple[NoOp, str]], base: type[BaseModel]) -> Any:
    """A subclass of `base` declaring each field of `table` (any type, default None) and
    refusing any value but its no-op ones (its validator is named after `name`, so that a
    subclass refusing more fields keeps its base's refusals)."""

    def refuse(cls: type, value: Any, info: ValidationInfo) -> Any:
        is_noop, why = table[info.field_name or ""]
        if not is_noop(value):
            raise ValueError(f"{why} (Iris refuses it rather than ignore it)")
        return value

    validator: Any = field_validator(*table)(classmethod(refuse))  # type: ignore[arg-type]
    fields: dict[str, Any] = {field: (Any, None) for field in table}
    return create_model(
        name, __base__=base, __validators__={f"_refuse_{name}": validator}, **fields
    )
