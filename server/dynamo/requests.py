"""A Dynamo frontend's preprocessed request → an Iris `TokenizeRequest`, and Iris's
outputs → the chunks the frontend reads (`docs/scale-out.md`, "A fleet").

Dynamo's frontend templates and tokenizes the chat itself: a request carries `token_ids`
(one placeholder per image and per video), the media's URLs (`multi_modal_data.image_url`,
`.video_url`), the id its router keyed each image by (`extra_args.mm_hashes`: xxh3_64 of
the URL string), the prompt's length once its images are expanded as the frontend counted
them (`mm_routing_info.expanded_prompt_len`), and the sampling and stop options, null
where the client left them out. A video comes with neither a routing id nor a count (the
frontend cannot count its frames unseen), so the router routes a video request on its
text before the video. The tokenizer worker takes it from there, as for a chat
request of `iris serve` (media rules, keys, processor cache, arena), and refuses a prompt
whose expansion differs from the frontend's count.

Every option is either served or refused by name (`RefusedField`): a silently ignored
option would hand an agent an answer to another question.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from ...ipc.messages import (
    RequestOutput,
    Sampling,
    StructuredOutput,
    TokenizeRequest,
    TokenLogprob,
)
from ..logprobs import TokenText
from ..serving import choice_sampling

logger = logging.getLogger(__name__)

# The options a request may set, by Iris's names; any other option set to anything but
# null (or the default below) is refused. The frontend owns stop strings and how the text
# is detokenized, so those pass whatever they say.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
             "presence_penalty", "repetition_penalty")  # fmt: skip
_STOP = ("max_tokens", "min_tokens", "ignore_eos")
_FRONTEND = {"stop_conditions": {"stop"}, "output_options": {"skip_special_tokens",
                                                             "formatted_prompt"}}  # fmt: skip
_DEFAULTS: Mapping[str, object] = {"best_of": 1, "use_beam_search": False}
_TYPES = {field.name: field.type for field in msgspec.structs.fields(Sampling)}


class RefusedField(ValueError):
    """The request asks for something Iris does not serve this way; names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


_MEDIA = ("image_url", "video_url")  # the frontend's kinds of `multi_modal_data` Iris takes


