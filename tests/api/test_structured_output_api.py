"""Every way a request can constrain its output reaches the engine as one
`StructuredOutput`; two at once, one that cannot compile, or one with ignore_eos is a
400 naming the field, and nothing reaches the engine."""

from __future__ import annotations

import json

import pytest

from iris_serve.ipc.messages import StructuredOutput
from tests.fake_engine import chat

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
         StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput("choice", '["x", "y"]')),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, StructuredOutput("grammar", 'start: "a"')),
        ({"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"guided_choice": ["x"]}, StructuredOutput("choice", '["x"]')),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ],
)  # fmt: skip
def test_each_constraint_reaches_the_engine(client, engine, body, expected):
    assert chat(client, **body).status_code == 200
    assert engine.requests[0].sampling.structured == expected


def test_required_tool_choice_constrains_to_a_list_of_the_tools_calls(client, engine):
    assert chat(client, tools=[TOOL], tool_choice="required").status_code == 200
    schema = json.loads(engine.requests[0].sampling.structured.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    [call] = schema["items"]["anyOf"]
    assert call["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert call["properties"]["parameters"] == SCHEMA


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": SCHEMA, "tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_field(client, engine, body, param):
    refused = chat(client, **body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert engine.requests == []
