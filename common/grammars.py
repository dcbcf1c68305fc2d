"""A `StructuredOutput` constraint as a grammar of the llguidance engine.

Shared by the two roles that read constraints: the server checks a request's constraint
before it costs anything (`grammar_error`: no tokenizer needed) and the scheduler compiles
it into a per-request matcher (`scheduler.structured_output`). One translation, so the
two cannot disagree about what a constraint means.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance
from llguidance import LLMatcher

from ..ipc.messages import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["grammar_error", "grammar_of"]

_COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False}


def grammar_of(constraint: StructuredOutput) -> str:
    """The llguidance grammar for a constraint; ValueError when it is not one."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_COMPACT_JSON)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(json.loads(spec), defaults=_COMPACT_JSON)
    if kind == "regex":
        # \d and \w as ASCII (JSON Schema's and most users' reading), not any Unicode digit
        return LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec, 'dw')}/")
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)  # a JSON list of strings
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


def grammar_error(constraint: StructuredOutput) -> str | None:
    """Why a constraint cannot be compiled (None: it can); needs no tokenizer, so the
    server checks a request before it costs anything."""
    try:
        error = LLMatcher.validate_grammar(grammar_of(constraint), None)
    except (ValueError, TypeError) as e:  # bad JSON in spec; llguidance's own errors
        return str(e)
    return error or None