def media_urls(request: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The request's image and video URLs, each in prompt order; other media is refused."""
    media = request.get("multi_modal_data") or {}
    urls: dict[str, list[str]] = {kind: [] for kind in _MEDIA}
    for kind, items in media.items():
        if kind not in urls:
            raise RefusedField(f"multi_modal_data.{kind}", "Iris takes images and videos")
        for index, item in enumerate(items or ()):
            url = item.get("Url") if isinstance(item, dict) else None
            if not isinstance(url, str):
                raise RefusedField(f"multi_modal_data.{kind}[{index}]", "no URL")
            urls[kind].append(url)
    return urls["image_url"], urls["video_url"]


def routing_hashes(request: Mapping[str, Any], count: int) -> list[int] | None:
    """The frontend router's id of each image (`extra_args.mm_hashes`, hex), or None."""
    hashes = (request.get("extra_args") or {}).get("mm_hashes")
    if not hashes:
        return None
    if len(hashes) != count:
        raise RefusedField("extra_args.mm_hashes", f"{len(hashes)} hashes for {count} images")
    try:
        values = [int(value, 16) for value in hashes]
    except (TypeError, ValueError):
        raise RefusedField("extra_args.mm_hashes", "not hexadecimal") from None
    if any(value >= 1 << 64 for value in values):
        raise RefusedField("extra_args.mm_hashes", "a hash has more than 64 bits")
    return values


def sampling(request: Mapping[str, Any], defaults: Mapping[str, Any]) -> Sampling:
    """The request's sampling: its options, else the model's generation defaults; each
    checked against Iris's type for it (the scheduler checks the ranges at admission)."""
    options = dict(request.get("sampling_options") or {})
    options.pop("n", None)  # `choices` reads it
    stop = dict(request.get("stop_conditions") or {})
    output = dict(request.get("output_options") or {})
    given: dict[str, tuple[str, Any]] = {}  # Iris's name -> (the request's field, value)
    for name in _SAMPLING:
        value = options.pop(name, None)
        value = defaults.get(name) if value is None else value
        if value is not None:
            given[name] = (f"sampling_options.{name}", value)
    for name in _STOP:
        value = stop.pop(name, None)
        if value is not None:
            given[name] = (f"stop_conditions.{name}", value)
    # the EOS ids the frontend hides from the text: Iris stops on them too
    hidden = stop.pop("stop_token_ids_hidden", None)
    if hidden:
        given["stop_token_ids"] = ("stop_conditions.stop_token_ids_hidden", hidden)
    guided = options.pop("guided_decoding", None)
    logprobs = output.pop("logprobs", None)
    if logprobs is not None:  # k: each token's logprob and the k most likely tokens'
        given["logprobs"] = ("output_options.logprobs", logprobs)
    for where, rest in (("sampling_options", options), ("stop_conditions", stop),
                        ("output_options", output)):  # fmt: skip
        _refuse_set(where, rest, _FRONTEND.get(where, set()))
    fields: dict[str, Any] = {}
    for name, (where, value) in given.items():
        try:
            fields[name] = msgspec.convert(value, _TYPES[name])
        except msgspec.ValidationError as error:
            raise RefusedField(where, str(error)) from None
    fields.setdefault("max_tokens", 0)  # none given: as many as the context allows
    if fields.get("top_k", 0) < 0:
        fields["top_k"] = 0  # -1 and 0 both mean "off"
    return Sampling(**fields, structured=_constraint(guided))


NO_DP_RANK = 2**32 - 1  # what the router sends where it chose no rank (u32::MAX)


def routed_replica(request: Mapping[str, Any], replicas: int) -> int | None:
    """The data-parallel replica Dynamo's KV router chose (`routing.dp_rank`), whose KV
    events it routed on; None where it chose none or one this worker does not have (a
    router's rank is never the user's error, so the image router picks instead, as vLLM's
    worker falls back to its own choice)."""
    rank = (request.get("routing") or {}).get("dp_rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank == NO_DP_RANK:
        return None
    if not 0 <= rank < replicas:
        logger.warning(
            "the router chose dp_rank %d of %d replicas; picking one here", rank, replicas
        )
        return None
    return rank


def choices(request: Mapping[str, Any]) -> int:
    """How many answers the request asks for (`sampling_options.n`, null: one); each runs
    as its own Iris request (`choice_requests`)."""
    n = (request.get("sampling_options") or {}).get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RefusedField("sampling_options.n", f"must be a positive integer, got {n!r}")
    return n


def choice_requests(request: TokenizeRequest, n: int) -> list[TokenizeRequest]:
    """The `n` Iris requests of one asking for `n` answers: ids `<id>-<i>`, choice i of a
    seeded request drawing with seed + i (as `iris serve` runs `n`)."""
    if n == 1:
        return [request]
    return [
        msgspec.structs.replace(
            request,
            request_id=f"{request.request_id}-{i}",
            sampling=choice_sampling(request.sampling, i),
        )
        for i in range(n)
    ]


def tokenize_request(
    request: Mapping[str, Any],
    request_id: str,
    defaults: Mapping[str, Any],
    max_logprobs: int = 20,
) -> TokenizeRequest:
    """The Iris request for a Dynamo one (see the module); `RefusedField` if it cannot be
    (`max_logprobs`: the most top tokens a request may ask for, `--max-logprobs`)."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise RefusedField("token_ids", "the prompt is empty")
    urls, video_urls = media_urls(request)
    expected = (request.get("mm_routing_info") or {}).get("expanded_prompt_len")
    options = sampling(request, defaults)
    choices(request)  # a malformed `n` is refused with the rest
    if options.logprobs is not None and not 0 <= options.logprobs <= max_logprobs:
        raise RefusedField(
            "output_options.logprobs",
            f"at most {max_logprobs} top logprobs (--max-logprobs), got {options.logprobs}",
        )
    return TokenizeRequest(
        request_id,
        options,
        prompt=list(token_ids),
        image_urls=urls or None,
        image_routing_hashes=routing_hashes(request, len(urls)) if urls else None,
        expected_prompt_len=expected if urls or video_urls else None,
        video_urls=video_urls or None,
    )


def output_chunk(output: RequestOutput, text: TokenText, index: int = 0) -> dict[str, Any]:
    """What the frontend reads of one output: the new tokens (with logprobs where asked:
    one per token, and its most likely tokens', in vLLM's backend's shape, each top
    token's text as `text` decodes it alone), and on the last one the finish reason and the
    usage (cached tokens included); `index`: which of the request's answers it is."""
    chunk: dict[str, Any] = {"token_ids": output.new_token_ids, "index": index}
    if output.logprobs:
        chunk["log_probs"] = [item.logprob for item in output.logprobs]
        chunk["top_logprobs"] = [_top_entries(item, text) for item in output.logprobs]
    if output.finished:
        reason = output.finish_reason
        chunk["finish_reason"] = "cancelled" if reason == "abort" else reason
        cached: dict[str, int] = {"cached_tokens": output.cached_tokens}
        chunk["completion_usage"] = {
            "prompt_tokens": output.prompt_tokens,
            "completion_tokens": output.completion_tokens,
            "total_tokens": output.prompt_tokens + output.completion_tokens,
            "prompt_tokens_details": cached,
        }
    return chunk


def _top_entries(item: TokenLogprob, text: TokenText) -> list[dict[str, Any]]:
    """A token's most likely tokens by rank (the frontend shows them as the position's
    `top_logprobs`; the sampled token's own text it takes from `token_ids`)."""
    entries = []
    for rank, (token_id, logprob) in enumerate(item.top, 1):
        token, raw = text(token_id)
        entries.append({"rank": rank, "token_id": token_id, "token": token,
                        "logprob": logprob, "bytes": raw})  # fmt: skip
    return entries


def _constraint(guided: object) -> StructuredOutput | None:
    """Dynamo's `guided_decoding` (vLLM's fields) as Iris's constraint."""
    if not guided:
        return None
    if not isinstance(guided, dict):
        raise RefusedField("sampling_options.guided_decoding", "must be an object")
    given = {name: value for name, value in guided.items() if value not in (None, False)}
    given.pop("backend", None)
    given.pop("whitespace_pattern", None)
    if len(given) != 1:
        raise RefusedField("sampling_options.guided_decoding", f"one constraint, got {given}")
    ((kind, value),) = given.items()
    if kind == "json":
        spec = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutput("json_schema", spec)
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind in ("regex", "grammar"):
        return StructuredOutput(kind, str(value))
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(value)))
    raise RefusedField(f"sampling_options.guided_decoding.{kind}", "not served")


def _refuse_set(where: str, options: Mapping[str, Any], frontends: set[str]) -> None:
    """Refuses the first option set to anything but null or its default, unless the
    frontend serves it itself (`frontends`)."""
    for name, value in options.items():
        if value is None or name in frontends or _DEFAULTS.get(name, object()) == value:
            continue
        raise RefusedField(f"{where}.{name}", f"Iris does not serve it through Dynamo ({value!r})")
