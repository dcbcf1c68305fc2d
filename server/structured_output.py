"""A request's output constraint: `response_format`, vLLM's `structured_outputs` (and its
older `guided_*` spellings) or a `required`/named tool choice → one `StructuredOutput`,
checked here so that a constraint that cannot compile is a 400 naming its field before
the request costs anything. Two fields that both constrain the output are refused rather
than one silently winning. `strict` in a json_schema changes nothing: every schema is
enforced.
"""

from __future__ import annotations

import json

from ..common.grammars import grammar_error
from ..ipc.messages import StructuredOutput
from .errors import APIError
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    StructuredOutputs,
)
from .tool_choice import ToolPlan


def requested_constraint(
    body: ChatCompletionRequest | CompletionRequest, plan: ToolPlan | None = None
) -> StructuredOutput | None:
    """The request's constraint (None: free text); APIError when it has two or a bad one."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.response_format is not None and body.response_format.type != "text":
        found.append(("response_format", _response_format(body.response_format)))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    guided = {
        "guided_json": body.guided_json,
        "guided_regex": body.guided_regex,
        "guided_choice": body.guided_choice,
        "guided_grammar": body.guided_grammar,
    }
    for field, value in guided.items():
        if value is not None:
            found.append((field, _guided(field, value)))
    schema = plan.json_schema() if plan is not None else None
    if schema is not None:
        found.append(("tool_choice", StructuredOutput("json_schema", json.dumps(schema))))
    if not found:
        return None
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise APIError(
            400, f"{first} and {second} both constrain the output; send one", param=second
        )
    field, constraint = found[0]
    error = grammar_error(constraint)
    if error is not None:
        raise APIError(400, f"{field} cannot be enforced: {error}", param=field)
    if body.ignore_eos:
        raise APIError(400, f"ignore_eos cannot be combined with {field}: a complete "
                            "answer must end", param="ignore_eos")  # fmt: skip
    return constraint


def _response_format(response_format: ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    assert response_format.json_schema is not None  # the body's validator checks it
    return StructuredOutput("json_schema", json.dumps(response_format.json_schema.json_schema))


def _structured_outputs(params: StructuredOutputs) -> StructuredOutput:
    if params.json_ is not None:
        return _guided("guided_json", params.json_)
    if params.regex is not None:
        return StructuredOutput("regex", params.regex)
    if params.choice is not None:
        return StructuredOutput("choice", json.dumps(params.choice))
    if params.grammar is not None:
        return StructuredOutput("grammar", params.grammar)
    return StructuredOutput("json_object")


def _guided(field: str, value: object) -> StructuredOutput:
    if field == "guided_json":
        schema = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutput("json_schema", schema)
    if field == "guided_regex":
        return StructuredOutput("regex", str(value))
    if field == "guided_choice":
        return StructuredOutput("choice", json.dumps(value))
    return StructuredOutput("grammar", str(value))
